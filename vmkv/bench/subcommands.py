"""``vmkv bench ...``: each bench's flags, and the function that runs it (one per bench).

:func:`add_bench_commands` adds the ``bench`` subcommand to the ``vmkv`` command line
(``vmkv/cli.py``); each ``cmd_bench_*`` imports its bench lazily, so ``vmkv --help`` stays
instant and loads no torch. The engine flags come from ``vmkv.config_args``, never from the CLI.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from vmkv import envs
from vmkv.config_args import add_engine_args, add_model_arg, engine_config, parse_size


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}"
                                         ) from None


def _emit(result: dict, columns: Sequence[str], json_path: str | None) -> None:
    from vmkv.bench.common import finish

    finish(result, result["rows"], columns, json_path)


# -- bench memory / vmm -------------------------------------------------------------------------
def cmd_bench_memory(args: argparse.Namespace) -> int:
    import torch

    from vmkv.bench import memory

    result = memory.run(args.lengths, max_len=args.max_len, block_size=args.block_size,
                        page_sizes=tuple(args.page_sizes),
                        shape=(args.layers, args.kv_heads, args.head_dim),
                        dtype=getattr(torch, args.dtype))
    print(f"lengths {args.lengths}; KV {result['kv_shape']}")
    _emit(result, memory.COLUMNS, args.json)
    return 0


def cmd_bench_vmm(args: argparse.Namespace) -> int:
    from vmkv.bench import vmm

    result = vmm.run(tuple(args.page_sizes), devices=tuple(args.devices))
    _emit(result, vmm.COLUMNS, args.json)
    for what, why in result["skipped"].items():
        print(f"skipped {what}: {why}")
    return 0


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from vmkv.bench import common, hf_baseline, throughput
    from vmkv.bench.workloads import spec_from_args

    if args.baseline == "hf" and (args.device != "cpu" or args.dtype not in ("auto", "float32")):
        raise ValueError("--baseline hf runs transformers in float32 on the CPU: use it with "
                         "--device cpu and --dtype float32 (or auto) so the ratio compares "
                         "like with like")
    requests, workload = common.workload_for_model(spec_from_args(args), args.model)
    if args.data_parallel_size > 1:
        return _bench_throughput_replicas(args, requests, workload)
    modes = ["virtual", "paged"] if args.kv_mode == "both" else [args.kv_mode]
    caching = [False, True] if args.compare_prefix_caching else [args.enable_prefix_caching]
    configs = {m + (throughput.PREFIX_SUFFIX if on and args.compare_prefix_caching else ""):
               engine_config(argparse.Namespace(**{**vars(args), "kv_mode": m,
                                                    "enable_prefix_caching": on}))
               for m in modes for on in caching}
    if args.compare_structured_outputs and args.compare_sampling is not None:
        raise ValueError("--compare-structured-outputs and --compare-sampling each add one twin "
                         "run per mode: use one of them at a time")
    twin = (throughput.STRUCTURED if args.compare_structured_outputs
            else throughput.sampled(args.compare_sampling) if args.compare_sampling is not None
            else None)
    result = throughput.run(configs, requests, repeats=args.repeats,
                            warmup_prompts=args.warmup_prompts, progress=not args.no_progress,
                            twin=twin)
    if args.baseline == "hf":
        from vmkv.models import resolve_model

        hf = hf_baseline.run(resolve_model(args.model, progress=False), requests,
                             batch_size=args.hf_batch_size, progress=not args.no_progress)
        result["hf"] = hf
        result["ratio_vs_hf"] = {m: s["output_tokens_per_s"] / hf["output_tokens_per_s"]
                                 for m, s in result["summary"].items()}
    return _finish_throughput(args, result, workload)


def _finish_throughput(args: argparse.Namespace, result: dict[str, object],
                       workload: dict[str, object]) -> int:
    """Print the start-up lines and the table of ``bench throughput``; write JSON and plot."""
    from vmkv.bench import common, plots, throughput

    result = {"bench": "throughput", "options": common.options(args), "workload": workload,
              **result}
    for mode, s in result["startup"].items():
        print(f"{mode}: engine built in {s['engine_init_s']:.2f} s, first token "
              f"{s['startup_to_first_token_s']:.2f} s after construction began")
    common.finish(result, throughput.table_rows(result), throughput.COLUMNS, args.json,
                  plots.throughput, args.plot)
    return 0


def _bench_throughput_replicas(args: argparse.Namespace, requests: list[object],
                               workload: dict[str, object]) -> int:
    """``bench throughput --data-parallel-size N`` (N > 1): replica processes, one mode."""
    from vmkv.bench import throughput_dp

    if (args.kv_mode == "both" or args.compare_prefix_caching
            or args.compare_structured_outputs or args.compare_sampling is not None
            or args.baseline != "none"):
        raise ValueError("--data-parallel-size > 1 runs one engine kind: use it without "
                         "--kv-mode both, --compare-prefix-caching, "
                         "--compare-structured-outputs, --compare-sampling and --baseline")
    result = throughput_dp.run(engine_config(args), requests, repeats=args.repeats,
                               warmup_prompts=args.warmup_prompts,
                               progress=not args.no_progress)
    return _finish_throughput(args, result, workload)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import contextlib

    from vmkv.bench import common, plots, serve
    from vmkv.bench.launch import LaunchedServer
    from vmkv.bench.workloads import spec_from_args
    from vmkv.models import load_tokenizer, resolve_model

    requests, workload = common.workload_for_model(spec_from_args(args), args.launch_model,
                                                   args.tokenizer)
    tokenizer = load_tokenizer(args.tokenizer or resolve_model(args.launch_model,
                                                               progress=False))
    server_argv = [args.launch_model] if args.launch_model else []
    launched = (LaunchedServer(server_argv + common.engine_argv(args)) if args.launch
                else contextlib.nullcontext())
    with launched as srv:
        base_url = srv.base_url if args.launch else args.base_url
        model = args.model or serve.first_model(base_url, args.api_key)
        target = serve.ServeTarget(base_url, model, args.endpoint, args.api_key)
        runs = [serve.run(target, requests, request_rate=rate, burstiness=args.burstiness,
                          max_concurrency=args.max_concurrency, seed=args.seed,
                          tokenizer=tokenizer, progress=not args.no_progress)
                for rate in args.request_rate]
    result = {"bench": "serve", "options": common.options(args), "workload": workload,
              "server": {"base_url": base_url, "model": model, "launched": args.launch,
                         "startup_s": srv.startup_s if args.launch else None},
              "runs": runs}
    common.finish(result, serve.table_rows(result), serve.COLUMNS, args.json, plots.serve,
                  args.plot)
    return 0


def cmd_bench_kernels(args: argparse.Namespace) -> int:
    from vmkv.bench import common, kernels, plots
    from vmkv.config import default_layout

    result = kernels.run(args.batch_sizes, args.context_lens, phases=args.phases,
                         prefill_len=args.prefill_len,
                         layout=args.kv_layout or default_layout("cpu"),
                         block_size=args.block_size, repeats=args.repeats, warmup=args.warmup,
                         max_tokens=args.max_tokens, cuda=not args.no_cuda,
                         progress=not args.no_progress,
                         kv_dtypes=args.kv_cache_dtype.split(","))
    result = {"bench": "kernels", "options": common.options(args), **result}
    common.finish(result, result["rows"], kernels.COLUMNS, args.json, plots.kernels, args.plot)
    for what in result["skipped"]:
        print(f"skipped {what} (over --max-tokens {args.max_tokens})")
    return 0


def cmd_bench_profile(args: argparse.Namespace) -> int:
    from vmkv.bench import common, plots, profile

    result = profile.run(engine_config(args), batch=args.batch_size, context=args.context_len,
                         prefill_batch=args.prefill_batch, prefill_len=args.prefill_len,
                         repeats=args.repeats, warmup=args.warmup,
                         prefill_kernel=not args.no_prefill_kernel)
    result = {**result, "options": common.options(args)}
    common.finish(result, result["rows"], profile.COLUMNS, args.json, plots.profile,
                  args.plot)
    return 0


def cmd_bench_accuracy(args: argparse.Namespace) -> int:
    from vmkv.bench import accuracy, common

    variants = args.variants.split(",")
    if args.kv_cache_dtype:  # the reference's weights with each KV dtype
        base = ":".join(accuracy.parse_variant(args.reference)[:2])
        variants = [f"{base}:{kv}" for kv in args.kv_cache_dtype.split(",")]
    result = accuracy.run(variants, args.reference, model=args.model,
                          texts=args.text, positions=args.positions, chunk=args.chunk,
                          kv_mode=args.kv_mode)
    result = {"bench": "accuracy", "options": common.options(args), **result}
    common.finish(result, result["rows"], accuracy.COLUMNS, args.json)
    return 0


def cmd_bench_startup(args: argparse.Namespace) -> int:
    from vmkv.bench import common, startup

    argv = (["--model", args.model] if args.model else []) + common.engine_argv(args)
    result = {"bench": "startup", "options": common.options(args),
              **startup.run(argv, repeats=args.repeats, caches=args.compile_cache)}
    common.finish(result, result["rows"], startup.COLUMNS, args.json)
    return 0


def cmd_bench_study(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vmkv.bench.study import runner
    from vmkv.bench.study.scale import SCALES

    scale = SCALES["smoke" if args.smoke else "quick" if args.quick else "full"]
    return runner.run(Path(args.out), scale, out_arg=args.out, parts=args.parts,
                      force=args.force, progress=not args.no_progress,
                      gpu_results=args.gpu_results, render_only=args.render_only)


def add_bench_commands(sub: argparse._SubParsersAction) -> None:
    """The ``bench`` subcommand and one subcommand per bench under it."""
    from vmkv.bench.memory import SEED_LENGTHS, SMOLLM2_135M
    from vmkv.bench.workloads import add_workload_args

    def _rates(text: str) -> list[float]:
        try:
            rates = [float(x) for x in text.split(",") if x.strip()]
        except ValueError:
            rates = []
        if not rates or min(rates) <= 0:
            raise argparse.ArgumentTypeError(f"expected positive rates or inf, got {text!r}")
        return rates

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench",
                                                                       required=True)
    p = bench.add_parser("memory", help="useful fraction of KV memory per strategy")
    p.add_argument("--lengths", type=_int_list, default=list(SEED_LENGTHS))
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--page-sizes", type=lambda s: [parse_size(x) for x in s.split(",")],
                   default=[64 << 10, 2 << 20], help="virtual page sizes, e.g. 64K,2M")
    p.add_argument("--layers", type=int, default=SMOLLM2_135M[0])
    p.add_argument("--kv-heads", type=int, default=SMOLLM2_135M[1])
    p.add_argument("--head-dim", type=int, default=SMOLLM2_135M[2])
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "int8"],
                   default="float32", help="the KV dtype (int8: --kv-cache-dtype int8's rows)")
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(func=cmd_bench_memory)

    p = bench.add_parser("vmm", help="map/unmap latency per page")
    p.add_argument("--page-sizes", type=lambda s: [parse_size(x) for x in s.split(",")],
                   default=[4 << 10, 64 << 10, 2 << 20])
    p.add_argument("--devices", type=lambda s: s.split(","), default=["cpu", "cuda"],
                   help="backends to measure; unavailable ones are reported and skipped")
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(func=cmd_bench_vmm)

    p = bench.add_parser("throughput", conflict_handler="resolve",
                         help="offline throughput, all requests at once (vLLM's bench throughput)")
    add_model_arg(p)
    add_engine_args(p)
    p.add_argument("--kv-mode", choices=["virtual", "paged", "both"], default="virtual",
                   help="both: build both engines, run them alternately, print virtual/paged")
    add_workload_args(p, default="random", num_prompts=64)
    p.add_argument("--compare-prefix-caching", action="store_true",
                   help="run every mode with prefix caching off and on, alternated; print on/off")
    p.add_argument("--compare-structured-outputs", action="store_true",
                   help="run every mode plain and JSON-schema constrained (same lengths), "
                        "alternated; print constrained/plain")
    p.add_argument("--compare-sampling", type=float, metavar="TEMPERATURE",
                   help="run every mode greedy and sampled at TEMPERATURE (same lengths), "
                        "alternated; print sampled/greedy")
    p.add_argument("--repeats", type=int, default=3, help="measured runs per mode")
    p.add_argument("--warmup-prompts", type=int, default=8,
                   help="requests of the workload run once per engine before measuring")
    p.add_argument("--baseline", choices=["none", "hf"], default="none",
                   help="hf: also run HF transformers generate with static batches")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH.png")
    p.set_defaults(func=cmd_bench_throughput)

    p = bench.add_parser("serve", conflict_handler="resolve",
                         help="load an OpenAI-compatible server (vLLM's bench serve metrics)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server to load (ignored with --launch)")
    p.add_argument("--model", default=None,
                   help="model name in the requests (default: the server's first model)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--api-key", default=envs.api_key())
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder for the prompts' vocabulary (default: vmkv's model)")
    p.add_argument("--request-rate", type=_rates, default=[float("inf")],
                   help="requests/s, comma-separated for several runs; inf: all at once")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    add_workload_args(p, default="random", num_prompts=64)
    p.add_argument("--launch", action="store_true",
                   help="start vmkv serve on a free port with the engine options, then stop it")
    p.add_argument("--launch-model", default=None, help="model folder for --launch")
    add_engine_args(p)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH.png")
    p.set_defaults(func=cmd_bench_serve)

    p = bench.add_parser("kernels", help="attention alone: virtual slots vs block tables")
    p.add_argument("--batch-sizes", type=_int_list, default=[1, 8, 32])
    p.add_argument("--context-lens", type=_int_list, default=[256, 1024, 4096])
    p.add_argument("--phases", type=lambda s: s.split(","),
                   default=["decode", "decode-sdpa", "prefill"])
    p.add_argument("--prefill-len", type=int, default=256, help="new tokens per prefill chunk")
    p.add_argument("--kv-layout", choices=["all-layers", "per-layer"], default=None,
                   help="virtual layout of the timed caches (default: the engine's on the CPU, "
                        "per-layer)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32768,
                   help="skip CPU points with batch x context above this (memory)")
    p.add_argument("--kv-cache-dtype", default="float32", metavar="LIST",
                   help="comma-separated KV dtypes timed side by side: float32, bfloat16, "
                        "int8 (q in bfloat16 where the CPU has it)")
    p.add_argument("--no-cuda", action="store_true", help="skip the Triton twins on CUDA")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH.png")
    p.set_defaults(func=cmd_bench_kernels)

    p = bench.add_parser("profile", help="one decode and one prefill step split into parts, "
                                         "each against its roofline")
    add_model_arg(p)
    add_engine_args(p)
    p.add_argument("--batch-size", type=int, default=64, help="decoding requests")
    p.add_argument("--context-len", type=int, default=256, help="tokens each decoder holds")
    p.add_argument("--prefill-batch", type=int, default=8, help="requests prefilled at once")
    p.add_argument("--prefill-len", type=int, default=256, help="tokens per prefilled prompt")
    p.add_argument("--repeats", type=int, default=5, help="measured steps per phase (median)")
    p.add_argument("--no-prefill-kernel", action="store_true",
                   help="CPU prefill chunks by per-request SDPA (the batched kernel's worth)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH.png")
    p.set_defaults(func=cmd_bench_profile)

    p = bench.add_parser("accuracy", help="teacher-forced top-1 agreement and perplexity of "
                                          "weight formats against a reference, through the engine")
    add_model_arg(p)
    p.add_argument("--variants", default="gguf:float32,gguf:bfloat16,int8:float32,w8a8:float32",
                   help="comma-separated quantization[:dtype[:kv_cache_dtype]] to score")
    p.add_argument("--kv-cache-dtype", metavar="LIST",
                   help="comma-separated KV cache dtypes (e.g. int8) to score with the "
                        "reference's weights and dtype, instead of --variants")
    p.add_argument("--reference", default="none:float32",
                   help="the variant the others are compared with (default: the dequantized "
                        "float32 model)")
    p.add_argument("--text", action="append", metavar="FILE",
                   help="text to score (repeatable; default: docs/ARCHITECTURE.md and "
                        "docs/models.md)")
    p.add_argument("--positions", type=int, default=2000, help="scored positions, at least")
    p.add_argument("--chunk", type=int, default=512, help="tokens per scored prompt")
    p.add_argument("--kv-mode", choices=("virtual", "paged"), default="virtual")
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(func=cmd_bench_accuracy)

    p = bench.add_parser("study", help="the address-translation study of this machine: "
                                       "every part, report, figures and JSON in one folder")
    p.add_argument("--out", default="vmkv-study", metavar="DIR",
                   help="folder of study.md, images/study/ and results/study.json (docs: the "
                        "committed study)")
    p.add_argument("--quick", action="store_true",
                   help="the same questions on fewer, shorter requests (<= 10 min on 2 cores)")
    p.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)  # the test's
    p.add_argument("--parts", type=lambda s: [x for x in s.split(",") if x], default=[],
                   help="measure only these parts, again if already there (memory, "
                        "translation, tax, mapping, end_to_end, elastic, gpu)")
    p.add_argument("--force", action="store_true", help="measure every part again")
    p.add_argument("--gpu-results", metavar="DIR", default=None,
                   help="a benchmarks/gpu/check.sh results folder (default: "
                        "docs/results/gpu-check, then benchmarks/results/gpu-check-*)")
    p.add_argument("--render-only", action="store_true",
                   help="measure nothing: write study.md and the figures from the JSON")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_bench_study)

    p = bench.add_parser("startup", help="process start to first token, in fresh processes")
    add_model_arg(p)
    add_engine_args(p)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compile-cache", nargs="+", choices=("cold", "warm"),
                   default=["cold", "warm"],
                   help="TorchInductor cache states to time, alternated: cold (empty), warm "
                        "(filled by an unrecorded run first)")
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(func=cmd_bench_startup)
