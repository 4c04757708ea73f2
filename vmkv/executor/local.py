"""One rank in the engine's process: the executor without tensor parallelism."""

from __future__ import annotations

from vmkv.executor.rank_zero import RankZeroExecutor
from vmkv.executor.settings import WorkerSettings
from vmkv.executor.worker import Worker


class LocalExecutor(RankZeroExecutor):
    """Rank 0 alone: its worker runs every step; on CUDA, a background mapper (virtual mode)
    and decode steps captured as CUDA graphs, as the settings say."""

    def __init__(self, settings: WorkerSettings) -> None:
        self._adopt(Worker(settings), settings.model_path.name)
