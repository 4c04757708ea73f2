"""The executor layer: what runs the model on one rank or on many (below the engine, above the
model, the attention backends and the KV managers; see vmkv/executor/base.py)."""

from __future__ import annotations

from pathlib import Path

from vmkv.config import EngineConfig
from vmkv.executor.base import Executor

__all__ = ["Executor", "create_executor"]


def create_executor(config: EngineConfig, model_path: Path) -> Executor:
    """The executor ``config`` asks for: one rank here, or ``tensor_parallel_size`` ranks."""
    if config.tensor_parallel_size > 1:
        from vmkv.distributed.executor import TensorParallelExecutor

        return TensorParallelExecutor(config, model_path)
    from vmkv.executor.local import LocalExecutor

    return LocalExecutor(config, model_path)
