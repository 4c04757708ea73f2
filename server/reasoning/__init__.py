"""Reasoning parsers (``--reasoning-parser``, vLLM's names): the rules in ``base.py``.

    deepseek_r1  <think> ... </think> (the opening may be in the prompt): DeepSeek-R1 and its
                 distills, QwQ
    qwen3        the same markers; ``chat_template_kwargs: {"enable_thinking": false}`` (the
                 template then closes the thinking in the prompt) makes the reply content
    granite      "Here is my thought process:" ... "Here is my response:" (IBM Granite 3.2+,
                 with ``chat_template_kwargs: {"thinking": true}``); a reply that does not open
                 with it is content
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vmkv.server.reasoning.base import ReasoningParser, ReasoningStream


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    STARTS = ("<think>",)
    ENDS = ("</think>",)


class Qwen3Parser(DeepSeekR1Parser):
    name = "qwen3"

    def thinks(self, prompt_ids: Sequence[int], template_kwargs: dict[str, Any]) -> bool:
        if template_kwargs.get("enable_thinking") is False:
            return False
        return super().thinks(prompt_ids, template_kwargs)


class GraniteParser(ReasoningParser):
    name = "granite"
    STARTS = ("Here is my thought process:", "Here's my thought process:")
    ENDS = ("Here is my response:", "Here's my response:")
    NEEDS_START = True
    NEEDS_TOKENS = False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1Parser, Qwen3Parser, GraniteParser)}


def reasoning_parser(name: str | None, tokenizer: Any) -> ReasoningParser | None:
    """The server's reasoning parser (None without ``--reasoning-parser``); ValueError for an
    unknown name or a tokenizer without the parser's marker tokens."""
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, got "
                         f"{name!r}")
    return REASONING_PARSERS[name](tokenizer)


__all__ = ["REASONING_PARSERS", "DeepSeekR1Parser", "GraniteParser", "Qwen3Parser",
           "ReasoningParser", "ReasoningStream", "reasoning_parser"]
