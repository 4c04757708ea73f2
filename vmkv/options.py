"""How a config field is declared, checked and defaulted: the machinery under ``vmkv/config.py``.

    option(default, help, ...)     a dataclass field carrying an :class:`Option` in its metadata
    resolve_env_defaults(config)   a field left None whose Option names a variable takes its value
    check_options(config)          ValueError naming the first field whose value is refused
    check_names(cls, names, ...)   TypeError naming a misspelt option, with the closest field

The config classes call the last three from ``__post_init__``; the command line reads the
same Options to generate its flags (``vmkv/config_args.py``). Nothing here imports torch.
"""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

from vmkv import envs


@dataclass(frozen=True)
class Option:
    """How a config field is described and checked, and whether it is a command-line flag.

    Attributes:
        help: what the field means (the flag's help text).
        choices: the allowed values, if they are a fixed set.
        minimum: the smallest allowed value of an int field.
        size: a size in bytes; the command line also takes 64K, 2M, 1G.
        flag: offered as ``--field-name`` (False: the commands add it their own way, or not).
        env: the environment variable the default comes from: the command line's (a
            ServerConfig field), or, for an EngineConfig field left None, the config's own.
        many: a tuple of str; the flag takes one or more values.
    """

    help: str
    choices: tuple[str, ...] | None = None
    minimum: int | None = None
    size: bool = False
    flag: bool = True
    env: envs.EnvVar | None = None
    many: bool = False


def option(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field with ``default`` and an :class:`Option` in its metadata."""
    return field(default=default, metadata={"option": Option(help, **kwargs)})


def field_option(f: Any) -> Option | None:
    """The :class:`Option` of a dataclass field, or None for a plain field."""
    return f.metadata.get("option")


def size_bytes(text: str) -> int:
    """Bytes from '65536', '64K', '64KiB', '2M', '2MiB', '1G' (ValueError otherwise)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise ValueError(f"expected a size like 64K or 2M, got {text!r}") from None


def check_options(config: Any) -> None:
    """ValueError naming the first field of ``config`` whose value its Option refuses.

    None is allowed exactly where the default is None. A size given as text (``"4G"``) becomes
    its bytes, as on the command line."""
    for f in fields(config):
        opt = field_option(f)
        value = None if opt is None else getattr(config, f.name)
        if opt is None or (value is None and f.default is None):
            continue
        if value is None:
            raise ValueError(f"{f.name} must be set (default {f.default!r}), got None")
        if opt.size and isinstance(value, str):
            try:
                value = size_bytes(value)
            except ValueError as exc:
                raise ValueError(f"{f.name}: {exc}") from None
            object.__setattr__(config, f.name, value)
        if opt.minimum is not None:  # a number: an int, or for a float field either
            floats = "float" in str(f.type)
            kind_ok = isinstance(value, numbers.Real if floats else numbers.Integral)
            if not kind_ok or isinstance(value, bool):  # numpy ints are Integral too
                kind = "a number" if floats else "an integer"
                raise ValueError(f"{f.name} must be {kind}, got {value!r}")
        if opt.choices is not None and value not in opt.choices:
            raise ValueError(f"{f.name} must be one of {opt.choices}, got {value!r}")
        if opt.minimum is not None and value < opt.minimum:
            bound = "positive" if opt.minimum == 1 else f">= {opt.minimum}"
            raise ValueError(f"{f.name} must be {bound}, got {value}")


def resolve_env_defaults(config: Any) -> None:
    """Set every field of ``config`` left None whose Option names an environment variable to
    the variable's value (a bool field: a switch, see :func:`vmkv.envs.switch`); ValueError
    naming the variable when its value is not one of the field's choices."""
    for f in fields(config):
        opt = field_option(f)
        if opt is None or opt.env is None or getattr(config, f.name) is not None:
            continue
        value: Any = (envs.switch(opt.env) if str(f.type).startswith("bool")
                      else opt.env.get())
        if opt.choices is not None and value not in opt.choices:
            raise ValueError(f"{f.name} must be one of {opt.choices}, got {value!r} (from "
                             f"${opt.env.name})")
        object.__setattr__(config, f.name, value)


def check_names(cls: type, names: Iterable[str], caller: str) -> None:
    """TypeError naming every one of ``names`` that is not an option of the dataclass ``cls``
    (with the closest option names), so a misspelt option never passes silently. The options
    are the fields a caller may set (derived fields, ``init=False``, are not)."""
    known = [f.name for f in fields(cls) if f.init]
    unknown = [name for name in names if name not in known]
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1)
        hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise TypeError(f"{caller} got unknown option(s) {', '.join(hints)}; the options are "
                    f"{cls.__name__}'s fields: {', '.join(known)}")
