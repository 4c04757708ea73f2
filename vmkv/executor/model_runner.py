"""The only code that runs a model forward: a :class:`~vmkv.executor.plan.StepPlan` in, the
logits of its sample rows (and the prompt spans' hidden states) out. Every rank runs one."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from vmkv.attention.base import AttentionBackend
from vmkv.executor.base import StepOutput
from vmkv.executor.plan import StepPlan
from vmkv.models.linear import writes_float32_into
from vmkv.models.llama import LlamaModel

if TYPE_CHECKING:
    from vmkv.executor.cuda_graphs import DecodeGraphRunner

logger = logging.getLogger("vmkv")


class ModelRunner:
    """Owns the model and the attention backend of one rank; every tensor of a step is built
    here.

    Args:
        model, attn: the rank's model and the attention backend over its KV cache.
        graphs: its decode steps, already captured as CUDA graphs (built before the runner,
            :func:`~vmkv.executor.cuda_graphs.maybe_create_graph_runner`); None runs every
            step eagerly.
    """

    def __init__(self, model: LlamaModel, attn: AttentionBackend,
                 graphs: DecodeGraphRunner | None = None) -> None:
        self.model = model
        self.attn = attn
        self.graphs = graphs
        self.device = model.device
        self._said_verify_is_eager = False
        self._logits: torch.Tensor | None = None  # the step logits' buffer (_step_logits)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        """Run the step; the logits of its sample rows and the hidden states of its prompt
        spans."""
        wanted = plan.output_rows()
        hidden = self._forward(plan, wanted)  # [len(wanted), hidden]
        spans, sample_rows = plan.prompt_spans, plan.sample_rows
        if len(wanted) < plan.num_tokens:  # pruned: step rows -> rows of hidden
            at = {row: i for i, row in enumerate(wanted)}
            spans = [(at[row], count) for row, count in spans]
            sample_rows = [at[row] for row in sample_rows]
        prompt_hidden = [hidden[row : row + count] for row, count in spans]
        if not sample_rows:
            return StepOutput(None, prompt_hidden)
        rows = torch.tensor(sample_rows, dtype=torch.int64, device=self.device)
        return StepOutput(self._step_logits(hidden.index_select(0, rows)), prompt_hidden)

    def _step_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The step's logits ``[N, vocab]`` in a buffer reused from step to step (valid until
        the next :meth:`execute`: the engine samples from them first). Freshly allocated, the
        logits of a wide step outgrow glibc's largest heap block (32 MiB: 64 rows of Gemma 3's
        262k vocabulary are 64 MiB) and are mmapped and page-faulted in anew every step: 16k
        faults, ~16 ms of a ~110 ms bf16 decode step at batch 64 on a 2-core Zen 4 EPYC."""
        head = self.model.lm_head
        if not writes_float32_into(head):
            return self.compute_logits(hidden)
        n = hidden.shape[0]
        if self._logits is None or self._logits.shape[0] < n:
            self._logits = torch.empty(n, head.out_features, dtype=torch.float32)
        return self.model.compute_logits(hidden, out=self._logits[:n])

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> torch.Tensor:
        """The hidden states ``[N, hidden]`` of the plan's :meth:`~StepPlan.output_rows`, with
        every row's K/V written to the cache (a prefill chunk's other rows skip the last
        layer's output projection and MLP; in decode N = T)."""
        return self._forward(plan, plan.output_rows())

    def _forward(self, plan: StepPlan, wanted: list[int]) -> torch.Tensor:
        every_row = len(wanted) == plan.num_tokens
        if every_row and self.graphs is not None:
            if self.graphs.can_run(plan.query_lens):
                # decode-only: one copy into the bucket's static buffer, then a graph replay
                return self.graphs.run(plan.request_ids, plan.context_lens, plan.input_ids,
                                       plan.positions)
            if not self._said_verify_is_eager and len(plan.sample_rows) > len(plan.query_lens):
                self._said_verify_is_eager = True
                logger.info("CUDA graphs: steps with several query rows per request "
                            "(speculative decoding's verify steps) run eagerly: the graphs "
                            "capture decode steps of one row per request")
        meta = self.attn.prepare(plan.request_ids, plan.context_lens, plan.query_lens)
        ids = torch.tensor(plan.input_ids, dtype=torch.int64, device=self.device)  # [T]
        pos = torch.tensor(plan.positions, dtype=torch.int64, device=self.device)  # [T]
        keep = None if every_row else torch.tensor(wanted, dtype=torch.int64,
                                                   device=self.device)  # [N]
        return self.model.forward(ids, pos, self.attn, meta, keep)  # [N, hidden]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden]`` -> ``logits [N, vocab]`` (float32)."""
        return self.model.compute_logits(hidden)
