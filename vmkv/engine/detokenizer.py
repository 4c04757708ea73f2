"""Incremental detokenisation: the text each new token adds, in O(1) tokens per step.

Decoding only the new token is wrong for byte-level and SentencePiece tokenizers (a character
may span tokens; leading spaces depend on the previous token), and decoding the whole output each
step is quadratic. The standard window trick: decode ``ids[prefix:]`` and ``ids[prefix:read]`` and
emit the difference once it no longer ends in an incomplete character (U+FFFD).
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Text deltas of one sequence's output tokens."""

    def __init__(self, tokenizer: Any, prompt_len: int, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.prefix_offset = max(prompt_len - 5, 0)  # a little prompt context for the first
        self.read_offset = prompt_len

    def step(self, token_ids: list[int]) -> str:
        """The text the last token(s) of ``token_ids`` complete ('' while a char is partial)."""
        decode = self.tokenizer.decode
        prefix = decode(token_ids[self.prefix_offset : self.read_offset],
                        skip_special_tokens=self.skip_special_tokens)
        full = decode(token_ids[self.prefix_offset :],
                      skip_special_tokens=self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return full[len(prefix) :]
