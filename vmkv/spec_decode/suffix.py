"""The ``suffix`` method (after SuffixDecoding / Arctic Inference): the longest suffix of the
sequence found in the sequence itself or in recent finished outputs, and what followed it.

    own tokens      prompt + output so far, searched as ngram does (vmkv/spec_decode/ngram.py)
    SuffixIndex     the last ``suffix_cache_max_requests`` finished outputs: every n-gram of
                    ``MIN_MATCH .. MAX_MATCH`` tokens -> where it last ended (output, position)

The longer match wins (the request's own on a tie). Agents and repeated tasks re-emit what
earlier answers said (tool-call skeletons, boilerplate, the same edit to several files): the
index finds it when the prompt alone does not. Matches are longer than prompt lookup's
default (up to ``MAX_MATCH`` tokens), so a guess follows text that really is the same.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from vmkv.engine.sequence import Sequence
from vmkv.spec_decode.config import SpeculativeConfig
from vmkv.spec_decode.ngram import longest_match

#: the n-gram lengths matched (shortest, longest)
MIN_MATCH, MAX_MATCH = 2, 8


class SuffixIndex:
    """The n-grams of recent finished outputs and where each last ended; outputs past
    ``max_outputs`` are forgotten (the index is rebuilt when half of it is stale)."""

    def __init__(self, max_outputs: int) -> None:
        self.max_outputs = max_outputs
        self.outputs: deque[tuple[int, np.ndarray]] = deque()  # (serial, tokens)
        self.ends: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (serial, end)
        self._serial = 0
        self._forgotten = 0

    def add(self, tokens: list[int]) -> None:
        """Remember one finished output."""
        if len(tokens) <= MIN_MATCH:
            return
        serial = self._serial = self._serial + 1
        self.outputs.append((serial, np.asarray(tokens, dtype=np.int64)))
        self._index(serial, tokens)
        if len(self.outputs) > self.max_outputs:
            self.outputs.popleft()
            self._forgotten += 1
            if self._forgotten * 2 > self.max_outputs:
                self.ends.clear()
                for s, toks in self.outputs:
                    self._index(s, toks.tolist())
                self._forgotten = 0

    def _index(self, serial: int, tokens: list[int]) -> None:
        for end in range(MIN_MATCH, len(tokens)):  # an n-gram ending at ``end`` (exclusive)
            for n in range(MIN_MATCH, min(MAX_MATCH, end) + 1):
                self.ends[tuple(tokens[end - n : end])] = (serial, end)

    def lookup(self, tokens: np.ndarray, k: int) -> tuple[int, list[int]]:
        """``(n, guess)``: the longest suffix of ``tokens`` (``MIN_MATCH .. MAX_MATCH``) some
        remembered output holds, and up to ``k`` tokens that followed it there."""
        first = self.outputs[0][0] if self.outputs else 0
        for n in range(min(MAX_MATCH, len(tokens)), MIN_MATCH - 1, -1):
            hit = self.ends.get(tuple(tokens[len(tokens) - n :].tolist()))
            if hit is None or hit[0] < first:
                continue
            serial, end = hit
            output = self.outputs[serial - first][1]
            guess = output[end : end + k].tolist()
            if guess:
                return n, guess
        return 0, []


class SuffixProposer:
    """The request's own longest earlier match, or the index's, whichever is longer."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.index = SuffixIndex(config.suffix_cache_max_requests)

    def propose(self, seq: Sequence, k: int) -> list[int]:
        tokens = np.fromiter(seq.token_ids, np.int64, len(seq.token_ids))
        own_n, own = longest_match(tokens, MIN_MATCH, MAX_MATCH, k)
        if own_n == MAX_MATCH:
            return own
        n, guess = self.index.lookup(tokens, k)
        return guess if n > own_n else own

    def finished(self, seq: Sequence) -> None:
        self.index.add(seq.output_token_ids)

    def close(self) -> None:
        pass
