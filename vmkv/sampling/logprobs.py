"""Logprobs returned to the user: the sampled token's and the top-k, from the raw logits.

NOTE: as vLLM V1's default (``logprobs_mode="raw_logprobs"``), every logprob is read from
``log_softmax`` of the model's raw logits, before penalties, min_tokens, temperature and
truncation. It is the model's own belief, comparable across requests whatever their sampling
settings, and it is finite even for a token that truncation made impossible to sample.
"""

from __future__ import annotations

import torch


def gather_logprobs(
    raw_logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Read the sampled token's logprob and the ``num_top[i]`` most likely (id, logprob) pairs.

    Args:
        raw_logprobs: ``[B, V]`` log_softmax of the raw logits.
        token_ids: ``[B]`` int64, the sampled tokens.
        num_top: per row, how many top pairs to return (0 for none).

    Returns:
        ``(sampled, top)``: ``sampled[i]`` is row i's sampled-token logprob; ``top[i]`` lists
        ``num_top[i]`` pairs, most likely first (ties in topk's order).
    """
    sampled = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
    max_top = min(max(num_top, default=0), raw_logprobs.shape[-1])
    if max_top == 0:
        return sampled, [[] for _ in num_top]
    values, indices = raw_logprobs.topk(max_top, dim=-1)  # values, indices: [B, max_top]
    top = [
        list(zip(row_ids[:k], row_values[:k], strict=True))
        for row_ids, row_values, k in zip(indices.tolist(), values.tolist(), num_top, strict=True)
    ]
    return sampled, top
