"""Sampling under a compiled grammar without a model: a random walk over the tokens the grammar
allows, to find what it lets through (each step picks uniformly among the allowed tokens,
short ones favoured so documents end, and the stop token with probability 1/2 when allowed).

Tokens that are not whole UTF-8 characters (their text holds U+FFFD) are never picked: xgrammar
lets byte tokens combine into invalid UTF-8 inside a string, which the model would have to
choose byte by byte (a known limit, docs/server.md), and the walk tests the keywords."""

from __future__ import annotations

from typing import Any

import numpy as np
import xgrammar as xgr


class GrammarWalker:
    """Random complete outputs of grammars for one tokenizer (``vocab_size`` logits wide)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_id: int) -> None:
        self.tokenizer, self.vocab_size, self.stop = tokenizer, vocab_size, stop_token_id
        texts = [tokenizer.decode([i]) for i in range(len(tokenizer))]
        texts += [""] * (vocab_size - len(texts))
        self.short = np.array([len(t) <= 2 for t in texts])
        self.whole = np.array(["\ufffd" not in t for t in texts])

    def allowed(self, matcher: xgr.GrammarMatcher) -> np.ndarray:
        """The token ids the matcher allows next."""
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)  # [1, ceil(V / 32)] int32
        matcher.fill_next_token_bitmask(bitmask)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
        return np.nonzero(bits[: self.vocab_size] & self.whole)[0]

    def sample(self, compiled: xgr.CompiledGrammar, rng: np.random.Generator,
               max_tokens: int = 160) -> str | None:
        """One complete output, or None if it did not end within ``max_tokens``."""
        matcher = xgr.GrammarMatcher(compiled)
        ids: list[int] = []
        for _ in range(max_tokens):
            allowed = self.allowed(matcher)
            if self.stop in allowed and (len(allowed) == 1 or rng.random() < 0.5):
                return self.tokenizer.decode(ids)
            allowed = allowed[allowed != self.stop]
            short = allowed[self.short[allowed]]
            token = int(rng.choice(short if len(short) and rng.random() < 0.8 else allowed))
            assert matcher.accept_token(token)
            ids.append(token)
        return None
