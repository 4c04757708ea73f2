"""Verification of proposals with the engine's own sampler, one round per draft position.

A sequence with proposals ``d1 .. dk`` ran ``k + 1`` query rows (its last token, then the
proposals); row ``j``'s logits are the target model's distribution for the token after
``d1 .. dj``. Round ``j`` samples row ``j`` of every sequence still verifying, in one batched
sampler call, with the sequence's state as it is now (penalties, logit bias, grammar mask,
min_tokens, seeded draws all see the tokens accepted in the rounds before), and appends the
token as any step would (stop strings, stop tokens, max_tokens, logprobs):

    token == d(j+1)   accepted: the next round goes on
    otherwise         the token stands (the target's own choice: the bonus or a correction),
                      the sequence stops verifying

Greedy: the longest matching prefix plus one token, exactly the tokens decoding without
proposals makes. Sampling: for a point-mass draft (ngram, suffix, a greedy draft model) this
*is* vLLM's rejection sampler: a proposal is accepted with probability p(d) (the sampled
token equals it) and a rejection's token is distributed as p without d renormalised, so the
output distribution is the target's exactly (tests/test_spec_decode_sampling.py measures it);
each emitted token draws one uniform, so a seeded request's tokens are those it gets
without speculation. A grammar never sees a rejected proposal, so it never needs rolling back.

Where no row's token can depend on the tokens accepted before it in the step (greedy, no
penalties, token constraints, grammar or min_tokens mask: the common greedy batch), every row
of every sequence is sampled in one call (one argmax over the ``[R, V]`` rows) and the rounds
only walk the tokens: the same tokens, without a sampler call per round.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vmkv.engine.sequence import Sequence
from vmkv.sampling import Sampler
from vmkv.sampling.state import SamplingState

#: appends one token to a sequence; True when the sequence finished with it
Append = Callable[[Sequence, int, float | None, list[tuple[int, float]] | None], bool]


def verify(sampler: Sampler, logits: torch.Tensor, batch: list[tuple[Sequence, int]],
           append: Append) -> list[int]:
    """Verify ``batch`` (each sequence and the first of its ``1 + len(draft_token_ids)`` rows
    of ``logits`` ``[R, V]``); returns the tokens each emitted (1 .. k + 1; fewer when it
    finished)."""
    if all(_row_independent(seq.sampling_state) for seq, _ in batch):
        return _verify_at_once(sampler, logits, batch, append)
    emitted = [0] * len(batch)
    active = list(range(len(batch)))
    depth = 0
    while active:
        rows = torch.tensor([batch[i][1] + depth for i in active], device=logits.device)
        result = sampler(logits.index_select(0, rows),
                         [batch[i][0].sampling_state for i in active])
        still = []
        for a, i in enumerate(active):
            seq = batch[i][0]
            token = result.token_ids[a]
            lp = result.logprobs[a] if result.logprobs is not None else None
            top = result.top_logprobs[a] if result.top_logprobs is not None else None
            emitted[i] += 1
            finished = append(seq, token, lp, top)
            drafts = seq.draft_token_ids
            if not finished and depth < len(drafts) and token == drafts[depth]:
                still.append(i)
        active = still
        depth += 1
    return emitted


def _row_independent(state: SamplingState) -> bool:
    """Whether the sampler's token for a row of this sequence is the same whatever tokens
    the sequence accepted before it in the step (greedy, and nothing that reads the output so
    far: penalties, bad words, a grammar, the min_tokens mask)."""
    p = state.params
    return (p.is_greedy and state.grammar is None and not p.has_token_constraints
            and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0 and not state.masked_token_ids)


def _verify_at_once(sampler: Sampler, logits: torch.Tensor, batch: list[tuple[Sequence, int]],
                    append: Append) -> list[int]:
    """:func:`verify` for row-independent sequences: one sampler call over all their rows."""
    spans = [(first, 1 + len(seq.draft_token_ids)) for seq, first in batch]
    rows = [first + j for first, n in spans for j in range(n)]
    picked = (logits if rows == list(range(logits.shape[0]))
              else logits.index_select(0, torch.tensor(rows, device=logits.device)))  # [R, V]
    states = [seq.sampling_state for (seq, _), (_, n) in zip(batch, spans, strict=True)
              for _ in range(n)]
    result = sampler(picked, states)
    emitted = [0] * len(batch)
    at = 0
    for i, ((seq, _), (_, n)) in enumerate(zip(batch, spans, strict=True)):
        drafts = seq.draft_token_ids
        for depth in range(n):
            token = result.token_ids[at + depth]
            lp = result.logprobs[at + depth] if result.logprobs is not None else None
            top = result.top_logprobs[at + depth] if result.top_logprobs is not None else None
            emitted[i] += 1
            if append(seq, token, lp, top) or depth >= len(drafts) or token != drafts[depth]:
                break
        at += n
    return emitted
