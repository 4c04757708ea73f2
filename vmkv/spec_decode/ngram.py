"""Prompt-lookup proposals (vLLM's ``ngram`` method): the sequence's last ``n`` tokens, for the
longest ``n`` in ``[min_n, max_n]`` that occurred before, and the tokens that followed that
earlier occurrence are the guess.

    tokens:  ... a b c X Y Z ... a b c | ?      last n = "a b c" matched earlier
    guess:                X Y Z              the k tokens after the match

Of several earlier occurrences the latest one with k tokens after it wins (the most recent
context; a copy the output is making right now), else the latest. Numpy over the token
array: a few tens of microseconds for thousands of tokens.
"""

from __future__ import annotations

import numpy as np


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens guessed to follow ``tokens`` ``[L]`` (int64); [] when no n-gram of
    ``min_n .. max_n`` tokens at the end occurred before."""
    return longest_match(tokens, min_n, max_n, k)[1]


def longest_match(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> tuple[int, list[int]]:
    """``(n, guess)``: the longest ``n`` in ``min_n .. max_n`` whose last-``n`` tokens occurred
    before, and up to ``k`` tokens that followed (``(0, [])`` when none did)."""
    length = len(tokens)
    if k <= 0 or length < min_n + 1:
        return 0, []
    # ends e < L - 1 of earlier occurrences of the last token, extended backwards while they
    # keep matching: ``alive`` after j steps are the ends of (j + 1)-gram matches
    alive = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    best, n = (alive, 1) if min_n <= 1 else (None, 0)
    for j in range(1, min(max_n, length - 1)):
        alive = alive[alive >= j]
        alive = alive[tokens[alive - j] == tokens[length - 1 - j]]
        if len(alive) == 0:
            break
        if j + 1 >= min_n:
            best, n = alive, j + 1
    if best is None or len(best) == 0:
        return 0, []
    full = best[best + k < length]
    end = int(full[-1] if len(full) else best[-1])
    return n, tokens[end + 1 : end + 1 + k].tolist()
