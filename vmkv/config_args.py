"""Command-line flags generated from the config dataclasses of ``vmkv/config.py``.

A field ``kv_cache_memory`` becomes ``--kv-cache-memory`` with the field's default, help and
choices; a bool field becomes ``--name / --no-name``; a size field also takes ``64K``, ``2M``,
``1G``. Fields whose Option says ``flag=False`` (``model``, ``tokenizer``, ``max_n``) are added
by each command its own way, or not at all. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import fields
from typing import Any, TypeVar

from vmkv import envs
from vmkv.config import EngineConfig, ServerConfig
from vmkv.options import field_option, size_bytes

C = TypeVar("C")


def parse_size(text: str) -> int:
    """Bytes from '65536', '64K', '64KiB', '2M', '2MiB', '1G' (:func:`size_bytes` for
    argparse)."""
    try:
        return size_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def flag_name(name: str) -> str:
    """``kv_cache_memory`` -> ``--kv-cache-memory``."""
    return "--" + name.replace("_", "-")


def add_config_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of the config dataclass ``cls`` whose Option is a flag."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        opt = field_option(f)
        if opt is None or not opt.flag:
            continue
        kind = typing.get_args(hints[f.name]) or (hints[f.name],)
        # an EngineConfig field left None reads its variable itself; a ServerConfig one here
        default = (f.default if opt.env is None or cls is EngineConfig
                   else envs.switch(opt.env) if bool in kind else opt.env.get())
        help_text = opt.help.replace("%", "%%")  # argparse formats help with %
        if bool in kind:
            parser.add_argument(flag_name(f.name), action=argparse.BooleanOptionalAction,
                                default=default, help=help_text)
            continue
        if opt.many:
            parser.add_argument(flag_name(f.name), nargs="+", default=default, help=help_text)
            continue
        arg_type = (parse_size if opt.size else int if int in kind
                    else float if float in kind else str)
        parser.add_argument(flag_name(f.name), type=arg_type, choices=opt.choices,
                            default=default, help=help_text)


def config_from_args(cls: type[C], args: argparse.Namespace, **values: Any) -> C:
    """``cls`` built from the flags :func:`add_config_args` added, plus ``values``."""
    flagged = {f.name: getattr(args, f.name) for f in fields(cls)
               if (opt := field_option(f)) is not None and opt.flag}
    return cls(**flagged, **values)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine options shared by ``serve``, ``generate`` and the benchmarks."""
    add_config_args(parser, EngineConfig)


def add_model_arg(parser: argparse.ArgumentParser, *, positional: bool = False) -> None:
    """``EngineConfig.model`` as the command's optional positional argument (``--model`` too,
    as vLLM's ``serve`` takes both), or ``--model``."""
    help_text = field_option(EngineConfig.__dataclass_fields__["model"]).help
    if positional:
        parser.add_argument("model", nargs="?", default=None, help=help_text)
        parser.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                            help="the model, as a flag (instead of the positional argument)")
    else:
        parser.add_argument("--model", default=None, help=help_text)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the engine options describe (ValueError for impossible values);
    ``args.model``, when the command has one, is the model."""
    model = getattr(args, "model", None)
    flag = getattr(args, "model_flag", None)
    if model is not None and flag is not None and model != flag:
        raise ValueError(f"two models: {model!r} (positional) and --model {flag!r}")
    return config_from_args(EngineConfig, args, model=model or flag)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """``vmkv serve``'s HTTP options."""
    add_config_args(parser, ServerConfig)


def server_config(args: argparse.Namespace) -> ServerConfig:
    return config_from_args(ServerConfig, args)
