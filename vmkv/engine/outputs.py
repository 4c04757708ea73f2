"""What the engine returns: vLLM's ``RequestOutput`` / ``CompletionOutput`` shapes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One output sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None: running
    stop_reason: int | str | None = None  # the stop token id or string that matched
    logprobs: list[dict[int, float]] | None = None  # per token: {token_id: logprob}

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Monotonic timestamps (``time.monotonic()``) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None


@dataclass
class RequestOutput:
    """A request's state after a step: cumulative text and tokens of every output."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = field(default=None)  # set when the request failed (finish "error")
    # with SamplingParams.prompt_logprobs: per prompt token {token_id: logprob}; None first
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
