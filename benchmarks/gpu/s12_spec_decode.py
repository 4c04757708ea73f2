"""Step 12: speculative decoding on the device (issue 56): a tiny random Llama whose greedy
output repeats (a small vocabulary), prompt lookup proposing from it, in both KV modes.

Checks: the greedy tokens with proposals equal those without (float32: the verify step's
rows and a decode step's agree); proposals were made and some accepted, some rolled back; the
KV accounting holds with nothing left; on CUDA the decode steps still replay CUDA graphs
while the verify steps (several query rows per request) run eagerly, which the engine logs
once ("CUDA graphs: steps with several query rows ... run eagerly"). The dry run
(``VMKV_CHECK_DEVICE=cpu``) runs the same on the CPU, without graphs.
"""

from __future__ import annotations

import functools

from common import (
    DEVICE,
    ON_CPU,
    WORK,
    Result,
    guard,
    run_step,
    save_word_tokenizer,
    tests_on_path,
    tiny_llama_config,
)

tests_on_path()

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


def run_mode(res: Result, path: object, mode: str, prompts: list[list[int]]) -> None:
    from vmkv.llm import LLM
    from vmkv.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    tokens, info = {}, {}
    for spec in (None, NGRAM):
        llm = LLM(str(path), kv_mode=mode, device=DEVICE, dtype="float32",
                  kv_cache_memory=128 << 20, max_model_len=512, max_num_seqs=8,
                  speculative_config=spec)
        engine = llm.engine
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens[spec is not None] = [list(o.outputs[0].token_ids) for o in outs]
            engine.kv.accounting.check()
            if spec is not None:
                info = {**engine.spec.counters.as_dict(),
                        "graph_replays": engine.executor.graph_replays}
        finally:
            llm.close()
    res.record(f"spec_{mode}", info)
    res.check(f"{mode}: greedy tokens with proposals == without", tokens[True] == tokens[False])
    drafted = info["spec_decode_num_draft_tokens"]
    accepted = info["spec_decode_num_accepted_tokens"]
    res.check(f"{mode}: proposals accepted and rolled back", 0 < accepted < drafted,
              drafted=drafted, accepted=accepted)
    if not ON_CPU:
        res.check(f"{mode}: decode steps still replay graphs", bool(info["graph_replays"]),
                  replays=info["graph_replays"])


def main(res: Result) -> None:
    import model_helpers as mh
    import torch

    path = WORK / "tiny-llama-spec"
    cfg = tiny_llama_config(vocab_size=64)
    mh.save_random_model(cfg, path, seed=0, scale=1.0)
    save_word_tokenizer(path, cfg.vocab_size)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist() for n in (5, 23)]
    for mode in ("virtual", "paged"):
        guard(res, f"spec/{mode}", functools.partial(run_mode, res, path, mode, prompts))
    res.headline = f"{sum(c['ok'] for c in res.checks)}/{len(res.checks)} checks"


if __name__ == "__main__":
    run_step("s12_spec_decode", main)
