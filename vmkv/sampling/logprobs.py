"""Logprobs returned to the user: the sampled token's and the top-k, from the raw logits.

NOTE: as vLLM V1's default (``logprobs_mode="raw_logprobs"``), every logprob is read from
``log_softmax`` of the model's raw logits, before penalties, min_tokens, temperature and
truncation. It is the model's own belief, comparable across requests whatever their sampling
settings, and it is finite even for a token that truncation made impossible to sample.
"""

from __future__ import annotations

from collections.abc import Callable

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


#: prompt positions turned into logits at once (bounds the [rows, V] float32 temporaries)
PROMPT_LOGPROBS_ROWS = 256


def prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                    hidden: torch.Tensor, targets: list[int], num_top: int
                    ) -> list[dict[int, float]]:
    """Logprob entries of prompt tokens from the hidden states of the positions before them.

    Args:
        compute_logits: the model's LM head, ``[m, H] -> [m, V]`` float32.
        hidden: ``[m, H]``, row ``j`` the position before ``targets[j]``.
        targets: the prompt tokens to score (``len(targets) == m``).
        num_top: how many most likely (id, logprob) pairs to add to each entry.

    Returns:
        Per target, ``{target: logprob, **top}``, as the sampled tokens' entries.
    """
    entries: list[dict[int, float]] = []
    for start in range(0, len(targets), PROMPT_LOGPROBS_ROWS):
        rows = hidden[start : start + PROMPT_LOGPROBS_ROWS]
        ids = torch.tensor(targets[start : start + PROMPT_LOGPROBS_ROWS], device=hidden.device)
        logprobs = compute_logits(rows).float().log_softmax(dim=-1)  # logprobs: [r, V]
        chosen, top = gather_logprobs(logprobs, ids, [num_top] * len(ids))
        for tok, lp, pairs in zip(ids.tolist(), chosen, top, strict=True):
            entries.append({tok: lp, **dict(pairs)})
    return entries
