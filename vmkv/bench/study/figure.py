"""What a part of the study shows: figures with their question, numbers and command, and the
part's reading. Parts build them from the study's JSON only (a part's ``figures(doc)``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Cell = Any  # a JSON value: numbers are formatted by vmkv.bench.study.report.num


@dataclass
class Figure:
    """One PNG (``images/study/<name>.png``), the one-sentence question above it, the numbers
    it plots as a table, the exact command that measures them, and notes under the table."""

    name: str
    question: str
    columns: list[str]
    rows: list[list[Cell]]
    command: str
    draw: Callable[[str], None] | None  # writes the PNG at the path; None: a table only
    notes: list[str] = field(default_factory=list)


@dataclass
class Section:
    """A part as the report shows it: its title, an opening paragraph (the answer, in numbers
    from the JSON), its figures, and where data is missing, what produces it."""

    title: str
    reading: list[str]
    figures: list[Figure]
    missing: list[str] = field(default_factory=list)
