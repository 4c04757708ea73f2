"""A scheduler step as the executor's :class:`~vmkv.executor.plan.StepPlan`: the scheduled
sequences' tokens flattened in order, the rows to sample, and the prompt spans whose logprobs
are still missing."""

from __future__ import annotations

from typing import NamedTuple

from vmkv.engine.scheduler import SchedulerOutput
from vmkv.engine.sequence import Sequence
from vmkv.executor.plan import StepPlan


class PlannedStep(NamedTuple):
    """The plan; the sequences of its sample rows, in row order; and per prompt span, the
    sequence and the first prompt position it scores (position ``p`` predicts token
    ``p + 1``)."""

    plan: StepPlan
    ready: list[Sequence]
    prompt_seqs: list[tuple[Sequence, int]]


def plan_step(out: SchedulerOutput) -> PlannedStep:
    """Sequences whose scheduled tokens reach their end (finished prefills and decodes) are
    sampled; a sequence whose request wants prompt logprobs also gets the hidden states of the
    prompt positions this step computes and that ``prompt_logprobs_from`` says are missing."""
    ids: list[int] = []
    positions: list[int] = []
    context_lens: list[int] = []
    query_lens: list[int] = []
    sample_rows: list[int] = []
    ready: list[Sequence] = []
    spans: list[tuple[int, int]] = []
    prompt_seqs: list[tuple[Sequence, int]] = []
    for seq in out.scheduled:
        n = out.num_scheduled_tokens[seq.seq_id]
        c = seq.num_computed_tokens
        first = max(c, seq.prompt_logprobs_from)
        last = min(c + n, seq.num_prompt_tokens - 1)  # the last prompt position samples
        if first < last:
            spans.append((len(ids) + first - c, last - first))
            prompt_seqs.append((seq, first))
        ids.extend(seq.token_ids[c : c + n])
        positions.extend(range(c, c + n))
        context_lens.append(c)
        query_lens.append(n)
        if c + n == seq.num_tokens:
            sample_rows.append(len(ids) - 1)
            ready.append(seq)
    plan = StepPlan([s.seq_id for s in out.scheduled], context_lens, query_lens, ids,
                    positions, sample_rows, spans)
    return PlannedStep(plan, ready, prompt_seqs)
