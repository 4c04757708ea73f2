"""Speculative decoding on one user (batch 1), honest about acceptance: time per output token
with and without proposals, alternated, each run a fresh process, on these workloads:

- ``grounded``: vmkv/bench/grounded.py's tasks (renames, typo fixes, quotes of this project's
  own files), greedy, stopped at the model's EOS (``--grounded-stop eos``, the default; the
  task's answer length + 8 caps it), so each output is the task's answer and not what a small
  model runs on into past it; ``--grounded-stop length`` is the earlier ``ignore_eos`` setting.
- ``grounded-loopfree``: the same tasks, each capped where its greedy output (one probe run
  without speculation) starts repeating a 4-gram of its own that is not in the prompt
  (``loop_onset``): the answers without this small model's loops, so no accepted token can
  come from one.
- ``random-sampled``: random-token prompts sampled at ``--temperature`` (0.9) with a fixed seed
  per prompt, ``ignore_eos``, 128 tokens: the output does not loop, rejection sampling really
  rejects, so it shows the cost when guesses fail.
- ``random``: the same prompts, greedy, ``ignore_eos``: this small model falls into loops there
  (not run unless named in ``--workloads``).

Reported per workload: acceptance, mean accepted length, the share of accepted tokens inside
repeated 4-grams of the output itself, the mean output length, and (greedy) whether the tokens
were the same with and without.

    python benchmarks/spec_decode.py --out DIR [--repeats 5] [--num-prompts 9]
        [--workloads grounded,grounded-loopfree,random-sampled] [--grounded-stop eos|length]
        [--temperature 0.9]
        [--spec '{"method": "ngram", "num_speculative_tokens": 8, ...}'] [--kv-mode virtual]
        [--lock /tmp/vmkv-bench.lock] [--max-output 256]
        [--openvino --openvino-model OV_DIR [--openvino-num-assistant-tokens 5[,8]]
         [--openvino-max-ngram-size 3]]

Each run: one engine (``LLMEngine``, the default model, the machine's default dtype), one
warm-up request, then every prompt alone (batch 1); TPOT = (finish - first token) / (n - 1)
over the n tokens actually produced, from the engine's own clock, the median over prompts per
run, the median of runs per variant. ``--openvino``: OpenVINO GenAI's ``LLMPipeline`` with
``prompt_lookup=True`` on the same grounded token ids and caps, stopped the same way (its venv
and export from benchmarks/peers/setup.sh), in the rotation. Writes ``spec_decode.json`` and a plot
under ``--out``; ``--lock`` holds an exclusive flock per run.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2,
                "prompt_lookup_max": 4}
OV_CHILD = ROOT / "benchmarks" / "peers" / "openvino_prompt_lookup.py"


def workloads(num_prompts: int, max_output: int, *, grounded_stop: str = "eos",
              temperature: float = 0.9, seed: int = 0) -> dict[str, list[dict]]:
    """``{"grounded", "random-sampled", "random"}`` -> rows of ``{"kind", "prompt",
    "output_len", "ignore_eos", "temperature", "seed"}``."""
    from vmkv.bench.grounded import chat_encoder, grounded_workload
    from vmkv.bench.workloads import WorkloadSpec, for_tokenizer
    from vmkv.models import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(None))
    grounded = grounded_workload(num_prompts, chat_encoder(tok), lambda t: tok(t).input_ids,
                                 seed=seed, max_output=max_output)
    random_rows = for_tokenizer(WorkloadSpec("random", num_prompts=num_prompts,
                                             input_len=(128, 512), output_len=(128, 128),
                                             seed=seed), tok)
    def rand(temp: float) -> list[dict]:
        return [{"kind": "random", "prompt": r.prompt_token_ids, "output_len": r.output_len,
                 "ignore_eos": True, "temperature": temp, "seed": seed + i}
                for i, r in enumerate(random_rows)]

    return {"grounded": [{"kind": k, "prompt": ids, "output_len": n,
                          "ignore_eos": grounded_stop == "length", "temperature": 0.0,
                          "seed": None} for k, ids, n in grounded],
            "random-sampled": rand(temperature), "random": rand(0.0)}


def child(args: argparse.Namespace) -> None:
    """One fresh engine over one workload file: a JSON line of its numbers."""
    from vmkv.process_tuning import tune_process

    tune_process()
    from vmkv.bench.grounded import repeated_ngram_share
    from vmkv.config import EngineConfig
    from vmkv.engine.llm_engine import LLMEngine
    from vmkv.sampling_params import SamplingParams

    rows = json.loads(Path(args.child).read_text())
    spec = json.loads(args.spec) if args.spec != "off" else None
    engine = LLMEngine(EngineConfig(kv_mode=args.kv_mode, speculative_config=spec))
    if engine.spec is not None:
        engine.spec.accepted_positions = {}

    def one(rid: str, row: dict) -> Any:
        engine.add_request(rid, row["prompt"], SamplingParams(
            temperature=row["temperature"], seed=row["seed"], max_tokens=row["output_len"],
            ignore_eos=row["ignore_eos"]))
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out
        return final

    one("warmup", rows[0])
    before = engine.spec.counters.copy() if engine.spec is not None else None
    tpots, outputs, accepted = [], [], []
    for i, row in enumerate(rows):
        out = one(f"r{i}", row)
        m, tokens = out.metrics, out.outputs[0].token_ids
        tpots.append((m.finish_time - m.first_token_time) / max(1, len(tokens) - 1))
        outputs.append(tokens)
        if engine.spec is not None:
            accepted.append(engine.spec.accepted_positions.get(f"r{i}:0", []))
    result: dict[str, Any] = {"tpot_ms": [t * 1e3 for t in tpots],
                              "tpot_median_ms": statistics.median(tpots) * 1e3,
                              "outputs": outputs, "dtype": engine.config.dtype_choice[0]}
    if engine.spec is not None and before is not None:
        result["spec_decode"] = engine.spec.counters.since(before).as_dict()
        result["repeated_ngram_share"] = repeated_ngram_share(outputs, accepted)
    engine.close()
    print("RESULT " + json.dumps(result))


def loop_onset(prompt: list[int], output: list[int], n: int = 4) -> int:
    """Where ``output`` starts repeating itself: the first position whose ``n``-gram occurred
    earlier in the output and nowhere in the prompt (copying the prompt's own repeated lines
    is no loop); ``len(output)`` when none does. ``output[:onset]`` repeats no such n-gram."""
    in_prompt = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    seen: set[tuple[int, ...]] = set()
    for i in range(len(output) - n + 1):
        gram = tuple(output[i : i + n])
        if gram in seen and gram not in in_prompt:
            return i
        seen.add(gram)
    return len(output)


class Held:
    """An exclusive flock on ``path`` while in the block (no-op for None)."""

    def __init__(self, path: str | None) -> None:
        self.path, self.file = path, None

    def __enter__(self) -> None:
        if self.path:
            self.file = open(self.path, "a")  # noqa: SIM115
            fcntl.flock(self.file, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        if self.file is not None:
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()


def run_child(cmd: list[str], lock: str | None) -> dict[str, Any]:
    with Held(lock):
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--num-prompts", type=int, default=9)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--spec", default=json.dumps(DEFAULT_SPEC))
    ap.add_argument("--kv-mode", default="virtual")
    ap.add_argument("--workloads", default="grounded,grounded-loopfree,random-sampled",
                    help="comma-separated: grounded, grounded-loopfree, random-sampled, random")
    ap.add_argument("--grounded-stop", choices=("eos", "length"), default="eos",
                    help="grounded tasks stop at the model's EOS (default) or run to their "
                         "length with ignore_eos")
    ap.add_argument("--temperature", type=float, default=0.9,
                    help="random-sampled's temperature (seeded per prompt)")
    ap.add_argument("--lock", default=None)
    ap.add_argument("--openvino", action="store_true")
    ap.add_argument("--openvino-python",
                    default=str(Path.home() / ".cache/vmkv/openvino-venv/bin/python"))
    ap.add_argument("--openvino-model", default=None)
    # OpenVINO GenAI's own prompt-lookup sample (samples/python/text_generation/
    # prompt_lookup_decoding_lm.py): 5 candidates a step, n-grams of up to 3 tokens; a comma
    # list runs each setting in the rotation and compares against the fastest
    ap.add_argument("--openvino-num-assistant-tokens", type=_int_list, default=[5],
                    help="candidates a step, or a comma list of settings to run (e.g. 5,8)")
    ap.add_argument("--openvino-max-ngram-size", type=int, default=3)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = workloads(args.num_prompts, args.max_output, grounded_stop=args.grounded_stop,
                     temperature=args.temperature)
    names = args.workloads.split(",")
    me = [sys.executable, str(Path(__file__).resolve())]
    if "grounded-loopfree" in names:
        probe = out / "grounded-probe.json"
        probe.write_text(json.dumps(rows["grounded"]))
        greedy = run_child([*me, "--out", str(out), "--child", str(probe), "--spec", "off",
                            "--kv-mode", args.kv_mode], args.lock)["outputs"]
        rows["grounded-loopfree"] = [
            {**row, "output_len": max(2, loop_onset(row["prompt"], tokens))}
            for row, tokens in zip(rows["grounded"], greedy, strict=True)]
    files = {}
    for name in names:
        files[name] = out / f"{name}.json"
        files[name].write_text(json.dumps(rows[name]))
    variants = {"off": "off", "spec": args.spec}
    openvino_ks = args.openvino_num_assistant_tokens if args.openvino else []
    runs: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        order = list(variants) if rep % 2 == 0 else list(reversed(variants))
        for name in names:
            for variant in order:
                cmd = [*me, "--out", str(out), "--child", str(files[name]), "--spec",
                       variants[variant], "--kv-mode", args.kv_mode]
                r = run_child(cmd, args.lock)
                runs.append({"workload": name, "variant": variant, "repeat": rep, **r})
                print(f"{name} {variant} rep {rep}: {r['tpot_median_ms']:.2f} ms/token",
                      flush=True)
            for k in openvino_ks if name.startswith("grounded") else []:
                cmd = [args.openvino_python, str(OV_CHILD), args.openvino_model,
                       str(files[name]), "--threads", str(os.cpu_count()),
                       "--num-assistant-tokens", str(k),
                       "--max-ngram-size", str(args.openvino_max_ngram_size)]
                r = run_child(cmd, args.lock)
                runs.append({"workload": name, "variant": openvino_variant(k, openvino_ks),
                             "repeat": rep, **r})
                print(f"{name} openvino k={k} rep {rep}: {r['tpot_median_ms']:.2f} ms/token",
                      flush=True)
    result = summarise(runs, names, args, rows)
    (out / "spec_decode.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))
    plot(result, out / "spec_decode.png")
    return 0


def _int_list(text: str) -> list[int]:
    """``"5,8"`` -> ``[5, 8]`` (argparse reports a ValueError as a usage error)."""
    return [int(k) for k in text.split(",")]


def openvino_variant(k: int, ks: list[int]) -> str:
    """The OpenVINO variant's name: ``openvino-prompt-lookup``, ``-k<k>`` when several run."""
    return "openvino-prompt-lookup" + (f"-k{k}" if len(ks) > 1 else "")


def summarise(runs: list[dict[str, Any]], names: list[str], args: argparse.Namespace,
              rows: dict[str, list[dict]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for r in runs:
        r["output_tokens"] = [len(o) for o in r["outputs"]]
    for name in names:
        mine = [r for r in runs if r["workload"] == name]
        med = {v: statistics.median(r["tpot_median_ms"] for r in mine if r["variant"] == v)
               for v in {r["variant"] for r in mine}}
        spec_runs = [r for r in mine if r["variant"] == "spec"]
        off_runs = [r for r in mine if r["variant"] == "off"]
        greedy = "sampled" not in name
        s: dict[str, Any] = {"tpot_median_ms": med,
                             "spec_over_off": med["spec"] / med["off"],
                             "per_run_spec_over_off": [
                                 a["tpot_median_ms"] / b["tpot_median_ms"]
                                 for a, b in zip(spec_runs, off_runs, strict=True)],
                             "mean_output_tokens": {
                                 v: statistics.mean(next(r for r in mine if r["variant"] == v)
                                                    ["output_tokens"]) for v in med},
                             # outputs that ended before their cap (at EOS), per variant
                             "stopped_early": {
                                 v: sum(n < row["output_len"] for n, row in zip(
                                     next(r for r in mine if r["variant"] == v)["output_tokens"],
                                     rows[name], strict=True)) for v in med},
                             "same_greedy_tokens": (all(r["outputs"] == off_runs[0]["outputs"]
                                                        for r in spec_runs + off_runs)
                                                    if greedy else None)}
        openvino = {v: t for v, t in med.items() if v.startswith("openvino-prompt-lookup")}
        if openvino:  # against OpenVINO at its best setting here (the fastest median)
            s["openvino_best"] = min(openvino, key=openvino.__getitem__)
            s["spec_over_openvino"] = med["spec"] / openvino[s["openvino_best"]]
        sd = spec_runs[0].get("spec_decode", {})
        produced = sum(spec_runs[0]["output_tokens"])
        s["proposed_tokens_per_output_token"] = (sd.get("spec_decode_num_draft_tokens", 0)
                                                 / max(1, produced))
        s.update(acceptance_rate=sd.get("acceptance_rate"),
                 mean_accepted_length=sd.get("mean_accepted_length"),
                 repeated_ngram_share=spec_runs[0].get("repeated_ngram_share"),
                 spec_decode=sd)
        summary[name] = s
    return {"summary": summary, "runs": [{k: v for k, v in r.items() if k != "outputs"}
                                         for r in runs],
            "settings": {"spec": json.loads(args.spec), "kv_mode": args.kv_mode,
                         "grounded_stop": args.grounded_stop,
                         "random_sampled_temperature": args.temperature,
                         "num_prompts": args.num_prompts, "repeats": args.repeats,
                         "max_output": args.max_output, "dtype": runs[0].get("dtype"),
                         "openvino": ({"num_assistant_tokens": args.openvino_num_assistant_tokens,
                                       "max_ngram_size": args.openvino_max_ngram_size,
                                       "model": args.openvino_model}
                                      if args.openvino else None)},
            "machine": {"cpu": _cpu(), "flags": _flags(), "cores": os.cpu_count(),
                        "python": platform.python_version(),
                        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}


def _flags() -> list[str]:
    """The CPU's vector and matrix extensions the kernels use (from /proc/cpuinfo)."""
    wanted = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
              "amx_tile", "amx_bf16")
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in wanted if f in have]
    except OSError:
        pass
    return []


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["summary"])
    variants = sorted({v for s in result["summary"].values() for v in s["tpot_median_ms"]})
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(variants)
    for j, v in enumerate(variants):
        ys = [result["summary"][n]["tpot_median_ms"].get(v, 0) for n in names]
        ax.bar([i + j * width for i in range(len(names))], ys, width, label=v)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
    ax.set_ylabel("time per output token (ms), batch 1")
    ax.set_title("speculative decoding, median of alternated fresh runs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
