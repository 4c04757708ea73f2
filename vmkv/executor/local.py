"""One rank in the engine's process: the executor without tensor parallelism."""

from __future__ import annotations

from pathlib import Path

import torch

from vmkv.config import EngineConfig
from vmkv.executor.base import Executor
from vmkv.executor.cuda_graphs import maybe_create_graph_runner
from vmkv.executor.model_runner import StepOutput
from vmkv.executor.plan import StepPlan
from vmkv.executor.worker import Worker


class LocalExecutor(Executor):
    """Rank 0 alone: its worker runs every step; on CUDA, a background mapper (virtual mode)
    and decode steps captured as CUDA graphs, as the config says."""

    def __init__(self, config: EngineConfig, model_path: Path) -> None:
        self.worker = Worker(config, model_path)
        self.kv, self.model_config = self.worker.kv, self.worker.model_config
        self.model_name = model_path.name
        self.max_model_len = self.worker.max_model_len
        self.dtype = self.worker.model.dtype
        # virtual mode on CUDA: the KV manager maps the next steps' pages on its own thread
        # while the GPU computes (off with --no-background-mapper)
        mapper = self.kv.start_background_mapper() if config.background_mapper else None
        # decode steps as CUDA graphs (off with --enforce-eager or VMKV_CUDA_GRAPHS=0); None
        # on the CPU
        if not config.enforce_eager:
            self.worker.runner.graphs = maybe_create_graph_runner(
                self.worker.model, self.worker.attn, max_batch_size=config.max_num_seqs,
                mapper=mapper)

    def execute(self, plan: StepPlan) -> StepOutput:
        return self.worker.runner.execute(plan)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.worker.runner.compute_logits(hidden)

    def describe(self) -> list[str]:
        return [self.worker.describe()]
