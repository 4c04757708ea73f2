"""What the engine returns: vLLM's ``RequestOutput`` / ``CompletionOutput`` shapes, and the
accumulator that merges deltas into whole outputs.

The engine's output processor (vmkv/engine/output_processor.py) makes *deltas*: per step, only
the text, tokens and logprobs a request gained. A request's ``output_kind`` says what reaches
the caller (:class:`~vmkv.sampling_params.RequestOutputKind`): the deltas themselves, or their
sum made by an :class:`OutputAccumulator` (every step, or once at the end). The same
accumulator merges a stream's unread deltas (a slow reader costs one merged delta, not a queue)
and assembles the server's final texts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One output sequence of a request (whole, or what one delta added)."""

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
    """A request's state after a step.

    Whole (``CUMULATIVE``, ``FINAL_ONLY``): every output sequence with its text and tokens so
    far. A delta (``DELTA``): only the sequences that changed, each with what it gained; the
    prompt (``prompt``, ``prompt_token_ids``) comes in a request's first delta only (None
    after), and ``prompt_logprobs`` in pieces as the prompt's chunks are computed.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = field(default=None)  # set when the request failed (finish "error")
    # with SamplingParams.prompt_logprobs: per prompt token {token_id: logprob}; None first
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length (0 on a delta that does not carry the prompt)."""
        return len(self.prompt_token_ids or ())


@dataclass(eq=False, slots=True)
class _Sum:
    """One output sequence's deltas so far: text pieces (joined once, when read)."""

    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta: CompletionOutput) -> None:
        if delta.text:
            self.pieces.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason

    def output(self, index: int, copy: bool) -> CompletionOutput:
        if len(self.pieces) > 1:
            self.pieces[:] = ["".join(self.pieces)]
        token_ids, logprobs = self.token_ids, self.logprobs
        if copy:
            token_ids, logprobs = list(token_ids), None if logprobs is None else list(logprobs)
        return CompletionOutput(index, self.pieces[0] if self.pieces else "", token_ids,
                                self.finish_reason, self.stop_reason, logprobs)


class OutputAccumulator:
    """Deltas of one request added up: :meth:`add` costs what the delta holds, :meth:`output`
    what the sum holds (the texts are joined then).

    Adding every delta of a request from its first gives its whole output; adding a run of
    deltas gives one delta that says all of them (how a stream merges what its reader has not
    taken yet)."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._last: RequestOutput | None = None
        self._prompt: tuple[str | None, list[int] | None] = (None, None)
        self._prompt_logprobs: list[dict[int, float] | None] | None = None
        self._sums: dict[int, _Sum] = {}

    def __bool__(self) -> bool:
        """Whether anything was added."""
        return self._last is not None

    def add(self, delta: RequestOutput) -> None:
        if delta.prompt_token_ids is not None:
            self._prompt = (delta.prompt, delta.prompt_token_ids)
        if delta.prompt_logprobs is not None:
            if self._prompt_logprobs is None:
                self._prompt_logprobs = []
            self._prompt_logprobs.extend(delta.prompt_logprobs)
        for c in delta.outputs:
            self._sums.setdefault(c.index, _Sum()).add(c)
        self._last = delta

    def output(self) -> RequestOutput:
        """The sum so far, as a new object (ValueError when nothing was added)."""
        return self._output(copy=True)

    def take(self) -> RequestOutput:
        """The sum so far, and start again from nothing (ValueError when nothing was added)."""
        out = self._output(copy=False)
        self._reset()
        return out

    def _output(self, copy: bool) -> RequestOutput:
        last = self._last
        if last is None:
            raise ValueError("no output was added")
        prompt_logprobs = self._prompt_logprobs
        if copy and prompt_logprobs is not None:
            prompt_logprobs = list(prompt_logprobs)
        return RequestOutput(
            last.request_id, *self._prompt,
            [self._sums[i].output(i, copy) for i in sorted(self._sums)], last.finished,
            last.metrics, last.num_cached_tokens, last.error, prompt_logprobs)
