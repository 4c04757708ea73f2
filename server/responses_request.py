"""The request side of ``POST /v1/responses`` (server/responses_api.py): the body
(:class:`ResponsesRequest`) and the chat completion it becomes (:func:`as_chat`).

``instructions`` become a system message, ``input`` (text, or items: messages, earlier
``function_call`` items and their ``function_call_output``) the conversation, function ``tools``
and ``tool_choice`` tool calling, ``text.format`` structured outputs, ``max_output_tokens`` /
``temperature`` / ``top_p`` / ``top_logprobs`` sampling.

Nothing is stored: ``store: true`` and ``previous_response_id`` are refused (400) rather than
ignored, as are hosted tools, non-text inputs and background mode. ``truncation: "auto"``
drops the oldest conversation items that do not fit (:func:`without_oldest`);
``include: ["reasoning.encrypted_content"]`` is accepted (there is no stored reasoning state
to encrypt: reasoning items carry none).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator

from vmkv.server.errors import APIError
from vmkv.server.protocol import ChatCompletionRequest, RequestModel

LOGPROBS_INCLUDE = "message.output_text.logprobs"
#: ``reasoning``'s options and their values (OpenAI's)
REASONING_OPTIONS = {
    "effort": ("none", "minimal", "low", "medium", "high", "xhigh"),
    "summary": ("auto", "concise", "detailed"), "generate_summary": ("auto", "concise",
                                                                     "detailed")}
#: what ``include`` may ask for: logprobs, and the encrypted reasoning agents ask for with
#: ``store: false`` (accepted: vmkv keeps no reasoning state, so there is none to return)
INCLUDES = (LOGPROBS_INCLUDE, "reasoning.encrypted_content")


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
    parallel_tool_calls: bool | None = True  # null: true (NULL_IS_DEFAULT)
    max_tool_calls: int | None = Field(default=None, ge=1)
    text: dict[str, Any] | None = None
    stream: bool | None = False
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

    @field_validator("store", "previous_response_id", "background", "conversation", "prompt")
    @classmethod
    def _stateless(cls, value: Any, info: ValidationInfo) -> Any:
        if value in (None, False):
            return value
        why = {"store": "store: true needs stored responses",
               "previous_response_id": "previous_response_id names a stored response",
               "conversation": "conversations are stored state",
               "prompt": "prompt templates are stored state",
               "background": "background responses are stored and polled"}[info.field_name]
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
            if item not in INCLUDES:
                raise ValueError(f"only {list(INCLUDES)} can be included, got {item!r}")
        return include

    @field_validator("reasoning")
    @classmethod
    def _reasoning(cls, reasoning: dict[str, Any] | None) -> dict[str, Any] | None:
        """``effort`` reaches the chat template (as chat's ``reasoning_effort``); a
        ``summary`` is accepted (vmkv writes none: reasoning items carry the text itself)."""
        for key, value in (reasoning or {}).items():
            allowed = REASONING_OPTIONS.get(key)
            if allowed is None:
                raise ValueError(f"reasoning.{key} is not supported (only "
                                 f"{sorted(REASONING_OPTIONS)})")
            if value is not None and value not in allowed:
                raise ValueError(f"reasoning.{key} must be one of {list(allowed)}, got "
                                 f"{value!r}")
        return reasoning

    @property
    def wants_logprobs(self) -> bool:
        return self.top_logprobs is not None or LOGPROBS_INCLUDE in (self.include or [])


# -- the request as a chat completion ----------------------------------------------------------
def as_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request ``body`` stands for (APIError 400 naming the input item,
    tool or format it cannot express)."""
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
        "reasoning_effort": (body.reasoning or {}).get("effort"),
    }
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        error = exc.errors()[0]
        param = ".".join(str(x) for x in error["loc"]).replace("messages", "input")
        raise APIError(400, f"{param}: {error['msg']}", param) from None


def without_oldest(chat: ChatCompletionRequest, count: int) -> list[dict[str, Any]] | None:
    """``truncation: "auto"``: the chat's messages without the ``count`` oldest items of the
    conversation (system messages, the instructions among them, and the last message are
    kept; a tool result whose call was dropped goes with it); None when nothing is left to
    drop."""
    messages = [m.as_dict() for m in chat.messages]
    head = [m for m in messages[:-1] if m["role"] == "system"]
    middle = [m for m in messages[:-1] if m["role"] != "system"]
    if count > len(middle):
        return None
    middle = middle[count:]
    while middle and middle[0]["role"] == "tool":
        middle.pop(0)
    return [*head, *middle, messages[-1]]


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], param: str) -> None:
    kind = item.get("type", "message")
    thinking = _thinking(messages)
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise APIError(400, f"unsupported message role {role!r}", f"{param}.role")
        if role == "assistant" and thinking is not None:  # the reply of an earlier reasoning
            thinking["content"] = _text(item.get("content"), param)
        else:
            messages.append({"role": role, "content": _text(item.get("content"), param)})
    elif kind == "reasoning":  # an earlier reply's reasoning: the template's reasoning_content
        parts = item.get("content") or item.get("summary") or []
        text = _text([{**p, "type": "text"} if isinstance(p, dict) else p for p in parts],
                     param)
        messages.append({"role": "assistant", "content": "", "reasoning_content": text})
    elif kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
        if not all(isinstance(v, str) for v in (call["id"], *call["function"].values())):
            raise APIError(400, "a function_call item needs call_id, name and arguments "
                           "(strings)", param)
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and (
                "tool_calls" in last or last is thinking):
            last.setdefault("tool_calls", []).append(call)
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


def _thinking(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The last message when it holds only an earlier reply's reasoning (its text and calls,
    if the input gives them, join it)."""
    last = messages[-1] if messages else None
    if (last is not None and last["role"] == "assistant" and "reasoning_content" in last
            and not last["content"] and "tool_calls" not in last):
        return last
    return None


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
