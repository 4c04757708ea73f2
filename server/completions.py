"""``POST /v1/completions``: prompts (text or token ids, one or several) in, choices out,
indexed ``prompt_index * n + sample_index``; ``echo`` puts the prompt (and, with ``logprobs``,
its logprobs) in front of each choice's text."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from vmkv.engine.front import Stream
from vmkv.engine.outputs import RequestOutput
from vmkv.server import responses as R
from vmkv.server.bodies import json_response, sse_event
from vmkv.server.prompt_logprobs import (
    echo_logprobs,
    prompt_logprobs_wanted,
    prompt_text_offsets,
    vllm_prompt_logprobs,
)
from vmkv.server.protocol import CompletionRequest
from vmkv.server.session import ServingSession
from vmkv.server.structured import prepare_structure


class CompletionsHandler:
    """Serves ``POST /v1/completions`` over a :class:`ServingSession`: a JSON body built off
    the loop, or an SSE stream of chunks, ``[DONE]`` last. ``create`` is the route (APIError
    for what the client must fix; no docstring: it would become the OpenAPI description)."""

    def __init__(self, session: ServingSession) -> None:
        self.session = session

    async def create(self, raw: Request) -> Response:
        s = self.session
        body = await s.parse(raw, CompletionRequest)
        started = time.monotonic()
        s.check_model(body.model)
        s.check_n(body.n)
        prompts: list[list[int]] = []
        echo: list[str] = []  # the prompts as sent (token-id prompts: decoded)
        for p in body.prompts():  # token ids were checked with the body (limits.py)
            ids = await s.encode(p, body.add_special_tokens) if isinstance(p, str) else p
            prompts.append(s.prompt_ids(list(ids), body))
            if body.echo:
                cut = len(prompts[-1]) < len(ids)
                echo.append(p if isinstance(p, str) and not cut else
                            await s.workers.decode(prompts[-1]))
            else:
                echo.append("")
        max_tokens = (body.max_tokens if body.max_tokens is not None
                      else s.defaults.get("max_tokens", 16))
        params = body.sampling_params(max_tokens, body.logprobs, s.defaults,
                                      prompt_logprobs=prompt_logprobs_wanted(body, max_tokens),
                                      structured_outputs=await prepare_structure(s.front, body))
        request_id = s.response_id("cmpl-", raw, body)
        streams = await s.submit(request_id, prompts, params, body.cache_salt, body,
                                 "/v1/completions")
        if body.stream:
            return StreamingResponse(
                R.ending_with_errors(self._stream(
                    request_id, streams, started, echo, body, sum(map(len, prompts)))),
                media_type="text/event-stream")
        outs = await s.collect(raw, streams, started)
        return await json_response(s.workers, lambda: {
            **R.envelope(request_id, "text_completion", s.model_name),
            "choices": self._choices(outs, body, echo),
            "usage": R.usage(sum(o.num_prompt_tokens for o in outs),
                             sum(len(c.token_ids) for o in outs for c in o.outputs),
                             sum(o.num_cached_tokens for o in outs)),
        })

    def _token_text(self, body: CompletionRequest) -> Callable[[int], str]:
        return R.token_id_text if body.return_tokens_as_token_ids else self.session.token_text

    def _choices(self, outs: list[RequestOutput], body: CompletionRequest,
                 echo: list[str]) -> list[dict[str, Any]]:
        """The choices of a finished completion (run off the loop: logprobs are big)."""
        token_text = self._token_text(body)
        choices = []
        for i, out in enumerate(outs):
            for c in out.outputs:
                choice = {"index": i * body.n + c.index, "text": echo[i] + c.text,
                          "logprobs": None, "finish_reason": c.finish_reason,
                          "stop_reason": c.stop_reason}
                if body.logprobs is not None:
                    choice["logprobs"] = R.completion_logprobs(
                        token_text, c.token_ids, c.logprobs or [], len(echo[i]), body.logprobs,
                        lazy=True)
                    if body.echo:
                        choice["logprobs"] = echo_logprobs(
                            token_text, out, choice["logprobs"], body.logprobs,
                            self._echo_offsets(echo[i], out, body))
                if body.prompt_logprobs is not None:  # vLLM's extra, echo or not
                    choice["prompt_logprobs"] = vllm_prompt_logprobs(self.session.token_text,
                                                                     out)
                if body.return_token_ids:
                    choice["prompt_token_ids"] = out.prompt_token_ids
                    choice["token_ids"] = c.token_ids
                choices.append(choice)
        return choices

    def _echo_offsets(self, echo: str, out: RequestOutput, body: CompletionRequest
                      ) -> list[int] | None:
        """Where each echoed prompt token starts in the echoed text, for a text prompt."""
        if body.return_tokens_as_token_ids:
            return None
        return prompt_text_offsets(self.session.tokenizer, echo, out.prompt_token_ids,
                                   body.add_special_tokens)

    def _echo_event(self, payload: Callable[[dict[str, Any]], dict[str, Any]],
                    body: CompletionRequest, token_text: Callable[[int], str],
                    out: RequestOutput, choice: dict[str, Any]) -> bytes:
        """The streamed echo of a prompt, with its logprobs when asked (run off the loop)."""
        choice["logprobs"] = None if body.logprobs is None else echo_logprobs(
            token_text, out, None, body.logprobs, self._echo_offsets(choice["text"], out, body))
        return sse_event(payload(choice))

    async def _stream(self, request_id: str, streams: list[Stream], started: float,
                      echo: list[str], body: CompletionRequest, prompt_tokens: int
                      ) -> AsyncIterator[str | bytes]:
        """The SSE chunks: per choice its echo first (when asked), then one chunk per delta;
        the usage chunk (``stream_options.include_usage``) and ``[DONE]`` last."""
        base = R.envelope(request_id, "text_completion", self.session.model_name)
        token_text = self._token_text(body)
        text_offsets: dict[int, int] = {}  # per choice: characters streamed so far
        prompts: dict[int, RequestOutput] = {}  # per prompt: its first delta (the prompt's)
        completion_tokens = cached = 0

        def chunk_payload(choice: dict[str, Any]) -> dict[str, Any]:
            usage = ({"usage": R.usage(prompt_tokens, completion_tokens)}
                     if body.continuous_usage else {})
            return {**base, "choices": [choice], **usage}

        def chunk(choice: dict[str, Any]) -> str:
            return R.sse(chunk_payload(choice))

        async for i, out in self.session.merged(streams, started):
            prompts.setdefault(i, out)
            for c in out.outputs:
                index = i * body.n + c.index
                first: dict[str, Any] = {}  # what the choice's first chunk also carries
                if index not in text_offsets:
                    text_offsets[index] = len(echo[i])
                    if body.return_token_ids:
                        first["prompt_token_ids"] = prompts[i].prompt_token_ids
                    if echo[i]:  # the prompt's logprobs may be big: built off the loop
                        yield await self.session.workers.build(
                            self._echo_event, chunk_payload, body, token_text, prompts[i],
                            {"index": index, "text": echo[i], "finish_reason": None, **first})
                        first = {}
                completion_tokens += len(c.token_ids)
                lp = None
                if body.logprobs is not None:
                    lp = R.completion_logprobs(token_text, c.token_ids, c.logprobs or [],
                                               text_offsets[index], body.logprobs)
                text_offsets[index] += len(c.text)
                ids = {"token_ids": c.token_ids} if body.return_token_ids else {}
                yield chunk({"index": index, "text": c.text, "logprobs": lp,
                             "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                             **first, **ids})
            if out.finished:
                cached += out.num_cached_tokens
        if body.stream_options and body.stream_options.include_usage:
            yield R.sse({**base, "choices": [],
                         "usage": R.usage(prompt_tokens, completion_tokens, cached)})
        yield R.sse("[DONE]")
