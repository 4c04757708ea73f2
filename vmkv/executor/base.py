"""The executor contract: what the engine sees of the ranks that run its model.

    LocalExecutor            one rank, in the engine's process (vmkv/executor/local.py)
    TensorParallelExecutor   N ranks, one process each (vmkv/distributed/executor.py)

Both hold rank 0's :class:`~vmkv.executor.worker.Worker` and offer the same calls; the engine
builds a :class:`~vmkv.executor.plan.StepPlan` per step, hands it to :meth:`Executor.execute`
and samples from the logits it gets back. Tests give the engine a stand-in executor (no
weights) through ``LLMEngine(config, executor=...)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from vmkv.executor.model_runner import StepOutput
from vmkv.executor.plan import StepPlan
from vmkv.kv.base import KVCacheManager
from vmkv.models.config import ModelConfig

if TYPE_CHECKING:
    from vmkv.executor.worker import Worker


class Executor(ABC):
    """Runs the engine's steps on the ranks that hold the model.

    Attributes:
        kv: the KV manager the scheduler allocates from (rank 0's).
        model_config: the whole model's config (vocabulary, EOS ids, heads).
        model_name: what the start-up report calls the model.
        max_model_len: longest prompt + output.
        dtype: the weights' and KV cache's dtype.
        worker: rank 0's worker (model, attention backend, runner), where there is one.
    """

    kv: KVCacheManager
    model_config: ModelConfig
    model_name: str
    max_model_len: int
    dtype: torch.dtype
    worker: Worker | None = None
    _closed = False

    @abstractmethod
    def execute(self, plan: StepPlan) -> StepOutput:
        """Run one step on every rank; rank 0's logits and prompt hidden states."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden]`` (from :meth:`execute`) -> ``logits [N, vocab]``."""

    def check_health(self) -> None:
        """Raise if a rank died or hangs (the engine calls it while idle)."""

    def describe(self) -> list[str]:
        """Start-up report lines on how the model runs."""
        return []

    def close(self) -> None:
        """Release the KV memory (and its mapper; the ranks too); safe to call again."""
        if not self._closed:
            self._closed = True
            if self.worker is not None:
                self.worker.close()
            else:
                self.kv.close()
