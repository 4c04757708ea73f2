"""Requests in, validated engine requests out: the engine's input side.

    (request id, prompt text or token ids, SamplingParams, cache_salt)
        │ tokenise (text) or check the ids against the vocabulary; cut to truncate_prompt_tokens
        │ logprobs within max_logprobs, token-id parameters within the vocabulary
        │ max_tokens resolved against max_model_len; n, KV capacity, cache_salt
        │ the grammar's state (structured outputs), bad_words tokenised
        ▼
    EngineRequest (frozen): what :meth:`LLMEngine.add` queues as it is

Every refusal is a ValueError whose message names the field, raised before anything is queued.
The engine's own state (a closed engine, a request id in use) is the engine's to check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vmkv.sampling.token_constraints import bad_words_token_ids
from vmkv.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vmkv.models.config import ModelConfig
    from vmkv.structured.compiler import GrammarCompilerCache
    from vmkv.structured.matcher import GrammarState


def stop_token_ids(model_config: ModelConfig, tokenizer: Any) -> tuple[int, ...]:
    """The tokens that end a sequence: the model's EOS ids, then the tokenizer's, once each."""
    eos = list(model_config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(eos))


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """The last ``keep`` prompt tokens (``SamplingParams.truncate_prompt_tokens``; -1: the last
    ``max_model_len``; None: all)."""
    if keep is None:
        return ids
    keep = max_model_len if keep == -1 else keep
    return ids[-keep:] if len(ids) > keep else ids


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A request that passed every check, ready to queue.

    Attributes:
        request_id: the caller's id.
        prompt: the prompt's text, or None when it came as token ids.
        prompt_token_ids: the prompt, tokenised and truncated.
        params: the sampling parameters as given.
        max_tokens: ``params.max_tokens`` resolved against ``max_model_len``.
        grammar: the structured-output state (its grammar compiled), or None.
        bad_words_token_ids: ``params.bad_words``, tokenised.
        cache_salt: requests with different salts never share prefix-cached KV.
        arrival_time: when it arrived (``time.monotonic()``), or None: when it is queued.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    grammar: GrammarState | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    cache_salt: str | None = None
    arrival_time: float | None = None


class InputProcessor:
    """Checks requests against one engine's model, limits and KV capacity (see the module).

    ``grammars`` compiles (and caches) the grammars of structured outputs; the server's early
    check of a constraint goes through the same cache (``EngineFront.grammars``).
    """

    def __init__(self, tokenizer: Any, *, vocab_size: int, max_model_len: int,
                 max_num_seqs: int, max_logprobs: int, capacity_tokens: int,
                 grammars: GrammarCompilerCache) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_logprobs = max_logprobs
        self.capacity_tokens = capacity_tokens
        self.grammars = grammars

    def process(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                cache_salt: str | None = None, arrival_time: float | None = None
                ) -> EngineRequest:
        """The request, checked and resolved; ValueError for bad input."""
        text, ids = self._tokenize(prompt)
        ids = truncate_prompt(ids, params.truncate_prompt_tokens, self.max_model_len)
        self._check_token_params(params)
        max_tokens = self._resolve_max_tokens(len(ids), params)
        if params.n > self.max_num_seqs:
            raise ValueError(f"n ({params.n}) exceeds max_num_seqs ({self.max_num_seqs})")
        if len(ids) > self.capacity_tokens:
            raise ValueError(f"the prompt ({len(ids)} tokens) can never fit in the KV cache "
                             f"({self.capacity_tokens} tokens)")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string (or None to share the "
                             f"unsalted cache), got {cache_salt!r}")
        if max_tokens == 0 and params.n != 1:
            raise ValueError(f"max_tokens=0 (score the prompt only) needs n=1, got n={params.n}")
        grammar = None
        if params.structured_outputs is not None:  # ValueError for a grammar xgrammar refuses
            grammar = self.grammars.new_state(params.structured_outputs,
                                              params.structured_outputs_after)
        return EngineRequest(request_id, text, ids, params, max_tokens, grammar,
                             bad_words_token_ids(self.tokenizer, params.bad_words or ()),
                             cache_salt, arrival_time)

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt).input_ids
            text: str | None = prompt
        else:
            ids, text = list(prompt), None
            vocab = self.vocab_size
            bad = [t for t in ids
                   if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be ints in [0, {vocab}), got {bad[:5]}")
        if not ids:
            raise ValueError("the prompt is empty")
        return text, ids

    def _check_token_params(self, params: SamplingParams) -> None:
        """ValueError for logprobs past ``max_logprobs`` or token ids past the vocabulary."""
        vocab = self.vocab_size
        most = vocab if self.max_logprobs == -1 else self.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > most:
                raise ValueError(f"{name} must be at most {most} (max_logprobs), got {value}")
        for name, ids in (("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"{name} must hold token ids in [0, {vocab}), got {bad[:5]}")

    def _resolve_max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ValueError(f"this model's maximum context length is {self.max_model_len} "
                             f"tokens; the prompt has {prompt_len}, leaving no room for output")
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{prompt_len + params.max_tokens} were requested ({prompt_len} in the prompt, "
                f"{params.max_tokens} in max_tokens)")
        return params.max_tokens
