"""Helpers for model tests: KV caches per mode, a tiny greedy engine loop, HF references."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vmkv.attention import create_attention_backend
from vmkv.config import CacheConfig
from vmkv.kv import KVCacheManager, create_kv_cache
from vmkv.models import LlamaModel, ModelConfig

#: (kv_mode, layout) pairs every equality test runs in; layout only matters for "virtual"
KV_CASES = [("virtual", "all-layers"), ("virtual", "per-layer"), ("paged", "all-layers")]
KV_IDS = ["virtual-all-layers", "virtual-per-layer", "paged"]


def make_kv(cfg: ModelConfig, kv_mode: str, layout: str = "all-layers", *, num_slots: int = 8,
            max_model_len: int = 256, dtype: torch.dtype = torch.float32) -> KVCacheManager:
    """A CPU KV cache with room for ``num_slots`` full-length requests (plus page slack)."""
    spec = cfg.kv_spec(dtype)
    budget = num_slots * max_model_len * spec.bytes_per_token
    slack = 2 * num_slots * 2 * spec.num_layers * (64 << 10)  # two 64 KiB pages per region
    config = CacheConfig(kv_mode=kv_mode, kv_cache_memory=budget + slack, kv_layout=layout,
                         block_size=16)
    return create_kv_cache(config, spec, num_slots=num_slots, max_model_len=max_model_len)


def _step(model: LlamaModel, kv: KVCacheManager, attn: Any, rids: list[str],
          tokens: list[list[int]], done: list[int], take: list[int],
          keep: list[int] | None = None) -> torch.Tensor:
    """Run one step where request i brings tokens[i][done[i] : done[i] + take[i]]; returns
    the hidden states ``[sum(take), hidden]`` (of the rows ``keep`` only, if given)."""
    for rid, n in zip(rids, take, strict=True):
        assert kv.allocate(rid, n), f"KV cache full for {rid}"
    meta = attn.prepare(rids, done, take)
    ids = [t for toks, c, n in zip(tokens, done, take, strict=True) for t in toks[c : c + n]]
    pos = [p for c, n in zip(done, take, strict=True) for p in range(c, c + n)]
    input_ids = torch.tensor(ids, dtype=torch.int64, device=model.device)
    positions = torch.tensor(pos, dtype=torch.int64, device=model.device)
    rows = None if keep is None else torch.tensor(keep, dtype=torch.int64, device=model.device)
    return model.forward(input_ids, positions, attn, meta, rows)


@torch.inference_mode()
def greedy_generate(model: LlamaModel, kv: KVCacheManager, prompts: list[list[int]],
                    max_new_tokens: int, *, prefill_chunk: int | None = None,
                    kernel: str | None = None) -> list[list[int]]:
    """Greedy-decode all prompts together, as an engine would: every step batches each
    unfinished request's next chunk (prompt part or last sampled token), samples the argmax
    of the logits of requests whose prompt is fully cached. No EOS stop. ``kernel``: the CUDA
    attention kernel (None: auto)."""
    attn = create_attention_backend(kv, kernel)
    rids = [f"req-{i}" for i in range(len(prompts))]
    tokens = [list(p) for p in prompts]
    done = [0] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    while True:
        active = [i for i in range(len(prompts)) if len(outputs[i]) < max_new_tokens]
        if not active:
            break
        take = [len(tokens[i]) - done[i] for i in active]
        if prefill_chunk is not None:
            take = [min(n, prefill_chunk) for n in take]
        hidden = _step(model, kv, attn, [rids[i] for i in active], [tokens[i] for i in active],
                       [done[i] for i in active], take)
        last = torch.tensor(take).cumsum(0) - 1  # row of each request's last new token
        next_ids = model.compute_logits(hidden[last]).argmax(-1).tolist()
        for i, n, tok in zip(active, take, next_ids, strict=True):
            done[i] += n
            if done[i] == len(tokens[i]):  # prompt fully cached: this token is sampled
                tokens[i].append(tok)
                outputs[i].append(tok)
    for rid in rids:
        kv.free(rid)
    kv.accounting.check()
    return outputs


@torch.inference_mode()
def prefill_logits(model: LlamaModel, kv: KVCacheManager, prompt: list[int],
                   chunk: int | None = None) -> torch.Tensor:
    """Logits ``[len(prompt), vocab]`` of every prompt position, prefilled ``chunk`` tokens a
    step (all at once if None)."""
    attn = create_attention_backend(kv)
    chunk = chunk or len(prompt)
    rows = []
    for start in range(0, len(prompt), chunk):
        n = min(chunk, len(prompt) - start)
        hidden = _step(model, kv, attn, ["req"], [prompt], [start], [n])
        rows.append(model.compute_logits(hidden))
    kv.free("req")
    return torch.cat(rows)


@torch.inference_mode()
def hf_greedy(hf_model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy ``generate`` per prompt (no padding, on the model's device), EOS
    disabled."""
    hf_model.generation_config.eos_token_id = None
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=hf_model.device)
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_new_tokens,
                                pad_token_id=0)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


def randomize_(hf_model: torch.nn.Module, seed: int, scale: float = 0.2) -> None:
    """Random values in every weight, including norms (around 1) and biases (HF inits them to
    1 and 0, which would hide a missing norm or bias): ``N(0, scale)``, norms ``1 + N(0,
    scale)``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + scale * noise if "norm" in name else scale * noise)


def save_random_model(hf_config: Any, path: Path, *, seed: int = 0,
                      max_shard_size: str | None = None, scale: float = 0.2) -> Any:
    """Build a random-weight float32 HF model from ``hf_config`` (weights as in
    :func:`randomize_`), save it (safetensors) to ``path`` and return it in eval mode as the
    reference."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    # no dtype argument: transformers < 4.56 calls it torch_dtype, later versions dtype;
    # .float() gives float32 on every version
    hf_model = AutoModelForCausalLM.from_config(hf_config).float()
    randomize_(hf_model, seed, scale)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    hf_model.save_pretrained(path, **kwargs)
    return hf_model.eval()


#: a tiny Llama (GQA 4/2, head_dim 16) for kernel-level equality tests
TINY_LLAMA = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)


def save_tiny_llama(path: Path, *, bias: bool) -> Any:
    """:data:`TINY_LLAMA` with random weights saved to ``path``, with every linear's bias or
    none (the reference model is returned)."""
    from transformers import LlamaConfig

    config = LlamaConfig(**TINY_LLAMA, attention_bias=bias, mlp_bias=bias)
    return save_random_model(config, path, seed=3)
