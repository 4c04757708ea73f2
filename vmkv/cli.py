"""The ``vmkv`` command line: ``serve``, ``generate``, ``model fetch``, ``bench ...``.

Each command lives in its own small function; heavy imports happen inside them so that
``vmkv --help`` is instant. The ``bench`` subcommands are in ``vmkv/bench/subcommands.py``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from vmkv.bench.subcommands import add_bench_commands
from vmkv.config import EngineConfig
from vmkv.config_args import (
    add_engine_args,
    add_model_arg,
    add_server_args,
    engine_config,
    server_config,
)
from vmkv.process_tuning import tune_process

Command = Callable[[argparse.Namespace], int]


# -- serve / generate / model ---------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                                                   "%(message)s")
    config = engine_config(args)
    # NOTE: the only import of vmkv.server in vmkv/ (lazy): the engine never needs the
    # server's dependencies (fastapi, uvicorn, pydantic).
    from vmkv.server.main import serve

    serve(config, server_config(args))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from vmkv.llm import LLM
    from vmkv.sampling_params import SamplingParams

    llm = LLM.from_config(engine_config(args))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=args.sample_seed)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)
    print(out[0].outputs[0].text)
    return 0


def cmd_tp_worker(args: argparse.Namespace) -> int:
    from vmkv import envs
    from vmkv.distributed.worker import rank_device, serve_rank

    rank, size, local_rank = envs.torchrun_rank()
    if not 0 < rank < size:
        raise ValueError(f"vmkv tp-worker serves ranks 1..WORLD_SIZE-1 (rank 0 is the engine), "
                         f"got RANK={rank}, WORLD_SIZE={size}")
    serve_rank(rank, size, "env://", rank_device(args.device, local_rank), args.timeout)
    return 0


def cmd_model_fetch(args: argparse.Namespace) -> int:
    from vmkv.models import fetch_default_model

    print(fetch_default_model())
    return 0


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_model_arg(p, positional=True)
    add_server_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("generate", help="complete one prompt and print the text")
    add_model_arg(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="apply the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--sample-seed", type=int, default=None)
    add_engine_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("tp-worker", help="one tensor-parallel rank joining an engine on another "
                       "machine (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (LOCAL_RANK is added)")
    p.add_argument("--timeout", type=float,
                   default=EngineConfig.__dataclass_fields__["distributed_timeout"].default,
                   help="seconds a collective waits (use the engine's --distributed-timeout)")
    p.set_defaults(func=cmd_tp_worker)

    model = sub.add_parser("model", help="model cache").add_subparsers(dest="model_cmd",
                                                                        required=True)
    p = model.add_parser("fetch", help="download and convert the default model once")
    p.set_defaults(func=cmd_model_fetch)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vmkv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    add_bench_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    tune_process()  # first: before any command loads torch (VMKV_PROCESS_TUNING=0: off)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"vmkv: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
