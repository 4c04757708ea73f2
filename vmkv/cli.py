"""The ``vmkv`` command line: ``serve``, ``generate``, ``model fetch``, ``bench ...``.

Each command lives in its own small function; heavy imports happen inside them so that
``vmkv --help`` is instant.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: see docs/cpu.md

Command = Callable[[argparse.Namespace], int]


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}"
                                         ) from None


def _size(text: str) -> int:
    """Bytes from '65536', '64K', '64KiB', '2M', '2MiB', '1G'."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 64K or 2M, got {text!r}"
                                         ) from None


def _emit(result: dict, columns: Sequence[str], json_path: str | None) -> None:
    from vmkv.bench.report import format_table, write_json

    print(format_table(result["rows"], columns))
    write_json(json_path, result)
    if json_path:
        print(f"\nwrote {json_path}")


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


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from vmkv.bench.memory import SEED_LENGTHS, SMOLLM2_135M

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench",
                                                                       required=True)
    p = bench.add_parser("memory", help="useful fraction of KV memory per strategy")
    p.add_argument("--lengths", type=_int_list, default=list(SEED_LENGTHS))
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--page-sizes", type=lambda s: [_size(x) for x in s.split(",")],
                   default=[64 << 10, 2 << 20], help="virtual page sizes, e.g. 64K,2M")
    p.add_argument("--layers", type=int, default=SMOLLM2_135M[0])
    p.add_argument("--kv-heads", type=int, default=SMOLLM2_135M[1])
    p.add_argument("--head-dim", type=int, default=SMOLLM2_135M[2])
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(func=cmd_bench_memory)

    p = bench.add_parser("vmm", help="map/unmap latency per page")
    p.add_argument("--page-sizes", type=lambda s: [_size(x) for x in s.split(",")],
                   default=[4 << 10, 64 << 10, 2 << 20])
    p.add_argument("--devices", type=lambda s: s.split(","), default=["cpu", "cuda"],
                   help="backends to measure; unavailable ones are reported and skipped")
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(func=cmd_bench_vmm)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vmkv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_bench(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"vmkv: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
