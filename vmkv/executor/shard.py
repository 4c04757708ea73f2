"""What one rank of an engine holds, built the same way on every rank.

    EngineShard: the model (this rank's heads and MLP columns; the whole model with one rank),
                 the KV manager of those heads, the attention backend over it, and whether
                 the decoder layers are compiled

Rank 0 (the engine, :class:`~vmkv.engine.llm_engine.LLMEngine`) and every tensor-parallel
worker (:mod:`vmkv.distributed.worker`) call :func:`build_shard` with the same config, so
their geometry, warm-up steps (and the collectives inside them) agree.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from vmkv.attention import create_attention_backend
from vmkv.attention.base import AttentionBackend
from vmkv.config import EngineConfig, resolve_max_model_len
from vmkv.distributed.collectives import local_only
from vmkv.kv import create_kv_cache
from vmkv.kv.base import KVCacheManager
from vmkv.models import LlamaModel, ModelConfig, load_model, parse_dtype
from vmkv.models.compile import try_compile
from vmkv.models.fused_layers import FusedLayers, fuse_layers

logger = logging.getLogger("vmkv")


@dataclass
class EngineShard:
    """One rank's model, KV manager and attention backend (see the module docstring)."""

    model: LlamaModel
    model_config: ModelConfig  # the whole model's
    max_model_len: int
    kv: KVCacheManager
    attn: AttentionBackend
    compiled: bool
    fused: FusedLayers | None  # the decoder layers as C++ calls (vmkv.models.fused_layers)


def build_shard(config: EngineConfig, model_path: Path, *, rank: int = 0,
                device: str | None = None) -> EngineShard:
    """Load rank ``rank``'s part of the model onto ``device`` (default ``config.device``),
    build its KV manager and attention backend, and compile (CPU) as the config says.

    Raises ValueError for a bad model, a ``max_model_len`` past the model's limit, or a
    tensor-parallel size that does not divide the model's heads.
    """
    device = device or config.device
    dtype = parse_dtype(config.torch_dtype_name)
    model, model_config = load_model(model_path, dtype, device,
                                     linear_backend=config.linear_backend,
                                     tensor_parallel=(rank, config.tensor_parallel_size))
    max_model_len = resolve_max_model_len(config, model_config.max_model_len)
    kv = create_kv_cache(config.cache, model.config.kv_spec(dtype), num_slots=config.max_num_seqs,
                         max_model_len=max_model_len, device=device)
    attn = create_attention_backend(kv, config.attention_backend)
    # CPU float32 with MKL linears: the layers as C++ calls (off: --no-fused-layers);
    # otherwise compiled with TorchInductor (off: --enforce-eager or --no-compile-layers;
    # without a compiler or on a failure: eager, logged). Warm-up without collectives: each
    # rank compiles (or not, or fails) on its own
    fused = fuse_layers(model) if device == "cpu" and config.fused_layers else None
    with local_only():
        compiled = (device == "cpu" and fused is None and not config.enforce_eager
                    and config.compile_layers
                    and try_compile(model, partial(warm_up_step, model, kv, attn)))
    return EngineShard(model, model_config, max_model_len, kv, attn, compiled, fused)


def warm_up_step(model: LlamaModel, kv: KVCacheManager, attn: AttentionBackend,
                 num_tokens: int) -> None:
    """One real forward of ``num_tokens`` tokens of a throw-away request (compiles the graph of
    that size); its KV is freed again."""
    rid = "__vmkv_warm_up__"
    if not kv.allocate(rid, num_tokens):
        raise RuntimeError(f"no KV room for a {num_tokens}-token warm-up step")
    try:
        meta = attn.prepare([rid], [0], [num_tokens])
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=model.device)
        positions = torch.arange(num_tokens, device=model.device)
        model.forward(ids, positions, attn, meta)
    finally:
        kv.free(rid)
