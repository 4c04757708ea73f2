"""Verification of proposals with the engine's own sampler, one round per draft position.

A sequence with proposals ``d1 .. dk`` ran ``k + 1`` query rows (its last token, then the
proposals); row ``j``'s logits are the target model's distribution for the token after
``d1 .. dj``. Round ``j`` samples row ``j`` of every sequence still verifying, in one batched
sampler call, with the sequence's state as it is now (penalties, logit bias, grammar mask,
min_tokens, seeded noise all see the tokens accepted in the rounds before), and appends the
token as any step would (stop strings, stop tokens, max_tokens, logprobs):

    token == d(j+1)   accepted: the next round goes on
    otherwise         the token stands (the target's own choice: the bonus or a correction),
                      the sequence stops verifying

Greedy: the longest matching prefix plus one token, exactly the tokens decoding without
proposals makes. Sampling: for a point-mass draft (ngram, suffix, a greedy draft model) this
*is* vLLM's rejection sampler: a proposal is accepted with probability p(d) (the sampled
token equals it) and a rejection's token is distributed as p without d renormalised, so the
output distribution is the target's exactly (tests/test_spec_decode_sampling.py measures it);
each emitted token draws one noise row, so a seeded request's tokens are those it gets
without speculation. A grammar never sees a rejected proposal, so it never needs rolling back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vmkv.engine.sequence import Sequence
from vmkv.sampling import Sampler

#: appends one token to a sequence; True when the sequence finished with it
Append = Callable[[Sequence, int, float | None, list[tuple[int, float]] | None], bool]


def verify(sampler: Sampler, logits: torch.Tensor, batch: list[tuple[Sequence, int]],
           append: Append) -> list[int]:
    """Verify ``batch`` (each sequence and the first of its ``1 + len(draft_token_ids)`` rows
    of ``logits`` ``[R, V]``); returns the tokens each emitted (1 .. k + 1; fewer when it
    finished)."""
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
