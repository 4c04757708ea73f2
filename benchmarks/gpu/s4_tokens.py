"""Step 4: greedy tokens on CUDA: virtual vs paged vs transformers, eager vs CUDA graphs, and
the whole engine (scheduler, VMM pages, background mapper, graphs) on a random-weight Llama.

The GPU machine has no gguf, so there is no default model: a small Llama config (GQA, head_dim
32) is built with transformers, randomised (norms and biases too, N(0, 0.05)) and saved with
save_pretrained together with a word-level tokenizer, then loaded by vmkv from that folder.

float32 must match transformers exactly (as on CPU). bfloat16 kernels differ in accumulation
order, so bf16 comparisons pass equal outputs and near-tie flips only: at the first divergent
position transformers (float32 compute over the same bf16 weights) must rate both picks within
NEAR_TIE logits of its best (tests/token_agreement.py; the tolerance is justified in
docs/gpu.md). Every variant's tokens and comparisons are recorded as soon as it has run.
``VMKV_CHECK_DEVICE=cpu`` runs the same code on CPU (dry run of this script).
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

from common import (
    DEVICE,
    ON_CPU,
    WORK,
    Result,
    guard,
    run_step,
    save_word_tokenizer,
    sync,
    tests_on_path,
    tiny_llama_config,
)

tests_on_path()
NEW_TOKENS = 32
WEIGHT_SCALE = 0.05  # bf16 noise well below the tolerance (docs/gpu.md, "Near-tie tolerance")
NEAR_TIE = 0.1  # logits


class Comparer:
    """Records each run's tokens and compares them with a reference run right away."""

    def __init__(self, res: Result, hf32: Any, prompts: list[list[int]]) -> None:
        import torch

        self.res, self.prompts, self.runs = res, prompts, {}
        self.logit_models = {"fp32": hf32,
                             "bf16": copy.deepcopy(hf32).to(torch.bfloat16).float()}

    def add(self, name: str, toks: list[list[int]]) -> None:
        self.runs[name] = toks
        self.res.record("tokens", self.runs)

    def next_logits(self, dtype_name: str, prompt: int, prefix: list[int]) -> Any:
        """Reference next-token logits after prompt ``prompt`` + ``prefix``."""
        import torch

        ids = torch.tensor([self.prompts[prompt] + prefix], device=DEVICE)
        with torch.inference_mode():
            return self.logit_models[dtype_name](ids).logits[0, -1].float().cpu()

    def compare(self, name: str, ref: str, tol: float = NEAR_TIE, exact: bool = False) -> None:
        """``name`` vs ``ref``: exact for float32 (or ``exact``), near-tie flips pass for
        bfloat16 (within ``tol`` logits)."""
        from token_agreement import compare_greedy

        if name not in self.runs or ref not in self.runs:
            return
        dtype_name = "fp32" if "/fp32" in name else "bf16"
        tol = None if dtype_name == "fp32" or exact else tol
        out = compare_greedy(self.runs[name], self.runs[ref],
                             functools.partial(self.next_logits, dtype_name), tol)
        rule = "exact" if tol is None else f"near-tie flips (gap <= {tol}) pass"
        self.res.check(f"{name} == {ref} ({rule})", out.pop("ok"), **out)


def vmkv_greedy(model, dtype, mode: str, kernel: str | None, prompts, *, chunk=None,  # type: ignore[no-untyped-def]
                graphs: bool = False) -> list[list[int]]:
    import model_helpers as mh

    from vmkv.config import CacheConfig
    from vmkv.kv import create_kv_cache

    spec = model.config.kv_spec(dtype)
    kv = create_kv_cache(CacheConfig(kv_mode=mode, kv_cache_memory=256 << 20, block_size=16),
                         spec, num_slots=8, max_model_len=512, device=DEVICE)
    try:
        if not graphs:
            return mh.greedy_generate(model, kv, prompts, NEW_TOKENS, prefill_chunk=chunk,
                                      kernel=kernel)
        return graph_greedy(model, kv, prompts, kernel)
    finally:
        sync()
        kv.close()


def graph_greedy(model, kv, prompts, kernel: str | None) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Prefill eagerly, then every decode step through a captured DecodeGraphRunner
    (``kernel``: the CUDA attention kernel, None: auto)."""
    import torch

    from vmkv.attention import create_attention_backend
    from vmkv.executor.cuda_graphs import DecodeGraphRunner

    attn = create_attention_backend(kv, kernel)
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


def engine_tokens(path, mode: str, prompts, res: Result  # type: ignore[no-untyped-def]
                  ) -> tuple[list[list[int]], list[list[int]]]:
    """The whole engine on CUDA: scheduler, VMM pages, background mapper and decode graphs (the
    engine builds the last two itself on CUDA; on a CPU dry run it has neither). The prompts
    run twice: prefix caching is on by default, so the second run hits the cached pages/blocks
    (virtual: cached physical pages mapped at a second slot's VA). Returns both runs' tokens."""
    from vmkv.llm import LLM
    from vmkv.sampling_params import SamplingParams

    llm = LLM(str(path), kv_mode=mode, device=DEVICE, dtype="bfloat16",
              kv_cache_memory=256 << 20, max_model_len=512, max_num_seqs=8,
              max_num_batched_tokens=512,  # prefill all at once
              attention_backend="auto")  # whatever $VMKV_ATTENTION_BACKEND says
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    runs = [[list(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                                 use_tqdm=False)]]
    # a unit must lie wholly inside a prompt: a 2 MiB page holds 2,048 tokens of this tiny
    # model in the all-layers layout, so virtual mode can only show no hit there
    unit_tokens = engine.kv.prefix.caching.units.unit_span(0)[1]
    expect_hits = max(len(p) for p in prompts) - 1 >= unit_tokens
    again = llm.generate(prompts, params, use_tqdm=False)
    runs.append([list(o.outputs[0].token_ids) for o in again])
    hits = sum(o.num_cached_tokens for o in again)
    res.check(f"engine/{mode}: the same prompts again, prefix caching on: "
              + ("cache hits" if expect_hits else "no whole unit, no hit"),
              (hits > 0) == expect_hits, cached_tokens=hits, unit_tokens=unit_tokens)
    info: dict[str, object] = {}
    if engine.kv.mapping.mapper is not None:
        info["mapper"] = engine.kv.mapping.mapper.stats.as_dict()
    replays = engine.executor.graph_replays  # None: no graph was captured
    if replays is not None:
        info["graph_replays"] = replays
    res.record(f"engine_{mode}", info)
    engine.kv.accounting.check()
    llm.engine.close()
    return runs[0], runs[1]


def run_dtype(res: Result, cmp: Comparer, path, dtype_name: str, dtype) -> None:  # type: ignore[no-untyped-def]
    """Every vmkv variant of one dtype (one model load), compared as soon as it has run."""
    import torch

    from vmkv.models import load_model

    model, _ = load_model(path, dtype, DEVICE)
    variants: list[tuple[str, str | None]] = [("virtual", None), ("paged", None)]
    with_graphs = not ON_CPU and dtype == torch.bfloat16
    if with_graphs:
        # each mode's auto kernel first: the engine's tokens are compared with that run
        variants = [("virtual", "triton"), ("virtual", "aten-flash"), ("paged", "triton")]
    hf = f"hf/{dtype_name}"
    first = f"{variants[0][0]}/{variants[0][1] or 'auto'}/{dtype_name}"

    def run(name: str, *args: Any, **kwargs: Any) -> None:
        toks = guard(res, name, functools.partial(vmkv_greedy, model, dtype, *args,
                                                  cmp.prompts, **kwargs))
        if toks is not None:
            cmp.add(name, toks)

    for mode, kernel in variants:
        name = f"{mode}/{kernel or 'auto'}/{dtype_name}"
        run(name, mode, kernel)
        cmp.compare(name, hf)
        if name != first and dtype_name == "bf16":
            cmp.compare(name, first)  # vmkv's bf16 variants agree
        if with_graphs:
            run(name + "/graphs", mode, kernel, graphs=True)
            cmp.compare(name + "/graphs", name)
    name = f"virtual/chunked7/{dtype_name}"
    run(name, "virtual", None, chunk=7)
    cmp.compare(name, hf)
    if dtype_name == "bf16":
        cmp.compare(name, first)


def tiny_model(path: Path) -> tuple[Any, list[list[int]]]:
    """The tiny random Llama saved at ``path`` with its word tokenizer (vmkv loads it from
    there), as a float32 transformers model on the device, and the prompts every run decodes."""
    import model_helpers as mh
    import torch

    torch.manual_seed(0)
    hf_cfg = tiny_llama_config()
    hf = mh.save_random_model(hf_cfg, path, seed=0, scale=WEIGHT_SCALE).to(DEVICE)
    save_word_tokenizer(path, hf_cfg.vocab_size)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, hf_cfg.vocab_size, (n,), generator=gen).tolist()
               for n in (3, 17, 40, 61)]
    return hf, prompts


def main(res: Result) -> None:
    import model_helpers as mh
    import torch

    path = WORK / "tiny-llama"
    hf, prompts = tiny_model(path)
    cmp = Comparer(res, hf, prompts)
    cmp.add("hf/fp32", mh.hf_greedy(hf, prompts, NEW_TOKENS))
    cmp.add("hf/bf16", mh.hf_greedy(copy.deepcopy(hf).to(torch.bfloat16), prompts, NEW_TOKENS))
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        run_dtype(res, cmp, path, dtype_name, dtype)
        if not ON_CPU:
            torch.cuda.empty_cache()
    for mode in ("virtual", "paged"):
        name = f"engine/{mode}/bf16"
        both = guard(res, f"engine/{mode}", functools.partial(engine_tokens, path, mode,
                                                              prompts, res))
        if both is not None:
            cmp.add(name, both[0])
            cmp.add(name + "/again", both[1])
            cmp.compare(name + "/again", name)  # a prefix-cache hit changes nothing
            loop = [n for n in cmp.runs if n.startswith(f"{mode}/") and n.endswith("/bf16")]
            if loop:
                cmp.compare(name, loop[0])  # the engine = the greedy loop
    flips = sum(c.get("near_tie_flips", 0) for c in res.checks)
    res.headline = (f"{sum(c['ok'] for c in res.checks)}/{len(res.checks)} token checks, "
                    f"{flips} near-tie flips")


if __name__ == "__main__":
    run_step("s4_tokens", main)
