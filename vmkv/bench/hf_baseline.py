"""``--baseline hf``: HF transformers ``generate`` with static batches on the same workload.

The same model folder vmkv loads, read by ``AutoModelForCausalLM.from_pretrained`` in float32.
Requests are taken in workload order, ``batch_size`` at a time, prompts left-padded (with an
attention mask). A static batch cannot stop its sequences at different lengths, so every batch
generates ``max(output_len)`` of its requests for all of them (``min_new_tokens =
max_new_tokens``, greedy): throughput counts **only the requested tokens** (``sum(output_len)``),
the way a user of static batching experiences it; the padded extra work is reported as
``generated_tokens``. One small warm-up ``generate`` runs first.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from vmkv.bench.common import progress_bar
from vmkv.bench.workloads import BenchRequest


def load(model_path: str | Path) -> tuple[Any, Any]:
    """The HF model (float32, eval) and tokenizer of a model folder."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # renamed in 4.56
    model = AutoModelForCausalLM.from_pretrained(str(model_path), **{dtype_kw: torch.float32})
    return model.eval(), AutoTokenizer.from_pretrained(str(model_path))


def _batch_inputs(batch: Sequence[BenchRequest], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):  # left padding: the prompts end where generation starts
        n = len(r.prompt_token_ids)
        ids[i, width - n :] = torch.tensor(r.prompt_token_ids)
        mask[i, width - n :] = 1
    return ids, mask


def _generate(model: Any, batch: Sequence[BenchRequest], new_tokens: int, pad_id: int) -> int:
    ids, mask = _batch_inputs(batch, pad_id)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             pad_token_id=pad_id, temperature=None, top_p=None, top_k=None)
    generated = out.shape[1] - ids.shape[1]
    if generated != new_tokens:
        raise RuntimeError(f"HF generate returned {generated} new tokens, asked {new_tokens}")
    return generated * len(batch)


def run(model_path: str | Path, requests: Sequence[BenchRequest], *, batch_size: int = 16,
        progress: bool = True) -> dict[str, Any]:
    """Static-batch ``generate`` over ``requests``; throughput counts the requested tokens."""
    if batch_size <= 0:
        raise ValueError(f"hf batch size must be positive, got {batch_size}")
    load_start = time.monotonic()
    model, tokenizer = load(model_path)
    load_s = time.monotonic() - load_start
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    _generate(model, requests[:2], 4, pad_id)  # warm-up
    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    bar = progress_bar(progress, "hf", total=len(requests))
    generated = 0
    start = time.monotonic()
    for batch in batches:
        generated += _generate(model, batch, max(r.output_len for r in batch), pad_id)
        bar.update(len(batch))
    elapsed = time.monotonic() - start
    bar.close()
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    output_tokens = sum(r.output_len for r in requests)
    return {
        "batch_size": batch_size,
        "load_s": load_s,
        "elapsed_s": elapsed,
        "num_requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "generated_tokens": generated,
        "requests_per_s": len(requests) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "output_length_policy": "per batch max(output_len) generated for all; only the "
                                "requested tokens counted",
    }
