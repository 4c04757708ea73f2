"""``POST /v1/chat/completions``: messages rendered with the chat template, the reply shaped
into a message (reasoning and tool calls parsed out, server/tools.py); ``echo`` goes on from a
last message in the reply's role (vLLM's)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from vmkv.engine.front import Stream
from vmkv.engine.outputs import RequestOutput
from vmkv.server import responses as R
from vmkv.server.bodies import json_response
from vmkv.server.prompt_logprobs import vllm_prompt_logprobs
from vmkv.server.protocol import ChatCompletionRequest
from vmkv.server.session import ServingSession
from vmkv.server.structured import prepare_structure
from vmkv.server.tools import ToolPlan, plan_tools


class ChatHandler:
    """Serves ``POST /v1/chat/completions`` over a :class:`ServingSession`: a JSON body built
    off the loop, or an SSE stream (a role delta per choice first, ``[DONE]`` last).
    ``create`` is the route (APIError for what the client must fix; no docstring: it would
    become the OpenAPI description)."""

    def __init__(self, session: ServingSession) -> None:
        self.session = session

    async def create(self, raw: Request) -> Response:
        s = self.session
        body = await s.parse(raw, ChatCompletionRequest)
        started = time.monotonic()
        s.check_model(body.model)
        s.check_n(body.n)
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls,
                          s.chat_template or s.tokenizer.chat_template,
                          s.config.tool_call_parser)
        messages = [m.as_dict() for m in body.messages]
        ids = await s.chat_ids(body, plan.tools, messages)
        plan.use_reasoning(s.reasoning_parser, ids, s.template_kwargs(body),
                           body.include_reasoning)
        max_tokens = (body.requested_max_tokens if body.requested_max_tokens is not None
                      else s.defaults.get("max_tokens"))
        params = plan.adjust(body.sampling_params(
            max_tokens, body.num_logprobs, s.defaults,
            prompt_logprobs=body.wanted_prompt_logprobs,
            structured_outputs=await prepare_structure(s.front, body, plan.structure)),
            s.tokenizer)
        request_id = s.response_id("chatcmpl-", raw, body)
        streams = await s.submit(request_id, [ids], params, body.cache_salt, body,
                                 "/v1/chat/completions")
        # echo: the reply goes on from the last message when it has the reply's role (vLLM)
        echo = body.echoed(s.config.response_role)
        if body.stream:
            return StreamingResponse(R.ending_with_errors(self._stream(
                request_id, streams, started, body, ids, plan, echo)),
                media_type="text/event-stream")
        (out,) = await s.collect(raw, streams, started)
        return await json_response(
            s.workers, lambda: self._body(request_id, out, body, plan, echo))

    def _token_text(self, body: ChatCompletionRequest) -> Callable[[int], str]:
        return R.token_id_text if body.return_tokens_as_token_ids else self.session.token_text

    def _body(self, request_id: str, out: RequestOutput, body: ChatCompletionRequest,
              plan: ToolPlan, echo: str) -> dict[str, Any]:
        """The body of a finished chat completion (run off the loop: logprobs are big)."""
        token_text = self._token_text(body)
        hidden = plan.hides_reasoning  # no token text that would show the hidden thinking
        choices = []
        for c in out.outputs:
            message, finish_reason = plan.message(c.text, c.finish_reason)
            message["role"] = body.reply_role(self.session.config.response_role)
            if echo:
                message["content"] = echo + (message["content"] or "")
            choice = {"index": c.index, "message": message,
                      "logprobs": None, "finish_reason": finish_reason,
                      "stop_reason": c.stop_reason}
            if body.logprobs and not hidden:
                choice["logprobs"] = R.chat_logprobs(token_text, c.token_ids, c.logprobs or [],
                                                     body.top_logprobs or 0, lazy=True)
            if body.return_token_ids and not hidden:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        response = {
            **R.envelope(request_id, "chat.completion", self.session.model_name),
            "choices": choices,
            "usage": _usage(plan, out.num_prompt_tokens,
                            sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens,
                            sum(plan.reasoning_tokens(c.token_ids) for c in out.outputs)),
        }
        if body.wanted_prompt_logprobs is not None:
            response["prompt_logprobs"] = vllm_prompt_logprobs(self.session.token_text, out)
        if body.return_token_ids:
            response["prompt_token_ids"] = out.prompt_token_ids
        return response

    async def _stream(self, request_id: str, streams: list[Stream], started: float,
                      body: ChatCompletionRequest, prompt_ids: list[int], plan: ToolPlan,
                      echo: str) -> AsyncIterator[str]:
        """The SSE chunks: per choice a role delta (and the echo), then the reply's deltas
        (tool calls shaped by ``plan``); the usage chunk (``stream_options.include_usage``)
        and ``[DONE]`` last."""
        base = R.envelope(request_id, "chat.completion.chunk", self.session.model_name)
        role = body.reply_role(self.session.config.response_role)
        token_text = self._token_text(body)
        shapers = {index: plan.stream() for index in range(body.n)}
        return_ids = body.return_token_ids and not plan.hides_reasoning
        prompt_tokens, completion_tokens, cached = len(prompt_ids), 0, 0

        def chunk(choice: dict[str, Any], **extra: Any) -> str:
            if body.continuous_usage:
                extra["usage"] = R.usage(prompt_tokens, completion_tokens)
            return R.sse({**base, "choices": [choice], **extra})

        first = {"prompt_token_ids": prompt_ids} if body.return_token_ids else {}
        for index in range(body.n):  # the role comes first, once per choice, then any echo
            yield chunk({"index": index, "delta": {"role": role, "content": ""},
                         "logprobs": None, "finish_reason": None}, **first)
            if echo:
                yield chunk({"index": index, "delta": {"content": echo}, "logprobs": None,
                             "finish_reason": None})
        async for _, out in self.session.merged(streams, started):
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                lp = None
                if body.logprobs and not plan.hides_reasoning:
                    lp = R.chat_logprobs(token_text, c.token_ids, c.logprobs or [],
                                         body.top_logprobs or 0)
                deltas, finish_reason = shapers[c.index].feed(c.text, c.finish_reason,
                                                              c.token_ids)
                if not deltas and (lp is not None or finish_reason is not None
                                   or return_ids):
                    deltas = [{}]
                for k, delta in enumerate(deltas):
                    last = k == len(deltas) - 1
                    ids = {"token_ids": c.token_ids} if return_ids and k == 0 else {}
                    yield chunk({"index": c.index, "delta": delta,
                                 "logprobs": lp if k == 0 else None,
                                 "finish_reason": finish_reason if last else None,
                                 "stop_reason": c.stop_reason if last else None, **ids})
            if out.finished:
                cached = out.num_cached_tokens
        if body.stream_options and body.stream_options.include_usage:
            thought = sum(shaper.reasoning_tokens for shaper in shapers.values())
            yield R.sse({**base, "choices": [],
                         "usage": _usage(plan, prompt_tokens, completion_tokens, cached,
                                         thought)})
        yield R.sse("[DONE]")


def _usage(plan: ToolPlan, prompt_tokens: int, completion_tokens: int, cached: int,
           reasoning_tokens: int) -> dict[str, Any]:
    """The usage object; with a reasoning parser it counts the thinking's tokens too
    (``completion_tokens_details.reasoning_tokens``, as vLLM reports them)."""
    usage = R.usage(prompt_tokens, completion_tokens, cached)
    if plan.reports_reasoning:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage
