"""The executor layer: what runs the model on one rank or on many (below the engine, above the
model, the attention backends and the KV managers; see vmkv/executor/base.py)."""

from __future__ import annotations

from pathlib import Path

from vmkv.config import EngineConfig
from vmkv.executor.base import Executor, ModelParts, StepOutput
from vmkv.executor.settings import WorkerSettings

__all__ = ["Executor", "ModelParts", "StepOutput", "create_executor"]


def create_executor(config: EngineConfig, model_path: Path) -> Executor:
    """The executor ``config`` asks for: one rank here, or ``tensor_parallel_size`` ranks.
    The ranks get :class:`WorkerSettings`, the values they need, not the config."""
    settings = WorkerSettings.from_config(config, model_path)
    if config.tensor_parallel_size > 1:
        from vmkv.distributed.executor import TensorParallelExecutor

        return TensorParallelExecutor(
            settings, local_ranks=config.tp_local_ranks or config.tensor_parallel_size,
            init_method=config.distributed_init_method, timeout=config.distributed_timeout,
            check=bool(config.tp_check))
    from vmkv.executor.local import LocalExecutor

    return LocalExecutor(settings)
