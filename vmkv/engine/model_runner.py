"""Turns a scheduler step into one model forward and the logits of the sequences to sample
(plus, for requests that asked for prompt logprobs, the hidden states of their prompt chunk)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, NamedTuple

import torch

from vmkv.attention.base import AttentionBackend
from vmkv.distributed.messages import StepInputs
from vmkv.engine.scheduler import SchedulerOutput
from vmkv.engine.sequence import Sequence
from vmkv.models.llama import LlamaModel

if TYPE_CHECKING:
    from vmkv.distributed.executor import TensorParallelExecutor
    from vmkv.engine.cuda_graphs import DecodeGraphRunner


class PromptHidden(NamedTuple):
    """Hidden states of one sequence's prompt positions ``[first, first + len(hidden))`` this
    step; position ``p`` predicts prompt token ``p + 1``."""

    seq: Sequence
    first: int
    hidden: torch.Tensor  # [m, hidden]


class StepResult(NamedTuple):
    """``logits [N, vocab]`` (float32, None when N = 0) of the ``ready`` sequences, whose
    scheduled tokens reach their end, and the prompt hidden states asked for."""

    logits: torch.Tensor | None
    ready: list[Sequence]
    prompt_hidden: list[PromptHidden]


class ModelRunner:
    """Owns the model and the attention backend; every tensor of a step is built here."""

    def __init__(self, model: LlamaModel, attn: AttentionBackend,
                 graphs: DecodeGraphRunner | None = None,
                 tp: TensorParallelExecutor | None = None) -> None:
        self.model = model
        self.attn = attn
        self.graphs = graphs  # captured decode steps (CUDA); None runs every step eagerly
        self.tp = tp  # tensor parallelism: every step is sent to the other ranks first
        self.device = model.device

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run the step; return ``logits [N, vocab]`` (float32) for the ``N`` sequences whose
        scheduled tokens reach their end (finished prefills and decodes), and those sequences.
        Sequences in the middle of a chunked prefill produce no logits. A sequence whose
        request wants prompt logprobs also gets the hidden states of the prompt positions this
        step computes and that ``prompt_logprobs_from`` says are still missing."""
        ids: list[int] = []
        positions: list[int] = []
        context_lens: list[int] = []
        query_lens: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        prompt_spans: list[tuple[Sequence, int, int, int]] = []  # seq, first pos, row, count
        for seq in out.scheduled:
            n = out.num_scheduled_tokens[seq.seq_id]
            c = seq.num_computed_tokens
            first = max(c, seq.prompt_logprobs_from)
            last = min(c + n, seq.num_prompt_tokens - 1)  # the last prompt position samples
            if first < last:
                prompt_spans.append((seq, first, len(ids) + first - c, last - first))
            ids.extend(seq.token_ids[c : c + n])
            positions.extend(range(c, c + n))
            context_lens.append(c)
            query_lens.append(n)
            if c + n == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(seq)
        request_ids = [s.seq_id for s in out.scheduled]
        if self.graphs is not None and self.graphs.can_run(query_lens):
            # decode-only: one copy into the bucket's static buffer, then a graph replay
            hidden = self.graphs.run(request_ids, context_lens, ids, positions)  # [T, hidden]
        else:
            with (nullcontext() if self.tp is None else self.tp.step(
                    StepInputs(request_ids, context_lens, query_lens, ids, positions))):
                meta = self.attn.prepare(request_ids, context_lens, query_lens)
                input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)  # [T]
                pos = torch.tensor(positions, dtype=torch.int64, device=self.device)  # [T]
                hidden = self.model.forward(input_ids, pos, self.attn, meta)  # [T, hidden]
        prompt_hidden = [PromptHidden(seq, first, hidden[row : row + m])
                         for seq, first, row, m in prompt_spans]
        if not sample_rows:
            return StepResult(None, [], prompt_hidden)
        rows = torch.tensor(sample_rows, dtype=torch.int64, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))  # [N, V]
        return StepResult(logits, sample_seqs, prompt_hidden)
