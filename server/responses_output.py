"""The output side of ``POST /v1/responses``: the ``response`` object and its output items
(:class:`ResponseShape`), and the stream of events that builds them (:class:`EventWriter`),
from the chat-completion pieces the request became (server/responses_request.py)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from vmkv.engine.outputs import OutputAccumulator, RequestOutput
from vmkv.server import responses as R
from vmkv.server.errors import APIError
from vmkv.server.tools import ToolPlan

if TYPE_CHECKING:
    from vmkv.engine.front import Stream
    from vmkv.sampling_params import SamplingParams
    from vmkv.server.responses_request import ResponsesRequest
    from vmkv.server.session import ServingSession


class ResponseShape:
    """The response object of one request, and its output items, as they are built
    (``params``: the sampling it runs with, whose effective values the response reports)."""

    def __init__(self, session: ServingSession, body: ResponsesRequest, response_id: str,
                 plan: ToolPlan, params: SamplingParams) -> None:
        self.session, self.body, self.id, self.plan = session, body, response_id, plan
        self.params = params
        self.created = int(time.time())
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"

    def envelope(self, status: str, output: list[dict[str, Any]],
                 usage: dict[str, Any] | None = None,
                 finish_reason: str | None = None) -> dict[str, Any]:
        body = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None,
            "incomplete_details": ({"reason": "max_output_tokens"}
                                   if finish_reason == "length" else None),
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls, "model": self.session.model_name,
            "output": output, "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": None, "reasoning": body.reasoning or None, "store": False,
            "temperature": self.params.temperature, "top_p": self.params.top_p,
            "top_logprobs": body.top_logprobs,
            "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
            "tools": body.tools or [], "truncation": body.truncation or "disabled",
            "metadata": body.metadata or {}, "user": body.user, "background": False, "usage": usage,
        }

    def status(self, finish_reason: str | None) -> str:
        return "completed" if finish_reason in ("stop", "tool_calls") else "incomplete"

    def message(self, text: str, status: str, logprobs: list[dict] | None) -> dict[str, Any]:
        part = {"type": "output_text", "text": text, "annotations": []}
        if logprobs is not None:
            part["logprobs"] = logprobs
        return {"type": "message", "id": self.message_id, "status": status,
                "role": "assistant", "content": [part]}

    def reasoning(self, text: str, status: str) -> dict[str, Any]:
        """A reasoning item: the thinking's text (no summary, no encrypted state)."""
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}],
                "encrypted_content": None, "status": status}

    @staticmethod
    def call(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
        return {"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}",
                "call_id": call["id"], "name": call["function"]["name"],
                "arguments": call["function"]["arguments"], "status": status}

    def logprobs(self, token_ids: list[int], entries: list[dict[int, float]],
                 lazy: bool = False) -> Any:
        """The output text's logprobs (None when not asked for; ``lazy``: an iterator)."""
        if not self.body.wants_logprobs:
            return None
        return R.chat_logprobs(self.session.token_text, token_ids, entries,
                               self.body.top_logprobs or 0, lazy)["content"]

    def usage(self, out: RequestOutput) -> dict[str, Any]:
        output_tokens = sum(len(c.token_ids) for c in out.outputs)
        return {"input_tokens": out.num_prompt_tokens,
                "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": sum(
                    self.plan.reasoning_tokens(c.token_ids) for c in out.outputs)},
                "total_tokens": out.num_prompt_tokens + output_tokens}

    def final(self, out: RequestOutput) -> dict[str, Any]:
        """The whole response of a finished request."""
        (c,) = out.outputs
        message, finish_reason = self.plan.message(c.text, c.finish_reason)
        status = self.status(finish_reason)
        output = []
        if message.get("reasoning"):  # completed once anything follows it
            followed = message["content"] or "tool_calls" in message
            output.append(self.reasoning(message["reasoning"],
                                         "completed" if followed else status))
        if message["content"] is not None and (message["content"] or "tool_calls"
                                               not in message):
            output.append(self.message(message["content"], status,
                                       self.logprobs(c.token_ids, c.logprobs or [], lazy=True)))
        output += [self.call(call) for call in message.get("tool_calls", [])]
        return self.envelope(status, output, self.usage(out), finish_reason)


class EventWriter:
    """The events of one streamed response, numbered; chat deltas in, Responses events out."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.text: str | None = None  # the open message's text
        self.logprobs: list[dict[str, Any]] = []
        self.held: list[dict[str, Any]] = []  # logprobs of text not streamed yet (held back)
        self.call: dict[str, Any] | None = None  # the open function call item
        self.thought: str | None = None  # the open reasoning item's text

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\n{R.sse(payload)}"

    def start(self) -> list[str]:
        response = self.shape.envelope("in_progress", [])
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def delta(self, delta: dict[str, Any], logprobs: list[dict[str, Any]] | None) -> list[str]:
        """Events for one chat delta (content, or tool-call pieces)."""
        events: list[str] = []
        self.held += logprobs or []
        if delta.get("reasoning"):
            events += self._reasoning(delta["reasoning"])
        if delta.get("content") or delta.get("tool_calls"):
            events += self._close_reasoning("completed")
        if delta.get("content"):
            if self.text is None:
                events += self._open_message()
            self.text += delta["content"]
            sent, self.held = self.held, []
            self.logprobs += sent
            events.append(self.event(
                "response.output_text.delta", item_id=self.shape.message_id,
                output_index=len(self.output), content_index=0, delta=delta["content"],
                logprobs=sent))
        for piece in delta.get("tool_calls", []):
            events += self._call_piece(piece)
        return events

    def _reasoning(self, text: str) -> list[str]:
        events = []
        index, item_id = len(self.output), self.shape.reasoning_id
        if self.thought is None:
            self.thought = ""
            item = {**self.shape.reasoning("", "in_progress"), "content": []}
            events += [self.event("response.output_item.added", output_index=index, item=item),
                       self.event("response.content_part.added", item_id=item_id,
                                  output_index=index, content_index=0,
                                  part={"type": "reasoning_text", "text": ""})]
        self.thought += text
        events.append(self.event("response.reasoning_text.delta", item_id=item_id,
                                 output_index=index, content_index=0, delta=text))
        return events

    def _close_reasoning(self, status: str) -> list[str]:
        if self.thought is None:
            return []
        item = self.shape.reasoning(self.thought, status)
        index, item_id = len(self.output), self.shape.reasoning_id
        events = [self.event("response.reasoning_text.done", item_id=item_id,
                             output_index=index, content_index=0, text=self.thought),
                  self.event("response.content_part.done", item_id=item_id, output_index=index,
                             content_index=0, part=item["content"][0]),
                  self.event("response.output_item.done", output_index=index, item=item)]
        self.output.append(item)
        self.thought = None
        return events

    def _open_message(self) -> list[str]:
        self.text = ""
        item = self.shape.message("", "in_progress", None)
        item["content"] = []
        return [self.event("response.output_item.added", output_index=len(self.output),
                           item=item),
                self.event("response.content_part.added", item_id=self.shape.message_id,
                           output_index=len(self.output), content_index=0,
                           part={"type": "output_text", "text": "", "annotations": []})]

    def _close_message(self, status: str) -> list[str]:
        if self.text is None:
            return []
        self.logprobs += self.held  # of text held back and then not streamed (a tool call's)
        self.held = []
        logprobs = self.logprobs if self.shape.body.wants_logprobs else None
        item = self.shape.message(self.text, status, logprobs)
        index, item_id = len(self.output), self.shape.message_id
        events = [self.event("response.output_text.done", item_id=item_id, output_index=index,
                             content_index=0, text=self.text, logprobs=self.logprobs),
                  self.event("response.content_part.done", item_id=item_id,
                             output_index=index, content_index=0, part=item["content"][0]),
                  self.event("response.output_item.done", output_index=index, item=item)]
        self.output.append(item)
        self.text = None
        return events

    def _call_piece(self, piece: dict[str, Any]) -> list[str]:
        events = self._close_message("completed")
        if "id" in piece:  # a new call: its header (and, whole calls, its arguments)
            events += self._close_call()
            self.call = self.shape.call({**piece, "function": {**piece["function"],
                                                               "arguments": ""}}, "in_progress")
            events.append(self.event("response.output_item.added",
                                     output_index=len(self.output), item=dict(self.call)))
        arguments = piece.get("function", {}).get("arguments") or ""
        if arguments and self.call is not None:
            self.call["arguments"] += arguments
            events.append(self.event("response.function_call_arguments.delta",
                                     item_id=self.call["id"], output_index=len(self.output),
                                     delta=arguments))
        return events

    def _close_call(self) -> list[str]:
        if self.call is None:
            return []
        call, index = {**self.call, "status": "completed"}, len(self.output)
        self.output.append(call)
        self.call = None
        return [self.event("response.function_call_arguments.done", item_id=call["id"],
                           output_index=index, name=call["name"], arguments=call["arguments"]),
                self.event("response.output_item.done", output_index=index, item=call)]

    def fail(self, status: int, message: str) -> list[str]:
        """The end of a response that failed midway: an ``error`` event, then
        ``response.failed`` with what was built so far."""
        response = self.shape.envelope("failed", self.output)
        response["error"] = {"code": "server_error" if status >= 500 else "invalid_request",
                             "message": message}
        return [self.event("error", code=str(status), message=message, param=None),
                self.event("response.failed", response=response)]

    def finish(self, out: RequestOutput, finish_reason: str | None) -> list[str]:
        status = self.shape.status(finish_reason)
        opened = self._close_reasoning(status)
        if self.text is None and self.call is None and not self.output:
            opened += self._open_message()  # an empty reply is one empty message, as unstreamed
        events = opened + self._close_message(status) + self._close_call()
        response = self.shape.envelope(status, self.output, self.shape.usage(out),
                                       finish_reason)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*events, self.event(kind, response=response)]


async def stream_events(session: ServingSession, shape: ResponseShape, streams: list[Stream],
                        started: float) -> AsyncIterator[str]:
    """The events of a streamed response (an ``error`` event if it fails midway); the streams
    yield deltas, added up for the final response's usage."""
    writer = EventWriter(shape)
    choice = shape.plan.stream()
    total = OutputAccumulator()
    finish_reason = None
    for event in writer.start():
        yield event
    try:
        async for _, out in session.merged(streams, started):
            total.add(out)
            for c in out.outputs:  # one choice: each delta holds at most one output
                deltas, finish_reason = choice.feed(c.text, c.finish_reason)
                logprobs = shape.logprobs(c.token_ids, c.logprobs or [])
                for k, delta in enumerate(deltas or ([{}] if logprobs else [])):
                    for event in writer.delta(delta, logprobs if k == 0 else None):
                        yield event
            if out.finished:
                for event in writer.finish(total.take(), finish_reason):
                    yield event
    except Exception as exc:  # noqa: BLE001 - the client must see an end, not a hang
        status = exc.status if isinstance(exc, APIError) else 500
        message = exc.message if isinstance(exc, APIError) else f"internal error: {exc!r}"
        for event in writer.fail(status, message):
            yield event
