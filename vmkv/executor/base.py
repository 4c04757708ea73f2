"""The executor contract: what the engine sees of the ranks that run its model.

    LocalExecutor            one rank, in the engine's process (vmkv/executor/local.py)
    TensorParallelExecutor   N ranks, one process each (vmkv/distributed/executor.py)

Both hold rank 0's worker (:class:`~vmkv.executor.rank_zero.RankZeroExecutor`) and offer the
same calls; the engine builds a :class:`~vmkv.executor.plan.StepPlan` per step, hands it to
:meth:`Executor.execute` and samples from the :class:`StepOutput` it gets back. Benches and
tests read how rank 0 runs (:attr:`Executor.layers`, :meth:`Executor.model_parts`,
:attr:`Executor.graph_replays`) through the contract, never through a worker. Tests give the
engine a stand-in executor (no weights) through ``LLMEngine(config, executor=...)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, NamedTuple

import torch

from vmkv.executor.plan import StepPlan
from vmkv.kv.base import KVCacheManager
from vmkv.models.config import ModelConfig

if TYPE_CHECKING:
    from vmkv.attention.base import AttentionBackend
    from vmkv.models.fused_layers import FusedLayers
    from vmkv.models.llama import LlamaModel

#: how rank 0's decoder layers run (:attr:`Executor.layers`)
LAYER_MODES = ("fused", "compiled", "eager")


class StepOutput(NamedTuple):
    """``logits [N, vocab]`` (float32; None when the plan samples nothing) of the plan's
    ``sample_rows``, and the hidden states ``[count, hidden]`` of each of its
    ``prompt_spans``. The logits may live in a buffer the next step overwrites: use them
    before the next ``execute``."""

    logits: torch.Tensor | None
    prompt_hidden: list[torch.Tensor]


class ModelParts(NamedTuple):
    """Rank 0's model, its attention backend and its fused C++ layers (None unless the layers
    run fused): what a profiler times part by part, wrapping their public methods for the
    measurement only (``vmkv bench profile``); the fused layers time their own GEMMs
    (``FusedLayers.profile``). The engine never uses them."""

    model: LlamaModel
    attention: AttentionBackend
    fused: FusedLayers | None


class Executor(ABC):
    """Runs the engine's steps on the ranks that hold the model.

    Attributes:
        kv: the KV manager the scheduler allocates from (rank 0's).
        model_config: the whole model's config (vocabulary, EOS ids, heads).
        model_name: what the start-up report calls the model.
        max_model_len: longest prompt + output.
        dtype: the weights' and KV cache's dtype.
    """

    kv: KVCacheManager
    model_config: ModelConfig
    model_name: str
    max_model_len: int
    dtype: torch.dtype
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
        """Release the KV memory (and its mapper; the model and the ranks too); safe to call
        again."""
        if not self._closed:
            self._closed = True
            self.kv.close()

    # -- how rank 0 runs: for benches, profilers and tests ---------------------------------------
    @property
    def layers(self) -> str:
        """How rank 0's decoder layers run: ``fused`` (C++ calls around the attention),
        ``compiled`` (TorchInductor) or ``eager`` (one of :data:`LAYER_MODES`)."""
        return "eager"

    def model_parts(self) -> ModelParts:
        """Rank 0's model, attention backend and fused layers (:class:`ModelParts`);
        NotImplementedError for an executor without a model (a test's stand-in)."""
        raise NotImplementedError(f"{type(self).__name__} holds no model")

    @property
    def graph_replays(self) -> int | None:
        """Decode steps run as CUDA graph replays so far; None when no graph was captured
        (the CPU, ``--enforce-eager``, ``--no-cuda-graphs``, tensor parallelism)."""
        return None
