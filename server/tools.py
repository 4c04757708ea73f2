"""Tool calling in ``/v1/chat/completions``: ``tools`` and ``tool_choice``.

    none      the tools still go into the chat template (as vLLM renders them), but the reply
              is text: nothing is parsed
    auto      the tools go into the chat template; the reply is parsed for the model's own
              tool-call syntax (tool_parsers/): calls -> ``message.tool_calls`` (only the first
              with ``parallel_tool_calls: false``)
    required  the output is constrained (structured outputs) to a JSON array of one or more
              ``{"name": <a tool>, "parameters": <its schema>}``
    named     ``{"type": "function", "function": {"name": N}}``: the output is constrained to
              N's parameters schema and becomes one call of N

A reply with calls has ``finish_reason: "tool_calls"`` and ``content: null`` (auto keeps any text
before the calls as content).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from vmkv.server.errors import APIError
from vmkv.server.tool_parsers import (
    PARSERS,
    ToolCall,
    ToolCallParser,
    call_from_object,
    parser_for_template,
)
from vmkv.structured import StructuredOutputsParams

TOOL_CHOICES = ("none", "auto", "required")


@dataclass
class ToolPlan:
    """How one chat request uses its tools (see the module docstring)."""

    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict[str, Any]] | None = None  # for the chat template (None: not rendered)
    structure: StructuredOutputsParams | None = None  # required / named
    named: str | None = None
    parser: ToolCallParser | None = None  # auto
    max_calls: int | None = None  # most calls returned (auto: 1 with parallel_tool_calls false)

    @property
    def returns_calls(self) -> bool:
        return self.mode != "none"

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message for a finished reply, and the finish reason to report."""
        content, calls = self.split(text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.as_dict() for c in calls]
            if finish_reason == "stop":
                finish_reason = "tool_calls"
        return message, finish_reason

    def split(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished reply."""
        if self.mode == "named":
            return None, [ToolCall(self.named, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                return text, []
            calls = [call_from_object(item, "parameters") for item in items]
            return (None, calls[: self.max_calls]) if calls and all(calls) else (text, [])
        if self.mode == "auto":
            content, calls = self.parser.parse(text)
            return content, calls[: self.max_calls]
        return text, []

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


class ChoiceStream:
    """One streamed choice's deltas: plain content, or tool-call deltas as the plan says."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.auto = plan.parser.stream(plan.max_calls) if plan.mode == "auto" else None
        self.text = ""
        self.header_sent = False
        self.has_calls = False

    def feed(self, text: str, finish_reason: str | None
             ) -> tuple[list[dict[str, Any]], str | None]:
        """Deltas for the new ``text`` and the finish reason to report with the last one."""
        finished = finish_reason is not None
        if self.plan.mode == "none":
            return ([{"content": text}] if text or not finished else []), finish_reason
        if self.auto is not None:
            deltas = self.auto.feed(text, finished)
            self.has_calls = bool(self.auto.calls)
        elif self.plan.mode == "named":
            deltas = self._named(text)
        else:  # required: the array is parsed when it is complete
            self.text += text
            deltas = []
            if finished:
                content, calls = self.plan.split(self.text)
                deltas = ([{"tool_calls": [{"index": i, **c.as_dict()}]}
                           for i, c in enumerate(calls)] or [{"content": content}])
                self.has_calls = bool(calls)
        if finish_reason == "stop" and self.has_calls:
            finish_reason = "tool_calls"
        return deltas, finish_reason

    def _named(self, text: str) -> list[dict[str, Any]]:
        deltas = []
        if not self.header_sent:  # id, type and name first, then the arguments as they come
            self.header_sent = self.has_calls = True
            header = ToolCall(self.plan.named, "").as_dict()
            deltas.append({"tool_calls": [{"index": 0, **header}]})
        if text:
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return deltas


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: Any,
               parallel_tool_calls: bool, chat_template: str | None,
               parser_name: str = "auto") -> ToolPlan:
    """Check ``tools`` / ``tool_choice`` and decide how to serve them; APIError(400) for
    malformed tools, a choice naming an unknown tool, or ``auto`` on a model whose chat template
    has no tool-call syntax vmkv can read (and no ``--tool-call-parser``)."""
    functions = _functions(tools)
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if tool_choice == "none":
        return ToolPlan("none", tools=tools or None)
    if not functions:
        raise APIError(400, "tool_choice needs tools", "tool_choice")
    if tool_choice == "auto":
        parser = (PARSERS[parser_name]() if parser_name in PARSERS
                  else parser_for_template(chat_template))
        if parser is None:
            raise APIError(400, "tool_choice 'auto' needs a chat template with a tool-call "
                           "syntax vmkv can read (hermes <tool_call>, mistral [TOOL_CALLS], "
                           "Llama 3 JSON, pythonic); use 'required' or a named function, or "
                           "--tool-call-parser", "tool_choice")
        return ToolPlan("auto", tools=tools, parser=parser,
                        max_calls=None if parallel_tool_calls else 1)
    if tool_choice == "required":
        return ToolPlan("required", tools=tools,
                        structure=StructuredOutputsParams(json=_required_schema(
                            functions, parallel_tool_calls)))
    name = _named_choice(tool_choice)
    if name not in functions:
        raise APIError(400, f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    return ToolPlan("named", tools=tools, named=name,
                    structure=StructuredOutputsParams(json=functions[name]))


def _functions(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """{name: parameters schema} of the request's tools."""
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (tool.get("type", "function") != "function" or not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str) or not fn["name"]):
            raise APIError(400, "each tool must be {'type': 'function', 'function': {'name': "
                           "str, 'parameters': object}}", f"tools.{i}")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise APIError(400, "function parameters must be a JSON schema object",
                           f"tools.{i}.function.parameters")
        functions[fn["name"]] = params
    return functions


def _named_choice(tool_choice: Any) -> str:
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(400, f"tool_choice must be one of {TOOL_CHOICES} or {{'type': "
                       "'function', 'function': {'name': str}}", "tool_choice")
    return fn["name"]


def _required_schema(functions: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A JSON array of one or more calls, each ``{"name": N, "parameters": N's schema}``."""
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
              "required": ["name", "parameters"]}
             for name, schema in functions.items()]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema
