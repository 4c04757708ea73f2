"""Host-side step arithmetic shared by the attention backends (numpy, no device)."""

from __future__ import annotations

import numpy as np


def cumsum0(x: np.ndarray) -> np.ndarray:
    """``[0, x0, x0+x1, ...]`` as int64."""
    out = np.zeros(len(x) + 1, dtype=np.int64)
    np.cumsum(x, out=out[1:])
    return out


def token_positions(context_lens: np.ndarray, query_lens: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(batch entry, absolute position) of every new token, flattened in batch order."""
    total = int(query_lens.sum())
    req = np.repeat(np.arange(len(query_lens)), query_lens)
    starts = cumsum0(query_lens)[:-1]
    pos = np.arange(total, dtype=np.int64) - np.repeat(starts - context_lens, query_lens)
    return req, pos
