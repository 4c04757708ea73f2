"""One model step as plain data: what the engine asks the executor to run, and what every
rank needs to run it (pickled to tensor-parallel workers with the step's KV delta)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepPlan:
    """The step's tokens flattened in request order, and which rows the engine wants back.

    ``context_lens[b]``: tokens request ``b`` had cached before the step; ``query_lens[b]``:
    tokens it adds. ``sample_rows``: rows of the step's hidden states whose logits are wanted
    (a request whose scheduled tokens reach its end). ``prompt_spans``: ``(row, count)`` runs
    of hidden states returned as they are (prompt logprobs are scored from them).
    """

    request_ids: list[str]
    context_lens: list[int]
    query_lens: list[int]
    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    sample_rows: list[int] = field(default_factory=list)  # [N]
    prompt_spans: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def output_rows(self) -> list[int]:
        """The rows whose hidden states the engine reads, sorted: the sample rows and every
        prompt span's (a prefill chunk's other rows are needed only for their K/V)."""
        rows = set(self.sample_rows)
        for row, count in self.prompt_spans:
            rows.update(range(row, row + count))
        return sorted(rows)
