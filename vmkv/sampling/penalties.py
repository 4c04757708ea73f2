"""History-dependent logit adjustments: repetition/presence/frequency penalties and min_tokens.

Each function edits ``logits: [B, V]`` in place for the rows listed in ``rows`` (indices into
the batch) and leaves every other row untouched, bit for bit. The token histories of those rows
are concatenated into one index list per step and applied with one scatter, never a Python loop
over tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import torch

from vmkv.sampling.state import SamplingState


def apply_penalties(logits: torch.Tensor, states: Sequence[SamplingState], rows: list[int]) -> None:
    """Apply vLLM's three penalties to ``rows`` of ``logits`` (``[B, V]``, in place).

    - repetition (r): for tokens in the prompt or output, positive logits are divided by r and
      negative ones multiplied by r (both push the token down when r > 1);
    - frequency (f) and presence (p), over output tokens only:
      ``logit -= f * count + p * (count > 0)``.
    """
    if not rows:
        return
    device = logits.device
    index = torch.tensor(rows, device=device)
    sub = logits.index_select(0, index)  # sub: [R, V]
    rep = [states[i].params.repetition_penalty for i in rows]
    if any(r != 1.0 for r in rep):
        history = [[*states[i].prompt_token_ids, *states[i].output_token_ids] for i in rows]
        seen = _token_counts(history, sub.shape, device) > 0  # seen: [R, V]
        r = torch.tensor(rep, dtype=sub.dtype, device=device)[:, None]  # r: [R, 1]
        penalised = torch.where(sub > 0, sub / r, sub * r)
        sub = torch.where(seen, penalised, sub)
    freq = [states[i].params.frequency_penalty for i in rows]
    pres = [states[i].params.presence_penalty for i in rows]
    if any(freq) or any(pres):
        counts = _token_counts([states[i].output_token_ids for i in rows], sub.shape, device)
        f = torch.tensor(freq, dtype=sub.dtype, device=device)[:, None]
        p = torch.tensor(pres, dtype=sub.dtype, device=device)[:, None]
        sub = sub - f * counts - p * (counts > 0).to(sub.dtype)
    logits.index_copy_(0, index, sub)


def apply_min_tokens(logits: torch.Tensor, states: Sequence[SamplingState],
                     skip_rows: Sequence[int] = ()) -> None:
    """Set to -inf, in place, the ids each request may not sample yet (``masked_token_ids``).

    ``skip_rows`` are left alone: a grammar that is complete allows only EOS, and masking it
    too would leave nothing to sample, so for constrained rows the grammar decides when to end.
    """
    skip = set(skip_rows)
    masked = [() if i in skip else s.masked_token_ids for i, s in enumerate(states)]
    lengths = [len(m) for m in masked]
    if not any(lengths):
        return
    row_idx, tok_idx = _flat_indices(masked, lengths, logits.device)
    logits.index_put_((row_idx, tok_idx), torch.tensor(float("-inf"), device=logits.device))


def _flat_indices(
    token_lists: Sequence[Sequence[int]], lengths: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index pairs for every token of every list, as two ``[N]`` int64 tensors."""
    tok_idx = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long, device=device)
    row_idx = torch.repeat_interleave(
        torch.arange(len(lengths), device=device),
        torch.tensor(lengths, device=device),
    )
    return row_idx, tok_idx


def _token_counts(
    token_lists: Sequence[Sequence[int]], shape: torch.Size, device: torch.device
) -> torch.Tensor:
    """How often each token occurs in each row's list: ``[R, V]`` float32."""
    counts = torch.zeros(shape, dtype=torch.float32, device=device)
    lengths = [len(t) for t in token_lists]
    if any(lengths):
        row_idx, tok_idx = _flat_indices(token_lists, lengths, device)
        ones = torch.ones(tok_idx.shape, dtype=counts.dtype, device=device)
        counts.index_put_((row_idx, tok_idx), ones, accumulate=True)
    return counts
