"""How the study writes numbers, and the check that every number of its report comes from its
JSON: the report formats JSON values with :func:`num` only, so every number token of the
markdown is ``num(v)`` of some value ``v`` in the JSON, or a token of one of its strings
(commands, names, dates)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

#: a number token: 1,234 or 12 or -0.5 or 1.5e-05, not digits inside words (fp32, 16K)
NUMBER = re.compile(r"(?<![\w.,])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:e[-+]?\d+)?(?!\w|\.\w)")


def num(value: Any) -> str:
    """A number as the report writes it: integers with thousands separators; others with
    three significant digits below 100 and none above; None as "n/a"."""
    if value is None:
        return "n/a"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"num() formats numbers, got {value!r}")
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value):
        return str(value)
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def number_tokens(text: str) -> list[str]:
    """The number tokens of ``text`` (not digits inside words such as fp32 or SmolLM2-135M)."""
    return NUMBER.findall(text)


def _leaves(doc: Any) -> Iterator[Any]:
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield key
            yield from _leaves(value)
    elif isinstance(doc, list):
        for value in doc:
            yield from _leaves(value)
    else:
        yield doc


def sourced_tokens(doc: Any) -> set[str]:
    """Every token the report may write for ``doc``: ``num`` of each number, and the number
    tokens of each string (keys included)."""
    tokens: set[str] = set()
    for leaf in _leaves(doc):
        if isinstance(leaf, str):
            tokens.update(number_tokens(leaf))
        elif isinstance(leaf, (int, float)) and not isinstance(leaf, bool):
            tokens.add(num(leaf))
    return tokens


def unsourced_numbers(markdown: str, doc: Any) -> list[str]:
    """Number tokens of ``markdown`` that no value or string of ``doc`` gives (should be [])."""
    known = sourced_tokens(doc)
    return [t for t in number_tokens(markdown) if t not in known]
