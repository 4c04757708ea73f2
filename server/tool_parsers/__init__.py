"""Read tool calls out of a model's text, as the chat templates of the supported families make
the model write them (``tool_choice: "auto"``): the syntaxes are in ``json_calls.py`` and
``pythonic.py``; the content / calls split and streaming in ``base.py``."""

from __future__ import annotations

from vmkv.server.tool_parsers.base import (
    ToolCall,
    ToolCallParser,
    ToolCallStream,
    call_from_object,
)
from vmkv.server.tool_parsers.json_calls import HermesParser, Llama3JsonParser, MistralParser
from vmkv.server.tool_parsers.pythonic import PythonicParser

PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser,
    "pythonic": PythonicParser}


def parser_for_template(chat_template: str | None) -> ToolCallParser | None:
    """The parser whose syntax the chat template teaches, or None if it teaches none: hermes
    (``<tool_call>``), mistral (``[TOOL_CALLS]``), pythonic (``<|python_start|>``: Llama 4),
    llama3_json (``<|python_tag|>`` or ``ipython``)."""
    template = chat_template or ""
    if HermesParser.MARKER in template:
        return HermesParser()
    if MistralParser.MARKER in template:
        return MistralParser()
    if PythonicParser.WRAPPERS[0] in template:
        return PythonicParser()
    if Llama3JsonParser.TAG in template or "ipython" in template:
        return Llama3JsonParser()
    return None


__all__ = ["PARSERS", "HermesParser", "Llama3JsonParser", "MistralParser", "PythonicParser",
           "ToolCall", "ToolCallParser", "ToolCallStream", "call_from_object",
           "parser_for_template"]
