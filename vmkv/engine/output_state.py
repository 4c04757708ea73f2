"""What the output processor keeps per request and per sequence between steps: only what is
not emitted yet (vmkv/engine/output_processor.py makes and reads it; a
:class:`~vmkv.engine.sequence.Request` and each of its sequences carry theirs as ``output``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vmkv.engine.detokenizer import IncrementalDetokenizer
from vmkv.engine.outputs import OutputAccumulator


@dataclass(eq=False, slots=True)
class SeqOutputState:
    """One sequence's output not yet emitted."""

    detokenizer: IncrementalDetokenizer
    unsent_text: str = ""
    sent_tokens: int = 0  # output tokens emitted so far
    unsent_logprobs: list[dict[int, float]] = field(default_factory=list)
    sent_finish: bool = False


@dataclass(eq=False, slots=True)
class RequestOutputState:
    """One request's output not yet emitted, and its sum when its kind returns sums."""

    sent_prompt: bool = False
    unsent_prompt_logprobs: list[dict[int, float] | None] | None = None
    total: OutputAccumulator | None = None  # CUMULATIVE and FINAL_ONLY
