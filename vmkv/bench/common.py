"""Glue shared by the ``vmkv bench`` commands: workloads for a model, engine argv, output."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vmkv.bench.workloads import BenchRequest, WorkloadSpec, describe, for_tokenizer

NUM_HEADS = 9  # SmolLM2-135M query heads (3 KV heads, group of 3): the kernel benches' shape


def workload_for_model(spec: WorkloadSpec, model: str | None, tokenizer: str | None = None
                       ) -> tuple[list[BenchRequest], dict[str, Any]]:
    """The requests ``spec`` describes for ``model``'s vocabulary (None: the default model),
    with a description for the JSON file. A ``tokenizer`` folder, when given, sets the
    vocabulary instead of the model."""
    from vmkv.models import load_model_config, load_tokenizer, resolve_model

    if tokenizer is not None:  # e.g. another server's model: its tokenizer's vocabulary
        tok, vocab_size = load_tokenizer(tokenizer), None
    else:
        path = resolve_model(model, progress=False)
        tok, vocab_size = load_tokenizer(path), load_model_config(path).vocab_size
    requests = for_tokenizer(spec, tok, vocab_size)
    info = {"name": spec.name, "seed": spec.seed, "input_len_arg": spec.input_len,
            "output_len_arg": spec.output_len, "path": spec.path, **describe(requests)}
    if spec.name == "shared-prefix":
        info["prefix_len"] = spec.prefix_len
    return requests, info


def engine_argv(args: argparse.Namespace) -> list[str]:
    """Command-line flags reproducing the engine options of ``args`` (those not at their
    default), for a child ``vmkv serve`` or start-up probe."""
    from vmkv.config_args import add_engine_args

    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    argv: list[str] = []
    for action in parser._actions:
        if not action.option_strings:
            continue
        value = getattr(args, action.dest, action.default)
        if value is None or value == action.default:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x
            argv.append(action.option_strings[0 if value else 1])
        elif action.nargs == 0:  # store_true / store_const
            argv.append(action.option_strings[0])
        else:
            argv += [action.option_strings[0], str(value)]
    return argv


def options(args: argparse.Namespace) -> dict[str, Any]:
    """The command's options as JSON-able values (recorded with the result)."""
    return {k: v for k, v in vars(args).items() if k != "func" and not callable(v)}


def finish(result: dict[str, Any], rows: Sequence[dict[str, Any]], columns: Sequence[str],
           json_path: str | None, plot: Callable[[dict[str, Any], str], None] | None = None,
           plot_path: str | None = None) -> None:
    """Print the table, write the JSON (with the environment) and the plot when asked."""
    from vmkv.bench.report import format_table, write_json

    print(format_table(rows, columns))
    write_json(json_path, {**result, "rows": list(rows)})
    if json_path:
        print(f"wrote {json_path}")
    if plot is not None and plot_path:
        plot(result, plot_path)
        print(f"wrote {Path(plot_path)}")


def progress_bar(enabled: bool, desc: str, *, total: int | None = None,
                 iterable: Any = None, unit: str = "req") -> Any:
    """A tqdm bar that draws only when ``enabled`` (a disabled one still iterates and counts)."""
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, dynamic_ncols=True, leave=False,
                disable=not enabled)
