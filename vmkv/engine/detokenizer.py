"""Incremental detokenisation: the text each new token adds, in O(1) tokens per step.

Decoding only the new token is wrong for byte-level and SentencePiece tokenizers (a character
may span tokens; leading spaces depend on the previous token), and decoding the whole output each
step is quadratic. The standard window trick: decode ``ids[prefix:]`` and ``ids[prefix:read]`` and
emit the difference once it no longer ends in an incomplete character (U+FFFD).

Where the tokenizer is a ``transformers`` fast tokenizer that does not clean up spaces, the
windows go straight to its ``tokenizers`` backend, which is what its ``decode`` calls after
argument handling: 1.1 instead of 3.5 us a call on a 2-core EPYC (two calls per sequence per
step: ~0.3 ms of a 64-request decode step); the text is the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class IncrementalDetokenizer:
    """Text deltas of one sequence's output tokens."""

    def __init__(self, tokenizer: Any, prompt_len: int, skip_special_tokens: bool) -> None:
        self.skip_special_tokens = skip_special_tokens
        self._decode = window_decoder(tokenizer)
        self.prefix_offset = max(prompt_len - 5, 0)  # a little prompt context for the first
        self.read_offset = prompt_len

    def step(self, token_ids: list[int]) -> str:
        """The text the last token(s) of ``token_ids`` complete ('' while a char is partial)."""
        decode = self._decode
        prefix = decode(token_ids[self.prefix_offset : self.read_offset],
                        skip_special_tokens=self.skip_special_tokens)
        full = decode(token_ids[self.prefix_offset :],
                      skip_special_tokens=self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return full[len(prefix) :]


def window_decoder(tokenizer: Any) -> Callable[..., str]:
    """``tokenizer.decode``, or its ``tokenizers`` backend's where that gives the same text (a
    fast tokenizer without ``clean_up_tokenization_spaces``); called as
    ``f(ids, skip_special_tokens=...)``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer.decode
    return backend.decode
