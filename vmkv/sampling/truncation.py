"""Truncation of the (temperature-scaled) distribution: min-p, top-k, top-p.

Each function takes ``logits: [B, V]`` and per-row parameters, returns new logits with the dropped
tokens at -inf, and is an exact no-op (bit for bit) on rows whose parameter is "off"; that is what
lets a seeded request sample the same tokens whatever else is in its batch. Ties at a threshold
are always kept, so a kept set never depends on sort order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with ``prob < min_p * max_prob`` per row; ``min_p: [B]`` float, 0 is off."""
    probs = logits.softmax(dim=-1)  # probs: [B, V]
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # threshold: [B, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    """Keep the ``top_k`` largest logits per row (all tokens tied with the k-th are kept).

    ``top_k: [B]`` int64, where values <= 0 or >= V are off; ``max_k`` is the largest active
    value (passed in so that the caller's Python-side max avoids a device sync).
    """
    vocab_size = logits.shape[-1]
    is_on = (top_k > 0) & (top_k < vocab_size)
    max_k = min(max_k, vocab_size)
    top_values = logits.topk(max_k, dim=-1).values  # top_values: [B, max_k], descending
    kth_index = (top_k.clamp(min=1, max=max_k) - 1)[:, None]
    kth = top_values.gather(1, kth_index)  # kth: [B, 1]
    kth = kth.masked_fill(~is_on[:, None], float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest most-likely set whose mass reaches ``top_p`` (``[B]`` float, 1 is off).

    Going down the tokens by probability, a token is kept when the mass of the tokens before it
    is still below ``top_p`` (so the most likely token always is); every token as likely as the
    last one kept is kept too.
    """
    probs = logits.softmax(dim=-1)  # probs: [B, V]
    sorted_probs = probs.sort(dim=-1, descending=True).values  # sorted_probs: [B, V]
    # NOTE: mass before token i is cumsum[i - 1] exactly (not cumsum[i] - p[i]), so it never
    # decreases along the row and the kept tokens form a prefix.
    mass_before = F.pad(sorted_probs.cumsum(dim=-1)[:, :-1], (1, 0))
    num_kept = (mass_before < top_p[:, None]).sum(dim=-1, keepdim=True)  # num_kept: [B, 1] >= 1
    threshold = sorted_probs.gather(1, num_kept - 1)  # least likely kept probability
    threshold = threshold.masked_fill(top_p[:, None] >= 1.0, 0.0)
    return logits.masked_fill(probs < threshold, float("-inf"))
