"""One rank of an engine: its part of the model, the KV manager of its heads, the attention
backend, and the model runner; built the same way on every rank.

    Worker(settings, rank=r)      load rank r's shard (the whole model with one rank), its KV
                                  manager and attention backend; on CUDA, start the KV
                                  manager's mapper and capture the decode graphs, then the
                                  runner with them; on the CPU, fuse or compile the decoder
                                  layers as the settings say
    worker.runner.execute(plan)   the step's forward (ModelRunner: the only forward)

Rank 0 lives in the engine's process, inside its executor (vmkv/executor/local.py, or
vmkv/distributed/executor.py with tensor parallelism); ranks 1..N-1 each in a worker process
(vmkv/distributed/worker.py). They build with the same :class:`WorkerSettings`, so their
geometry, warm-up steps (and the collectives inside them) agree.
"""

from __future__ import annotations

import logging

import torch

from vmkv.attention import create_attention_backend
from vmkv.config import resolve_max_model_len
from vmkv.cpu_info import bf16_hardware
from vmkv.distributed.collectives import local_only
from vmkv.executor.cuda_graphs import maybe_create_graph_runner
from vmkv.executor.model_runner import ModelRunner
from vmkv.executor.plan import StepPlan
from vmkv.executor.settings import WorkerSettings
from vmkv.kv import create_kv_cache
from vmkv.models import load_model, parse_dtype
from vmkv.models.compile import try_compile, uncompile_layers
from vmkv.models.fused_layers import fuse_layers
from vmkv.models.quant.gguf_weights import describe_weights

logger = logging.getLogger("vmkv")


class Worker:
    """One rank's model shard, KV manager, attention backend and model runner.

    Attributes:
        model, model_config: this rank's model (its heads and MLP columns) and the whole
            model's config.
        max_model_len: longest prompt + output.
        kv, attn: the KV manager of this rank's heads, the attention backend over it.
        runner: the :class:`ModelRunner` (with its captured decode graphs, if any).
        compiled: the decoder layers are compiled (TorchInductor).
        fused: the decoder layers as C++ calls (vmkv.models.fused_layers), or None.
    """

    def __init__(self, settings: WorkerSettings, *, rank: int = 0,
                 device: str | None = None) -> None:
        """``device``: this rank's (default: ``settings.device``). Raises ValueError for a bad
        model, a ``max_model_len`` past the model's limit, or a tensor-parallel size that does
        not divide the model's heads."""
        device = device or settings.device
        self.rank = rank
        dtype = parse_dtype(settings.dtype)
        if device == "cpu" and dtype == torch.bfloat16 and not bf16_hardware():
            logger.warning("bfloat16 on a CPU without bfloat16 hardware (amx_bf16, avx512_bf16): "
                           "it runs emulated, several times slower than float32 "
                           "(--dtype float32)")
        self.model, self.model_config = load_model(
            settings.model_path, dtype, device, linear_backend=settings.linear_backend,
            tensor_parallel=(rank, settings.tensor_parallel_size),
            quantization=settings.quantization, lm_head_dtype=settings.lm_head_dtype)
        self.max_model_len = resolve_max_model_len(settings.max_model_len,
                                                   self.model_config.max_model_len)
        kv_spec = self.model.config.kv_spec(settings.kv_cache_dtype)
        self.kv = create_kv_cache(settings.cache, kv_spec,
                                  num_slots=settings.max_num_seqs,
                                  max_model_len=self.max_model_len, device=device)
        self.attn = create_attention_backend(self.kv, settings.attention_backend)
        # virtual mode on CUDA: the KV manager maps the next steps' pages on its own thread
        # while the GPU computes (off with --no-background-mapper)
        if settings.background_mapper:
            self.kv.mapping.start()
        # decode steps as CUDA graphs, captured with the mapping paused (off with
        # --enforce-eager or --no-cuda-graphs); None on the CPU
        graphs = (maybe_create_graph_runner(self.model, self.attn,
                                            max_batch_size=settings.max_num_seqs,
                                            pause_mapping=self.kv.mapping.paused)
                  if settings.cuda_graphs else None)
        self.runner = ModelRunner(self.model, self.attn, graphs)
        # CPU float32 with MKL or brgemm linears, or bfloat16 with brgemm ones: the layers as
        # C++ calls (off: --no-fused-layers);
        # otherwise compiled with TorchInductor (off: --enforce-eager or --no-compile-layers;
        # without a compiler or on a failure: eager, logged). Warm-up without collectives:
        # each rank compiles (or not, or fails) on its own
        self.fused = (fuse_layers(self.model) if device == "cpu" and settings.fused_layers
                      else None)
        with local_only():
            self.compiled = (device == "cpu" and self.fused is None
                             and settings.compile_layers
                             and try_compile(self.model, self.warm_up_step))

    @property
    def layers(self) -> str:
        """How the decoder layers run: ``fused``, ``compiled`` or ``eager``."""
        return "fused" if self.fused is not None else "compiled" if self.compiled else "eager"

    def describe(self) -> str:
        """How the decoder layers run (the start-up report's line)."""
        return {"fused": "decoder layers fused (C++ calls around the attention)",
                "compiled": "decoder layers compiled (TorchInductor)",
                "eager": "model runs eagerly"}[self.layers]

    def describe_weights(self) -> str:
        """The weights' format and resident bytes (the start-up report's line)."""
        return describe_weights(self.model)

    def warm_up_step(self, num_tokens: int) -> None:
        """One real forward of ``num_tokens`` tokens of a throw-away request (compiles the
        graph of that size); its KV is freed again."""
        rid = "__vmkv_warm_up__"
        if not self.kv.allocate(rid, num_tokens):
            raise RuntimeError(f"no KV room for a {num_tokens}-token warm-up step")
        try:
            self.runner.forward(StepPlan([rid], [0], [num_tokens], [0] * num_tokens,
                                         list(range(num_tokens)), [num_tokens - 1]))
        finally:
            self.kv.free(rid)

    def close(self) -> None:
        """Release the KV memory and the weights (the worker cannot run any more), and undo the
        model's replacements of its own code (fused or compiled layers hold the model: a
        reference cycle the cyclic garbage collector would break only much later)."""
        self.attn.close()
        self.kv.close()
        self.model.run_body = None
        uncompile_layers(self.model)
        # the weights go now, whoever still holds this worker (a server's route closures that a
        # web framework caches, a caller's variable): a closed engine takes no more requests
        self.model._apply(lambda t: t.new_empty(0))
