"""Megatron-style sharding of the Llama family over tensor-parallel ranks.

    qkv_proj      column-parallel: rank r keeps its query heads and its KV heads
    o_proj        row-parallel: the columns of those query heads; outputs summed (all-reduce)
    gate_up_proj  column-parallel: rank r's slice of gate and of up
    down_proj     row-parallel: the matching columns; outputs summed (all-reduce)
    embedding, norms, LM head: replicated (only rank 0 computes logits)

Query heads split evenly. KV heads split evenly when there are at least as many as ranks;
with fewer, each is replicated on ``size / num_kv_heads`` consecutive ranks (as vLLM does), so
rank r's query heads always find their KV head on rank r. Row-parallel biases stay on rank 0
(the others hold zeros), so the sum adds each once.

The embedding and the LM head stay whole: a vocab-parallel head would need its logits gathered
to rank 0 every step (``N x vocab`` floats), and keeping the whole head there keeps sampling,
structured outputs, logprobs and penalties one-process code.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch

from vmkv.models.config import ModelConfig


class HeadSlices(NamedTuple):
    """Rank r's query heads, KV heads and MLP columns, as ``(start, count)`` pairs."""

    q: tuple[int, int]
    kv: tuple[int, int]
    mlp: tuple[int, int]


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """ValueError unless ``cfg``'s heads and MLP split over ``size`` ranks."""
    problems = []
    if cfg.num_heads % size:
        problems.append(f"{cfg.num_heads} attention heads")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        problems.append(f"{cfg.num_kv_heads} KV heads (neither a multiple nor a divisor)")
    if cfg.intermediate_size % size:
        problems.append(f"an MLP of {cfg.intermediate_size}")
    if problems:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's "
                         f"{', '.join(problems)}")


def head_slices(cfg: ModelConfig, rank: int, size: int) -> HeadSlices:
    """What rank ``rank`` of ``size`` holds of the whole model ``cfg``."""
    q = cfg.num_heads // size
    kv = max(1, cfg.num_kv_heads // size)
    mlp = cfg.intermediate_size // size
    return HeadSlices((rank * q, q), (rank * cfg.num_kv_heads // size, kv), (rank * mlp, mlp))


def shard_config(cfg: ModelConfig, rank: int, size: int) -> ModelConfig:
    """The config of rank ``rank``'s shard: its head counts and MLP width."""
    check_divisible(cfg, size)
    if size == 1:
        return cfg
    s = head_slices(cfg, rank, size)
    return replace(cfg, num_heads=s.q[1], num_kv_heads=s.kv[1], intermediate_size=s.mlp[1],
                   tensor_parallel_size=size)


def shard_state(state: dict[str, torch.Tensor], cfg: ModelConfig, rank: int, size: int
                ) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s slices of the whole model's weights ``state`` (vmkv names; views where
    possible). ``cfg`` is the whole model's config."""
    if size == 1:
        return state
    s, d = head_slices(cfg, rank, size), cfg.head_dim
    q_rows = _rows(s.q, d)
    k_rows = _rows(s.kv, d, offset=cfg.q_size)
    v_rows = _rows(s.kv, d, offset=cfg.q_size + cfg.kv_size)
    gate_rows = _rows(s.mlp, 1)
    up_rows = _rows(s.mlp, 1, offset=cfg.intermediate_size)
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if ".qkv_proj." in name:  # weight [(Hq + 2 Hkv) D, hidden] or bias [(Hq + 2 Hkv) D]
            out[name] = torch.cat([t[q_rows], t[k_rows], t[v_rows]])
        elif ".gate_up_proj." in name:  # [2 I, hidden] or [2 I]
            out[name] = torch.cat([t[gate_rows], t[up_rows]])
        elif name.endswith("o_proj.weight"):  # [hidden, Hq D]: the columns of rank r's heads
            out[name] = t[:, q_rows].contiguous()
        elif name.endswith("down_proj.weight"):  # [hidden, I]
            out[name] = t[:, gate_rows].contiguous()
        elif name.endswith(("o_proj.bias", "down_proj.bias")):  # summed once: rank 0's
            out[name] = t if rank == 0 else torch.zeros_like(t)
        else:
            out[name] = t
    return out


def _rows(span: tuple[int, int], width: int, offset: int = 0) -> slice:
    start, count = span
    return slice(offset + start * width, offset + (start + count) * width)
