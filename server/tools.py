"""How a chat reply is shaped: its reasoning (``--reasoning-parser``, server/reasoning/) and
its tool calls (``tools`` and ``tool_choice``).

    none      the tools still go into the chat template (as vLLM renders them), but the reply
              is text: nothing is parsed
    auto      the tools go into the chat template; the reply is parsed for the model's own
              tool-call syntax (tool_parsers/): calls -> ``message.tool_calls`` (only the first
              with ``parallel_tool_calls: false``)
    required  the output is constrained (structured outputs) to a JSON array of one or more
              ``{"name": <a tool>, "parameters": <its schema>}`` (the tools' ``$defs`` hoisted
              to the array's root, as vLLM does, so their ``$ref`` s resolve)
    named     ``{"type": "function", "function": {"name": N}}``: the output is constrained to
              N's parameters schema and becomes one call of N

A reply with calls has ``finish_reason: "tool_calls"`` and ``content: null`` (auto keeps any text
before the calls as content). With a reasoning parser the thinking is split off first (into
``reasoning`` and ``reasoning_content``; dropped with ``include_reasoning: false``), the calls
are read from the rest, and structured outputs apply once the thinking ends. Where a parser's
markers are special tokens of the tokenizer, the reply keeps special tokens (vLLM turns
``skip_special_tokens`` off while tools are parsed), or the markers would vanish from the text.
Streamed, calls go out as vLLM streams them (tool_parsers/stream.py).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from typing import Any

from vmkv.sampling_params import SamplingParams
from vmkv.server.errors import APIError
from vmkv.server.reasoning import ReasoningParser, ReasoningStream
from vmkv.server.tool_parsers import (
    PARSERS,
    ToolCall,
    ToolCallParser,
    ToolCallStream,
    WholeParser,
    call_from_object,
    parser_for_template,
)
from vmkv.server.tool_parsers.json_stream import JsonCallsReader
from vmkv.structured import StructuredOutputsParams

TOOL_CHOICES = ("none", "auto", "required")


@dataclass
class ToolPlan:
    """How one chat request's reply is shaped (see the module docstring)."""

    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict[str, Any]] | None = None  # for the chat template (None: not rendered)
    structure: StructuredOutputsParams | None = None  # required / named
    named: str | None = None
    parser: ToolCallParser | None = None  # auto (required: the array's reader)
    max_calls: int | None = None  # most calls returned (auto: 1 with parallel_tool_calls false)
    reasoning: ReasoningParser | None = None  # this reply begins with thinking
    reports_reasoning: bool = False  # the server splits reasoning: the fields are present
    include_reasoning: bool = True

    @property
    def returns_calls(self) -> bool:
        return self.mode != "none"

    @property
    def hides_reasoning(self) -> bool:
        """``include_reasoning: false`` with a reasoning parser: the reply's logprobs and
        token ids are left out too (they would show the thinking), as vLLM leaves them."""
        return self.reports_reasoning and not self.include_reasoning

    def use_reasoning(self, parser: ReasoningParser | None, prompt_ids: list[int],
                      template_kwargs: dict[str, Any] | None, include: bool = True) -> None:
        """Split reasoning with ``parser`` (the server's) when this request's reply begins
        with thinking (its prompt did not close it)."""
        self.reports_reasoning, self.include_reasoning = parser is not None, include
        if parser is not None and parser.thinks(prompt_ids, template_kwargs or {}):
            self.reasoning = parser

    def adjust(self, params: SamplingParams, tokenizer: Any) -> SamplingParams:
        """``params`` as the plan needs them: structured outputs after the thinking's closing
        token, special tokens kept where a marker is one."""
        changes: dict[str, Any] = {}
        if (self.reasoning is not None and self.reasoning.end_id is not None
                and params.structured_outputs is not None):
            changes["structured_outputs_after"] = self.reasoning.end_id
        markers = (self.parser.MARKERS if self.mode == "auto" else ()) + (
            self.reasoning.markers if self.reasoning is not None else ())
        if params.skip_special_tokens and drops_markers(tokenizer, markers):
            changes["skip_special_tokens"] = False
        return replace(params, **changes) if changes else params

    def reasoning_tokens(self, token_ids: list[int]) -> int:
        """How many of a reply's tokens were thinking."""
        return self.reasoning.count_tokens(token_ids) if self.reasoning is not None else 0

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message for a finished reply, and the finish reason to report."""
        reasoning, rest = self.reasoning.split(text) if self.reasoning else (None, text)
        content, calls = self.split(rest or "")
        message: dict[str, Any] = {"role": "assistant",  # null after reasoning with no more
                                   "content": None if rest is None and reasoning else content}
        if self.reports_reasoning:
            shown = (reasoning or None) if self.include_reasoning else None
            message["reasoning"] = message["reasoning_content"] = shown
        if calls:
            message["tool_calls"] = [c.as_dict() for c in calls]
            if finish_reason == "stop":
                finish_reason = "tool_calls"
        return message, finish_reason

    def split(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished reply (its reasoning split off)."""
        if self.mode == "named":
            return None, [ToolCall(self.named, text)]
        if self.mode in ("auto", "required"):
            content, calls = self.parser.parse(text)
            return content, calls[: self.max_calls]
        return text, []

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


class ChoiceStream:
    """One streamed choice's deltas: reasoning, then content or tool-call deltas as the plan
    says; ``reasoning_tokens`` counts the thinking's tokens as they come."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.thinking = ReasoningStream(plan.reasoning) if plan.reasoning else None
        self.calls = (ToolCallStream(plan.parser, plan.max_calls)
                      if plan.mode in ("auto", "required") else None)
        self.header_sent = False
        self.has_calls = False
        self.reasoning_tokens = 0
        self._counting = plan.reasoning is not None and plan.reasoning.end_id is not None

    def feed(self, text: str, finish_reason: str | None, token_ids: list[int] | None = None
             ) -> tuple[list[dict[str, Any]], str | None]:
        """Deltas for the new ``text`` and the finish reason to report with the last one."""
        finished = finish_reason is not None
        self._count(token_ids or [])
        deltas: list[dict[str, Any]] = []
        if self.thinking is not None:
            reasoning, text = self.thinking.feed(text, finished)
            if reasoning and self.plan.include_reasoning:
                deltas.append({"reasoning": reasoning, "reasoning_content": reasoning})
        if self.calls is not None:
            deltas += self.calls.feed(text, finished)
            self.has_calls = bool(self.calls.calls)
        elif self.plan.mode == "named":
            deltas += self._named(text)
        elif text or (not finished and self.thinking is None):
            deltas.append({"content": text})
        if finish_reason == "stop" and self.has_calls:
            finish_reason = "tool_calls"
        return deltas, finish_reason

    def _count(self, token_ids: list[int]) -> None:
        if not self._counting:
            return
        parser = self.plan.reasoning
        for token in token_ids:
            if token == parser.end_id:
                self._counting = False
                return
            self.reasoning_tokens += token != parser.start_id

    def _named(self, text: str) -> list[dict[str, Any]]:
        deltas = []
        if not self.header_sent:  # id, type and name first, then the arguments as they come
            self.header_sent = self.has_calls = True
            header = ToolCall(self.plan.named, "").as_dict()
            deltas.append({"tool_calls": [{"index": 0, **header}]})
        if text:
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return deltas


class RequiredCalls(WholeParser):
    """``tool_choice: "required"``'s reply: the JSON array of ``{"name", "parameters"}`` its
    grammar allows."""

    name = "required"
    STARTS = ("[",)

    def parse_calls(self, body: str) -> list[ToolCall] | None:
        try:
            items = json.loads(body)
        except json.JSONDecodeError:
            return None
        calls = [call_from_object(item, "parameters") for item in items]
        return calls if calls and all(calls) else None  # type: ignore[return-value]

    def reader(self) -> JsonCallsReader:
        return JsonCallsReader(("[", ",", "]"), ("parameters",))


@functools.lru_cache(maxsize=64)
def drops_markers(tokenizer: Any, markers: tuple[str, ...]) -> bool:
    """Whether detokenizing without special tokens drops one of ``markers`` (it is a special
    token of ``tokenizer``)."""
    vocab = tokenizer.get_vocab()
    return any(m in vocab and tokenizer.decode([vocab[m]], skip_special_tokens=True) == ""
               for m in markers)


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: Any,
               parallel_tool_calls: bool, chat_template: str | dict[str, str] | None,
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
    max_calls = None if parallel_tool_calls else 1
    if tool_choice == "auto":
        parser = (PARSERS[parser_name](tools) if parser_name in PARSERS
                  else parser_for_template(chat_template, tools))
        if parser is None:
            raise APIError(400, "tool_choice 'auto' needs a chat template with a tool-call "
                           "syntax vmkv can read (hermes <tool_call>, mistral [TOOL_CALLS], "
                           "Llama 3 JSON, pythonic, ...); use 'required' or a named function, "
                           "or --tool-call-parser", "tool_choice")
        return ToolPlan("auto", tools=tools, parser=parser, max_calls=max_calls)
    if tool_choice == "required":
        return ToolPlan("required", tools=tools, parser=RequiredCalls(tools),
                        max_calls=max_calls, structure=StructuredOutputsParams(
                            json=_required_schema(functions, parallel_tool_calls)))
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
    """A JSON array of one or more calls, each ``{"name": N, "parameters": N's schema}``;
    the schemas' definitions (``$defs``, or draft-7 ``definitions``) move to the root, where
    their ``#/$defs/...`` references point (APIError when two tools define a name
    differently)."""
    hoisted: dict[str, dict[str, Any]] = {}
    calls = []
    for name, schema in functions.items():
        schema = dict(schema)
        for key in ("$defs", "definitions"):
            for def_name, definition in (schema.pop(key, None) or {}).items():
                if hoisted.setdefault(key, {}).setdefault(def_name, definition) != definition:
                    raise APIError(400, f"tools define {key}.{def_name} differently; "
                                   "tool_choice 'required' needs one meaning for each name",
                                   "tools")
        calls.append({"type": "object",
                      "properties": {"name": {"type": "string", "enum": [name]},
                                     "parameters": schema},
                      "required": ["name", "parameters"]})
    array: dict[str, Any] = {"type": "array", "minItems": 1,
                             "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        array["maxItems"] = 1
    return {**array, **hoisted}
