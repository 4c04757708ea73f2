"""Requests and their sequences: the unit the scheduler moves between queues.

A user request (``Request``) with ``n`` samples owns ``n`` sequences. Sequence 0 is created at
admission; the other ``n - 1`` are forked from it once its prompt is prefilled and share the
prompt's KV copy-on-write. Every sequence has its own KV id (``seq_id``) and is scheduled on its
own:

    seq:  | prompt tokens | output tokens |          token_ids
          | < num_computed_tokens > |                 K/V cached
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vmkv.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vmkv.engine.output_state import RequestOutputState, SeqOutputState
    from vmkv.kv.base import SwappedKV
    from vmkv.sampling import SamplingState


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One user request: prompt, parameters, its sequences and timing."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens resolved against max_model_len
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    cache_salt: str | None = None  # requests with different salts never share cached KV
    error: str | None = None  # why the request failed (its KV memory was refused), if it did
    # with params.prompt_logprobs: prompt tokens scored so far (the first counts: it has none)
    num_prompt_logprobs: int | None = None
    output: RequestOutputState | None = None  # set by the output processor at admission
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # params.bad_words, tokenised

    @property
    def is_finished(self) -> bool:
        """Every sequence finished and no sample is still to be forked."""
        return all(s.is_finished for s in self.seqs) and not self.seqs[0].pending_forks


@dataclass(eq=False)
class Sequence:
    """One output sequence of a request, with its KV id and sampling state."""

    seq_id: str
    request: Request
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_state: SamplingState
    num_computed_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    pending_forks: int = 0  # children to fork once the prompt is prefilled
    swapped: SwappedKV | None = None  # while preempted in swap mode
    output: SeqOutputState | None = None  # what is not emitted yet (the output processor's)
    #: proposals scheduled after the last token this step (speculative decoding), until the
    #: step's verification (vmkv/spec_decode/verifier.py) takes or rejects them
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def prompt_logprobs_from(self) -> int:
        """First prompt position whose logprob target is still missing (the request's
        ``num_prompt_tokens`` when it wants none or has them all)."""
        recorded = self.request.num_prompt_logprobs
        return self.num_prompt_tokens if recorded is None else recorded - 1

    @property
    def num_new_tokens(self) -> int:
        """Tokens not yet in the KV cache (the prompt, or the last sampled token)."""
        return self.num_tokens - self.num_computed_tokens
