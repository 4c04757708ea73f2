"""A scheduler step as the executor's :class:`~vmkv.executor.plan.StepPlan` (what the model
runs: the scheduled sequences' tokens flattened in order, the rows to sample, the prompt spans
to score), and the :class:`RowOwners` the engine keeps to map the results back to its
sequences."""

from __future__ import annotations

from typing import NamedTuple

from vmkv.engine.scheduler import SchedulerOutput
from vmkv.engine.sequence import Sequence
from vmkv.executor.plan import StepPlan


class RowOwners(NamedTuple):
    """Whose rows a :class:`StepPlan`'s results are: the sequence of each sample row, in row
    order (a sequence with proposals once, for its ``1 + len(draft_token_ids)`` rows); and per
    prompt span, the sequence and the first prompt position it scores (position ``p``
    predicts token ``p + 1``)."""

    sampled: list[Sequence]
    prompt_spans: list[tuple[Sequence, int]]


def plan_step(out: SchedulerOutput) -> tuple[StepPlan, RowOwners]:
    """Sequences whose scheduled tokens reach their end (finished prefills and decodes) are
    sampled (a verify step's sequence: all its ``1 + len(draft_token_ids)`` rows); a sequence
    whose request wants prompt logprobs also gets the hidden states of the prompt positions
    this step computes and that ``prompt_logprobs_from`` says are missing."""
    ids: list[int] = []
    positions: list[int] = []
    context_lens: list[int] = []
    query_lens: list[int] = []
    sample_rows: list[int] = []
    sampled: list[Sequence] = []
    spans: list[tuple[int, int]] = []
    prompt_spans: list[tuple[Sequence, int]] = []
    for seq in out.scheduled:
        n = out.num_scheduled_tokens[seq.seq_id]
        c = seq.num_computed_tokens
        first = max(c, seq.prompt_logprobs_from)
        last = min(c + n, seq.num_prompt_tokens - 1)  # the last prompt position samples
        if first < last:
            spans.append((len(ids) + first - c, last - first))
            prompt_spans.append((seq, first))
        drafts = seq.draft_token_ids  # a verify step: the last token, then the proposals
        ids.extend(seq.token_ids[c : c + n] if not drafts else [seq.token_ids[c], *drafts])
        positions.extend(range(c, c + n))
        context_lens.append(c)
        query_lens.append(n)
        if drafts:  # every row is sampled (vmkv/spec_decode/verifier.py)
            sample_rows.extend(range(len(ids) - n, len(ids)))
            sampled.append(seq)
        elif c + n == seq.num_tokens:
            sample_rows.append(len(ids) - 1)
            sampled.append(seq)
    plan = StepPlan([s.seq_id for s in out.scheduled], context_lens, query_lens, ids,
                    positions, sample_rows, spans)
    return plan, RowOwners(sampled, prompt_spans)
