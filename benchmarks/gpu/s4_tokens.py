"""Step 4: greedy tokens on CUDA: virtual vs paged vs transformers, eager vs CUDA graphs, and
the whole engine (scheduler, VMM pages, background mapper, graphs) on a random-weight Llama.

The GPU machine has no gguf, so there is no default model: a small Llama config (GQA, head_dim
32) is built with transformers, randomised (norms and biases too) and saved with
save_pretrained together with a word-level tokenizer, then loaded by vmkv from that folder.

float32 must match transformers exactly (as on CPU). bfloat16 kernels differ in accumulation
order, so bf16 equality is reported per pair; vmkv's bf16 variants are expected to agree.
``VMKV_CHECK_DEVICE=cpu`` runs the same code on CPU (dry run of this script).
"""

from __future__ import annotations

import functools
import os
import sys

from common import ROOT, WORK, Result, guard, run_step, save_word_tokenizer, tiny_llama_config

sys.path.insert(0, str(ROOT / "tests"))
DEVICE = os.environ.get("VMKV_CHECK_DEVICE", "cuda")
NEW_TOKENS = 32


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, object]:
    """Whole-sequence matches and the first divergence of each prompt."""
    first = []
    for x, y in zip(a, b, strict=True):
        diff = [i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q]
        first.append(diff[0] if diff else None)
    return {"equal": sum(f is None for f in first), "of": len(a), "first_divergence": first}


def hf_greedy(hf_model, prompts: list[list[int]], n: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    import torch

    hf_model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=DEVICE)
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=n, pad_token_id=0)
            outs.append(out[0, len(p):].tolist())
    return outs


def vmkv_greedy(model, dtype, mode: str, kernel: str | None, prompts, *, chunk=None,  # type: ignore[no-untyped-def]
                graphs: bool = False) -> list[list[int]]:
    import model_helpers as mh
    import torch

    from vmkv.config import CacheConfig
    from vmkv.kv import create_kv_cache

    if kernel is not None:
        os.environ["VMKV_ATTENTION_BACKEND"] = kernel
    else:
        os.environ.pop("VMKV_ATTENTION_BACKEND", None)
    spec = model.config.kv_spec(dtype)
    kv = create_kv_cache(CacheConfig(kv_mode=mode, kv_cache_memory=256 << 20, block_size=16),
                         spec, num_slots=8, max_model_len=512, device=DEVICE)
    try:
        if not graphs:
            return mh.greedy_generate(model, kv, prompts, NEW_TOKENS, prefill_chunk=chunk)
        return graph_greedy(model, kv, prompts)
    finally:
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        kv.close()


def graph_greedy(model, kv, prompts) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Prefill eagerly, then every decode step through a captured DecodeGraphRunner."""
    import torch

    from vmkv.attention import create_attention_backend
    from vmkv.engine.cuda_graphs import DecodeGraphRunner

    attn = create_attention_backend(kv)
    runner = DecodeGraphRunner(model, attn, max_batch_size=8)
    runner.capture()
    rids = [f"g{i}" for i in range(len(prompts))]
    toks = [list(p) for p in prompts]
    with torch.inference_mode():
        for rid, p in zip(rids, prompts, strict=True):
            assert kv.allocate(rid, len(p))
        meta = attn.prepare(rids, [0] * len(rids), [len(p) for p in prompts])
        ids = torch.tensor([t for p in prompts for t in p], device=DEVICE)
        pos = torch.tensor([i for p in prompts for i in range(len(p))], device=DEVICE)
        hidden = model.forward(ids, pos, attn, meta)
        last = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
        nxt = model.compute_logits(hidden[last.to(DEVICE)]).argmax(-1).tolist()
        for t, n in zip(toks, nxt, strict=True):
            t.append(n)
        for _ in range(NEW_TOKENS - 1):
            ctx = [len(t) - 1 for t in toks]
            for rid in rids:
                assert kv.allocate(rid, 1)
            hidden = runner.run(rids, ctx, [t[-1] for t in toks], ctx)
            nxt = model.compute_logits(hidden).argmax(-1).tolist()
            for t, n in zip(toks, nxt, strict=True):
                t.append(n)
    for rid in rids:
        kv.free(rid)
    assert runner.num_replays == NEW_TOKENS - 1
    return [t[len(p):] for t, p in zip(toks, prompts, strict=True)]


def engine_tokens(path, mode: str, prompts, res: Result) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """The whole engine on CUDA: scheduler, VMM pages, background mapper and decode graphs (the
    engine builds the last two itself on CUDA; on a CPU dry run it has neither)."""
    os.environ.pop("VMKV_ATTENTION_BACKEND", None)
    from vmkv.llm import LLM
    from vmkv.sampling_params import SamplingParams

    llm = LLM(str(path), kv_mode=mode, device=DEVICE, dtype="bfloat16",
              kv_cache_memory=256 << 20, max_model_len=512, max_num_seqs=8,
              max_num_batched_tokens=512)  # prefill all at once
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    toks = [list(o.outputs[0].token_ids) for o in outs]
    # prefix caching is on by default: the same prompts again hit the cached pages/blocks
    # (virtual: the cached physical pages mapped at a second slot's VA) and give the same tokens
    # (a unit must lie wholly inside a prompt: a 2 MiB page holds 2,048 tokens of this tiny
    # model in the all-layers layout, so virtual mode can only show no hit and equal tokens)
    unit_tokens = engine.kv._unit_span(0)[1]
    expect_hits = max(len(p) for p in prompts) - 1 >= unit_tokens
    again = llm.generate(prompts, params, use_tqdm=False)
    hits = sum(o.num_cached_tokens for o in again)
    res.check(f"engine/{mode}: the same prompts again, prefix caching on: "
              + ("cache hits, same tokens" if expect_hits else "no whole unit, same tokens"),
              (hits > 0) == expect_hits and [list(o.outputs[0].token_ids) for o in again] == toks,
              cached_tokens=hits, unit_tokens=unit_tokens)
    info: dict[str, object] = {}
    if engine.mapper is not None:
        info["mapper"] = engine.mapper.stats.as_dict()
    if engine.graphs is not None:
        info["graph_replays"] = engine.graphs.num_replays
    res.record(f"engine_{mode}", info)
    engine.kv.check()
    llm.engine.close()
    return toks


def run_dtype(res: Result, path, dtype_name: str, dtype, prompts, runs: dict) -> None:  # type: ignore[no-untyped-def]
    """Every vmkv variant of one dtype (one model load)."""
    import torch

    from vmkv.models import load_model

    model, _ = load_model(path, dtype, DEVICE)
    variants: list[tuple[str, str | None]] = [("virtual", None), ("paged", None)]
    if DEVICE == "cuda" and dtype == torch.bfloat16:
        variants = [("virtual", "aten-flash"), ("virtual", "triton"), ("paged", "triton")]
    for mode, kernel in variants:
        name = f"{mode}/{kernel or 'auto'}/{dtype_name}"
        toks = guard(res, name, functools.partial(vmkv_greedy, model, dtype, mode, kernel,
                                                  prompts))
        if toks is not None:
            runs[name] = toks
        if DEVICE == "cuda" and dtype == torch.bfloat16:
            gname = name + "/graphs"
            toks = guard(res, gname, functools.partial(vmkv_greedy, model, dtype, mode, kernel,
                                                       prompts, graphs=True))
            if toks is not None:
                runs[gname] = toks
                res.check(f"{gname} == eager", toks == runs.get(name),
                          **agreement(toks, runs.get(name, toks)))
    name = f"virtual/chunked7/{dtype_name}"
    toks = guard(res, name, functools.partial(vmkv_greedy, model, dtype, "virtual", None,
                                              prompts, chunk=7))
    if toks is not None:
        runs[name] = toks


def main(res: Result) -> None:
    import model_helpers as mh
    import torch

    torch.manual_seed(0)
    path = WORK / "tiny-llama"
    hf_cfg = tiny_llama_config()
    hf = mh.save_random_model(hf_cfg, path, seed=0)
    save_word_tokenizer(path, hf_cfg.vocab_size)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, hf_cfg.vocab_size, (n,), generator=gen).tolist()
               for n in (3, 17, 40, 61)]
    runs: dict[str, list[list[int]]] = {}
    runs["hf/fp32"] = hf_greedy(hf.to(DEVICE), prompts, NEW_TOKENS)
    runs["hf/bf16"] = hf_greedy(hf.to(torch.bfloat16), prompts, NEW_TOKENS)
    del hf
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        run_dtype(res, path, dtype_name, dtype, prompts, runs)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    for name, toks in runs.items():
        if name.startswith("hf"):
            continue
        ref = runs["hf/fp32"] if name.endswith("fp32") else runs["hf/bf16"]
        agree = agreement(toks, ref)
        strict = name.endswith("fp32")
        res.check(f"{name} == transformers" + (" (strict)" if strict else " (bf16: reported)"),
                  toks == ref or not strict, **agree)
    bf16 = [n for n in runs if n.endswith("bf16") and not n.startswith("hf")]
    for n in bf16[1:]:
        res.check(f"{n} == {bf16[0]} (vmkv bf16 variants agree)", runs[n] == runs[bf16[0]],
                  **agreement(runs[n], runs[bf16[0]]))
    for mode in ("virtual", "paged"):
        toks = guard(res, f"engine/{mode}", functools.partial(engine_tokens, path, mode,
                                                              prompts, res))
        if toks is not None:
            ref = runs.get(f"{mode}/auto/bf16") or runs.get(
                "virtual/aten-flash/bf16" if mode == "virtual" else "paged/triton/bf16")
            res.check(f"engine/{mode}/bf16 == greedy loop", toks == ref,
                      **agreement(toks, ref or toks))
    res.record("tokens", runs)
    res.headline = f"{sum(c['ok'] for c in res.checks)}/{len(res.checks)} token checks"


if __name__ == "__main__":
    run_step("s4_tokens", main)
