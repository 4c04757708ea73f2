"""What the two real executors share: rank 0's :class:`~vmkv.executor.worker.Worker` in the
engine's process, and the contract's calls answered from it."""

from __future__ import annotations

import torch

from vmkv.executor.base import Executor, ModelParts, StepOutput
from vmkv.executor.plan import StepPlan
from vmkv.executor.worker import Worker


class RankZeroExecutor(Executor):
    """An :class:`Executor` whose rank 0 runs here, in a private worker; subclasses build it
    and call :meth:`_adopt` (:class:`~vmkv.executor.local.LocalExecutor` alone,
    :class:`~vmkv.distributed.executor.TensorParallelExecutor` with the other ranks)."""

    _worker: Worker | None = None

    def _adopt(self, worker: Worker, model_name: str) -> None:
        """Take ``worker`` as rank 0: its KV manager is the engine's."""
        self._worker = worker
        self.kv, self.model_config = worker.kv, worker.model_config
        self.model_name = model_name
        self.max_model_len = worker.max_model_len
        self.dtype = worker.model.dtype

    def execute(self, plan: StepPlan) -> StepOutput:
        return self._rank_zero().runner.execute(plan)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._rank_zero().runner.compute_logits(hidden)

    def describe(self) -> list[str]:
        worker = self._rank_zero()
        return [worker.describe_weights(), worker.describe()]

    def close(self) -> None:
        """Release rank 0's KV memory, mapper and weights; safe to call again."""
        if not self._closed:
            self._closed = True
            if self._worker is not None:
                self._worker.close()

    @property
    def layers(self) -> str:
        return self._rank_zero().layers

    def model_parts(self) -> ModelParts:
        worker = self._rank_zero()
        return ModelParts(worker.model, worker.attn, worker.fused)

    @property
    def graph_replays(self) -> int | None:
        graphs = self._rank_zero().runner.graphs
        return None if graphs is None else graphs.num_replays

    def _rank_zero(self) -> Worker:
        if self._worker is None:
            raise RuntimeError(f"{type(self).__name__} has no rank 0 worker (start-up failed)")
        return self._worker
