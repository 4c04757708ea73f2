"""Speculative decoding's counters under vLLM's names (``vllm:spec_decode_num_drafts``,
``_num_draft_tokens``, ``_num_accepted_tokens``, ``_num_accepted_tokens_per_pos``): monotonic
since start-up, exported by the server's /metrics and the bench JSON."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeCounters:
    """``num_drafts``: verify steps of one sequence that had proposals; ``num_draft_tokens``:
    tokens proposed; ``num_accepted_tokens``: proposals accepted (the bonus token is not one);
    ``accepted_per_pos[i]``: proposals accepted at position ``i`` of a draft."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.num_speculative_tokens

    def count(self, num_drafted: int, num_accepted: int) -> None:
        """One sequence's verify step: ``num_drafted`` proposals, the first ``num_accepted``
        of them taken."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed (0 before any proposal)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens one verify step emits on average: accepted proposals + the bonus token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def copy(self) -> SpecDecodeCounters:
        """A snapshot (:meth:`since` subtracts it later)."""
        return SpecDecodeCounters(self.num_speculative_tokens, self.num_drafts,
                                  self.num_draft_tokens, self.num_accepted_tokens,
                                  list(self.accepted_per_pos))

    def since(self, before: SpecDecodeCounters) -> SpecDecodeCounters:
        """What was counted after ``before`` (a :meth:`copy`)."""
        return SpecDecodeCounters(
            self.num_speculative_tokens, self.num_drafts - before.num_drafts,
            self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted_tokens - before.num_accepted_tokens,
            [a - b for a, b in zip(self.accepted_per_pos, before.accepted_per_pos,
                                   strict=True)])

    def as_dict(self) -> dict[str, object]:
        """vLLM's names (without ``vllm:``) and the derived rates, for JSON."""
        return {"spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
                "acceptance_rate": round(self.acceptance_rate, 4),
                "mean_accepted_length": round(self.mean_accepted_length, 4)}
