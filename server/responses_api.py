"""``POST /v1/responses``: OpenAI's Responses API, stateless.

A request becomes a chat completion: ``instructions`` a system message, ``input`` (text, or
items: messages, earlier ``function_call`` items and their ``function_call_output``) the
conversation, function ``tools`` and ``tool_choice`` tool calling, ``text.format`` structured
outputs, ``max_output_tokens`` / ``temperature`` / ``top_p`` / ``top_logprobs`` sampling. The
reply is a ``response`` object: a ``message`` item with ``output_text``, then one
``function_call`` item per call; ``status`` is ``incomplete`` (``max_output_tokens``) when the
reply was cut.

Streamed, the events are OpenAI's: ``response.created``, ``response.in_progress``, then per
output item ``response.output_item.added``; for the message ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``; for a call ``response.function_call_arguments.delta``...,
``response.function_call_arguments.done``; then ``response.output_item.done``; last
``response.completed`` (or ``response.incomplete``) with the whole response and its usage.
Every event has a ``sequence_number``.

Nothing is stored: ``store: true`` and ``previous_response_id`` are refused (400) rather than
ignored, as are hosted tools, non-text inputs and background mode.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import Field, ValidationError, ValidationInfo, field_validator

from vmkv.engine.outputs import CompletionOutput, RequestOutput
from vmkv.server import responses as R
from vmkv.server.bodies import json_response
from vmkv.server.errors import APIError
from vmkv.server.protocol import ChatCompletionRequest, RequestModel
from vmkv.server.structured import prepare_structure
from vmkv.server.tools import ToolPlan, plan_tools

if TYPE_CHECKING:
    from vmkv.server.app import _Api

LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ResponsesRequest(RequestModel):
    """``POST /v1/responses`` (the fields vmkv honours or refuses; docs/server.md)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = Field(default=None, ge=1)
    text: dict[str, Any] | None = None
    stream: bool = False
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    # vLLM's sampling extras
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    cache_salt: str | None = None
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    priority: int = 0

    @field_validator("store", "previous_response_id", "background", "conversation", "prompt",
                     "truncation")
    @classmethod
    def _stateless(cls, value: Any, info: ValidationInfo) -> Any:
        if value in (None, False, "disabled"):
            return value
        why = {"store": "store: true needs stored responses",
               "previous_response_id": "previous_response_id names a stored response",
               "conversation": "conversations are stored state",
               "prompt": "prompt templates are stored state",
               "background": "background responses are stored and polled",
               "truncation": "truncation 'auto' would drop input items"}[info.field_name]
        raise ValueError(f"{why}, and vmkv's Responses API is stateless: nothing is stored. "
                         "Send the whole conversation as input (earlier output items "
                         "included) and leave store, previous_response_id, conversation, "
                         "prompt and background unset")

    @field_validator("text")
    @classmethod
    def _text_format_only(cls, text: dict[str, Any] | None) -> dict[str, Any] | None:
        other = sorted(set(text or {}) - {"format"})
        if other:
            raise ValueError(f"text.{other[0]} is not supported (only text.format is)")
        return text

    @field_validator("include")
    @classmethod
    def _includes(cls, include: list[str] | None) -> list[str] | None:
        for item in include or []:
            if item != LOGPROBS_INCLUDE:
                raise ValueError(f"only {LOGPROBS_INCLUDE!r} can be included, got {item!r}")
        return include

    @field_validator("reasoning")
    @classmethod
    def _no_reasoning(cls, reasoning: dict[str, Any] | None) -> dict[str, Any] | None:
        if reasoning and any(v is not None for v in reasoning.values()):
            raise ValueError("reasoning options are not supported (vmkv serves no reasoning "
                             "parser)")
        return reasoning

    @property
    def wants_logprobs(self) -> bool:
        return self.top_logprobs is not None or LOGPROBS_INCLUDE in (self.include or [])


async def create(api: _Api, body: ResponsesRequest, raw: Request) -> Response:
    """Serve one ``POST /v1/responses``."""
    started = time.monotonic()
    api.check_model(body.model)
    chat = _as_chat(body)
    plan = plan_tools(chat.tools, chat.tool_choice, chat.parallel_tool_calls,
                      api.chat_template or api.tokenizer.chat_template,
                      api.config.tool_call_parser)
    if body.max_tool_calls is not None:
        plan.max_calls = min(plan.max_calls or body.max_tool_calls, body.max_tool_calls)
    ids = await api.chat_ids(chat, plan.tools)
    max_tokens = (body.max_output_tokens if body.max_output_tokens is not None
                  else api.defaults.get("max_tokens"))
    params = chat.sampling_params(
        max_tokens, chat.num_logprobs, api.defaults,
        structured_outputs=await prepare_structure(api.front, chat, plan.structure))
    response_id = api.response_id("resp_", raw, body)
    streams = await api.submit(response_id, [ids], params, body.cache_salt, body,
                               "/v1/responses")
    shape = ResponseShape(api, body, response_id, plan)
    if body.stream:
        return StreamingResponse(_stream(api, shape, streams, started),
                                 media_type="text/event-stream")
    (out,) = await api.collect(raw, streams, started)
    return await json_response(lambda: shape.final(out))


# -- the request as a chat completion ----------------------------------------------------------
def _as_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        for i, item in enumerate(body.input):
            _add_item(messages, item, f"input.{i}")
    if not messages:
        raise APIError(400, "input must hold at least one message", "input")
    fields: dict[str, Any] = {
        "messages": messages, "tools": _chat_tools(body.tools),
        "tool_choice": _chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls, "temperature": body.temperature,
        "top_p": body.top_p, "seed": body.seed, "top_k": body.top_k, "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty, "cache_salt": body.cache_salt,
        "response_format": _response_format(body.text),
        "logprobs": body.wants_logprobs, "top_logprobs": body.top_logprobs,
    }
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        error = exc.errors()[0]
        param = ".".join(str(x) for x in error["loc"]).replace("messages", "input")
        raise APIError(400, f"{param}: {error['msg']}", param) from None


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], param: str) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise APIError(400, f"unsupported message role {role!r}", f"{param}.role")
        messages.append({"role": role, "content": _text(item.get("content"), param)})
    elif kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
        if not all(isinstance(v, str) for v in (call["id"], *call["function"].values())):
            raise APIError(400, "a function_call item needs call_id, name and arguments "
                           "(strings)", param)
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and "tool_calls" in last:
            last["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise APIError(400, "a function_call_output item needs a call_id", param)
        messages.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": _text(item.get("output"), param)})
    else:
        raise APIError(400, f"input items of type {kind!r} are not supported (vmkv serves "
                       "text messages, function_call and function_call_output)",
                       f"{param}.type")


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in (
                    "input_text", "output_text", "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(400, f"content parts of type {kind!r} are not supported (text "
                               "only)", f"{param}.content.{j}.type")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise APIError(400, "content must be text or a list of text parts", f"{param}.content")


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    converted = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise APIError(400, f"tools of type {tool.get('type')!r} are not supported; vmkv "
                           "serves function tools ({'type': 'function', 'name': ...})",
                           f"tools.{i}")
        converted.append({"type": "function", "function": {
            k: tool[k] for k in ("name", "description", "parameters") if k in tool}})
    return converted


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {'type': "
                   "'function', 'name': ...}", "tool_choice")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object",
                                                            "json_schema"):
        raise APIError(400, "text.format.type must be text, json_object or json_schema",
                       "text.format")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    if not isinstance(fmt.get("schema"), dict):
        raise APIError(400, "text.format needs a 'schema' object", "text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"),
                                                   "schema": fmt["schema"]}}


# -- the response --------------------------------------------------------------------------------
class ResponseShape:
    """The response object of one request, and its output items, as they are built."""

    def __init__(self, api: _Api, body: ResponsesRequest, response_id: str,
                 plan: ToolPlan) -> None:
        self.api, self.body, self.id, self.plan = api, body, response_id, plan
        self.created = int(time.time())
        self.message_id = f"msg_{uuid.uuid4().hex}"

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
            "max_tool_calls": body.max_tool_calls, "model": self.api.model_name,
            "output": output, "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": None, "reasoning": None, "store": False,
            "temperature": body.temperature, "top_p": body.top_p,
            "top_logprobs": body.top_logprobs,
            "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
            "tools": body.tools or [], "truncation": "disabled", "metadata": body.metadata or {},
            "user": body.user, "background": False, "usage": usage,
        }

    def status(self, finish_reason: str | None) -> str:
        return "completed" if finish_reason in ("stop", "tool_calls") else "incomplete"

    def message(self, text: str, status: str, logprobs: list[dict] | None) -> dict[str, Any]:
        part = {"type": "output_text", "text": text, "annotations": []}
        if logprobs is not None:
            part["logprobs"] = logprobs
        return {"type": "message", "id": self.message_id, "status": status,
                "role": "assistant", "content": [part]}

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
        return R.chat_logprobs(self.api.token_text, token_ids, entries,
                               self.body.top_logprobs or 0, lazy)["content"]

    def usage(self, out: RequestOutput) -> dict[str, Any]:
        output_tokens = sum(len(c.token_ids) for c in out.outputs)
        return {"input_tokens": out.num_prompt_tokens,
                "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": out.num_prompt_tokens + output_tokens}

    def final(self, out: RequestOutput) -> dict[str, Any]:
        """The whole response of a finished request."""
        (c,) = out.outputs
        message, finish_reason = self.plan.message(c.text, c.finish_reason)
        status = self.status(finish_reason)
        output = []
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
        self.call: dict[str, Any] | None = None  # the open function call item

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
        if delta.get("content"):
            if self.text is None:
                events += self._open_message()
            self.text += delta["content"]
            self.logprobs += logprobs or []
            events.append(self.event(
                "response.output_text.delta", item_id=self.shape.message_id,
                output_index=len(self.output), content_index=0, delta=delta["content"],
                logprobs=logprobs or []))
        for piece in delta.get("tool_calls", []):
            events += self._call_piece(piece)
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

    def finish(self, out: RequestOutput, finish_reason: str | None) -> list[str]:
        status = self.shape.status(finish_reason)
        events = self._close_message(status) + self._close_call()
        response = self.shape.envelope(status, self.output, self.shape.usage(out),
                                       finish_reason)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*events, self.event(kind, response=response)]


async def _stream(api: _Api, shape: ResponseShape, streams: list, started: float
                  ) -> AsyncIterator[str]:
    writer = EventWriter(shape)
    choice = shape.plan.stream()
    tracker = R.ChoiceTracker()
    finish_reason = None
    for event in writer.start():
        yield event
    try:
        async for _, out in api.merged(streams, started):
            c: CompletionOutput = out.outputs[0]
            d = tracker.delta(c)
            if d is None:
                continue
            deltas, finish_reason = choice.feed(d.text, d.finish_reason)
            logprobs = shape.logprobs(d.token_ids, d.logprobs)
            for k, delta in enumerate(deltas or ([{}] if logprobs else [])):
                for event in writer.delta(delta, logprobs if k == 0 else None):
                    yield event
            if out.finished:
                for event in writer.finish(out, finish_reason):
                    yield event
    except Exception as exc:  # noqa: BLE001 - the client must see an end, not a hang
        status = exc.status if isinstance(exc, APIError) else 500
        message = exc.message if isinstance(exc, APIError) else f"internal error: {exc!r}"
        yield writer.event("error", code=str(status), message=message, param=None)
