"""``POST /v1/responses``: OpenAI's Responses API, stateless.

A request becomes a chat completion (server/responses_request.py). The reply is a ``response``
object: a ``message`` item with ``output_text``, then one ``function_call`` item per call;
``status`` is ``incomplete`` (``max_output_tokens``) when the reply was cut.

Streamed, the events are OpenAI's: ``response.created``, ``response.in_progress``, then per
output item ``response.output_item.added``; for the message ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``; for a call ``response.function_call_arguments.delta``...,
``response.function_call_arguments.done``; then ``response.output_item.done``; last
``response.completed`` (or ``response.incomplete``) with the whole response and its usage.
Every event has a ``sequence_number`` (server/responses_output.py).
"""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from vmkv.server.bodies import json_response
from vmkv.server.limits import BodyError
from vmkv.server.protocol import ChatCompletionRequest
from vmkv.server.responses_output import ResponseShape, stream_events
from vmkv.server.responses_request import ResponsesRequest, as_chat, without_oldest
from vmkv.server.session import ServingSession
from vmkv.server.structured import prepare_structure
from vmkv.server.tools import ToolPlan, plan_tools

#: Responses' names of the chat fields a structured-output error names
SENT_AS = {"response_format": "text.format"}


class ResponsesHandler:
    """Serves ``POST /v1/responses`` over a :class:`ServingSession`: a ``response`` object
    built off the loop, or its stream of events. ``create`` is the route (APIError for what
    the client must fix; no docstring: it would become the OpenAPI description)."""

    def __init__(self, session: ServingSession) -> None:
        self.session = session

    async def create(self, raw: Request) -> Response:
        s = self.session
        body = await s.parse(raw, ResponsesRequest)
        started = time.monotonic()
        s.check_model(body.model)
        chat = as_chat(body)
        plan = plan_tools(chat.tools, chat.tool_choice, chat.parallel_tool_calls,
                          s.chat_template or s.tokenizer.chat_template,
                          s.config.tool_call_parser)
        if body.max_tool_calls is not None:
            plan.max_calls = min(plan.max_calls or body.max_tool_calls, body.max_tool_calls)
        ids = await self._prompt(body, chat, plan)
        plan.use_reasoning(s.reasoning_parser, ids, s.template_kwargs(chat))
        max_tokens = (body.max_output_tokens if body.max_output_tokens is not None
                      else s.defaults.get("max_tokens"))
        params = plan.adjust(chat.sampling_params(
            max_tokens, chat.num_logprobs, s.defaults,
            structured_outputs=await prepare_structure(s.front, chat, plan.structure,
                                                       SENT_AS)), s.tokenizer)
        response_id = s.response_id("resp_", raw, body)
        streams = await s.submit(response_id, [ids], params, body.cache_salt, body,
                                 "/v1/responses")
        shape = ResponseShape(s, body, response_id, plan, params)
        if body.stream:
            return StreamingResponse(stream_events(s, shape, streams, started),
                                     media_type="text/event-stream")
        (out,) = await s.collect(raw, streams, started)
        return await json_response(s.workers, lambda: shape.final(out))

    async def _prompt(self, body: ResponsesRequest, chat: ChatCompletionRequest,
                      plan: ToolPlan) -> list[int]:
        """The prompt; with ``truncation: "auto"`` one that leaves room for
        ``max_output_tokens``, without the fewest oldest conversation items that makes it fit
        (a binary search: each try renders the template once); else the 400 of the whole."""
        s = self.session
        room = body.max_output_tokens or 1
        try:
            ids = await s.chat_ids(chat, plan.tools)
            if body.truncation != "auto" or len(ids) + room <= s.front.max_model_len:
                return ids
            refusal = BodyError(f"the input has {len(ids)} tokens: with max_output_tokens "
                                f"{room} it does not fit in {s.front.max_model_len}", "input")
        except BodyError as exc:
            if body.truncation != "auto" or exc.param != "messages":
                raise
            refusal = exc
        fitting, low, high = None, 1, len(chat.messages)
        while low <= high:
            drop = (low + high) // 2
            messages = without_oldest(chat, drop)
            if messages is None:  # fewer items than that to drop
                high = drop - 1
                continue
            try:
                ids = await s.chat_ids(chat, plan.tools, messages)
            except BodyError:
                ids = None
            if ids is not None and len(ids) + room <= s.front.max_model_len:
                fitting, high = ids, drop - 1
            else:
                low = drop + 1
        if fitting is None:
            raise refusal
        return fitting
