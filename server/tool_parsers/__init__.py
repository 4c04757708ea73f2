"""Read tool calls out of a model's text, as the chat templates of the supported families make
the model write them (``tool_choice: "auto"``): the JSON syntaxes in ``json_calls.py`` and
``deepseek.py``, the pythonic one in ``pythonic.py``, Qwen3-Coder's XML in ``xml_calls.py``;
the content / calls split in ``base.py``, streaming in ``stream.py``.

More parsers come from plugins (``--tool-parser-plugin FILE``, vLLM's hook): a Python file that
defines a :class:`ToolCallParser` subclass and registers it with :func:`register_parser`::

    from vmkv.server.tool_parsers import MarkedParser, register_parser

    @register_parser("my_parser")
    class MyParser(MarkedParser):
        MARKERS = ("<call>",)
        def parse_calls(self, tail): ...   # -> list[ToolCall] | None

then ``--tool-call-parser my_parser``. Without a :meth:`~ToolCallParser.reader` its calls are
streamed whole when the reply ends.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vmkv.server.tool_parsers.base import (
    MarkedParser,
    ToolCall,
    ToolCallParser,
    WholeParser,
    call_from_object,
)
from vmkv.server.tool_parsers.deepseek import DeepSeekV3Parser, DeepSeekV31Parser
from vmkv.server.tool_parsers.json_calls import (
    GraniteParser,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    XlamParser,
)
from vmkv.server.tool_parsers.pythonic import PythonicParser
from vmkv.server.tool_parsers.stream import ToolCallStream
from vmkv.server.tool_parsers.xml_calls import Qwen3CoderParser

PARSERS: dict[str, type[ToolCallParser]] = {
    cls.name: cls for cls in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser,
                              Qwen3CoderParser, DeepSeekV3Parser, DeepSeekV31Parser,
                              GraniteParser, XlamParser)}


def register_parser(*names: str) -> Callable[[type[ToolCallParser]], type[ToolCallParser]]:
    """A class decorator that serves the parser under ``names`` (``--tool-call-parser``)."""
    def register(cls: type[ToolCallParser]) -> type[ToolCallParser]:
        if not (isinstance(cls, type) and issubclass(cls, ToolCallParser)):
            raise TypeError(f"{cls!r} is not a ToolCallParser subclass")
        for name in names:
            PARSERS[name] = cls
        cls.name = getattr(cls, "name", None) or names[0]
        return cls
    return register


def load_plugin(path: str) -> None:
    """Run the plugin file at ``path`` (``--tool-parser-plugin``), which registers its
    parsers; ValueError when it is missing or fails."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"tool_parser_plugin {path!r} is not a file")
    name = f"vmkv_tool_parser_plugin_{file.stem}"
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"tool_parser_plugin {path!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ValueError(f"tool_parser_plugin {path!r} failed: {exc!r}") from exc


def check_parser_name(name: str) -> None:
    """ValueError unless ``name`` is ``auto`` or a registered parser (after plugins)."""
    if name != "auto" and name not in PARSERS:
        raise ValueError(f"tool_call_parser must be auto or one of {sorted(PARSERS)} (more "
                         f"with --tool-parser-plugin), got {name!r}")


def parser_for_template(chat_template: str | dict[str, str] | None,
                        tools: list[dict[str, Any]] | None = None) -> ToolCallParser | None:
    """The parser whose syntax the chat template teaches, or None if it teaches none:
    qwen3_coder (``<function=``), hermes (``<tool_call>``), mistral (``[TOOL_CALLS]``),
    deepseek_v3 (``<｜tool▁calls▁begin｜>`` and ```` ```json ````; without it deepseek_v31),
    pythonic (``<|python_start|>``: Llama 4),
    llama3_json (``<|python_tag|>`` or ``ipython``), granite (``<|tool_call|>``). A tokenizer
    with several named templates (a dict) is read as transformers renders a request with
    tools: its ``tool_use`` template, else its ``default``."""
    if isinstance(chat_template, dict):
        chat_template = chat_template.get("tool_use") or chat_template.get("default")
    template = chat_template if isinstance(chat_template, str) else ""
    checks: list[tuple[bool, type[ToolCallParser]]] = [
        ("<function=" in template and "<tool_call>" in template, Qwen3CoderParser),
        ("<tool_call>" in template and "<|tool_call|>" not in template, HermesParser),
        (MistralParser.MARKER in template, MistralParser),
        (DeepSeekV3Parser.MARKERS[0] in template and "```json" in template, DeepSeekV3Parser),
        (DeepSeekV3Parser.MARKERS[0] in template, DeepSeekV31Parser),
        ("<|python_start|>" in template, PythonicParser),
        (Llama3JsonParser.TAG in template or "ipython" in template, Llama3JsonParser),
        ("<|tool_call|>" in template, GraniteParser),
    ]
    return next((cls(tools) for found, cls in checks if found), None)


__all__ = ["PARSERS", "GraniteParser", "HermesParser", "Llama3JsonParser", "MarkedParser",
           "MistralParser", "PythonicParser", "Qwen3CoderParser", "DeepSeekV3Parser",
           "DeepSeekV31Parser", "ToolCall", "ToolCallParser", "ToolCallStream", "WholeParser",
           "XlamParser", "call_from_object", "check_parser_name", "load_plugin",
           "parser_for_template", "register_parser"]
