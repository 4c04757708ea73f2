"""Per-request sampling parameters, with vLLM's names, defaults and meaning.

A ``SamplingParams`` is validated once in ``__post_init__`` and never changed afterwards (it is
frozen); the engine derives run-time values, such as the ``max_tokens`` that ``None`` resolves
to, without writing them back.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

from vmkv.structured.params import StructuredOutputsParams

MAX_LOGPROBS = 20  # default --max-logprobs: most top logprobs a request may ask for (OpenAI's cap)
#: a logit_bias in OpenAI's range; -100 bans the token (vmkv makes it exact: the logit is -inf)
MAX_LOGIT_BIAS = 100.0
GREEDY_EPS = 1e-5  # temperatures below this are greedy, as in vLLM (dividing by them overflows)
#: the highest temperature accepted: already at 100 sampling is uniform to within float noise for
#: any realistic logit range, so a larger value (1e9) is a mistake, refused rather than obeyed
MAX_TEMPERATURE = 100.0
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


class RequestOutputKind(enum.Enum):
    """What the engine returns for a request after each step (vLLM's names and meaning).

    CUMULATIVE: the whole output so far, every step (costs O(output) per step: for callers
        that step :class:`~vmkv.engine.llm_engine.LLMEngine` themselves and read the texts).
    DELTA: only what is new since the request's previous output (the server streams these).
    FINAL_ONLY: nothing until the request finishes, then the whole output (``LLM.generate``).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the output tokens of one request.

    Attributes:
        n: number of output sequences for the prompt (>= 1).
        temperature: divides the logits, in [0, 100]; 0 (anything below 1e-5) is greedy, and
            then top_p, top_k and min_p are ignored.
        top_p: keep the most likely tokens whose mass reaches top_p, in (0, 1]; 1 is off.
        top_k: keep the top_k most likely tokens; 0 or -1 is off, and so is any value of at
            least the vocabulary size (it keeps every token).
        min_p: drop tokens less likely than min_p times the most likely one, in [0, 1]; 0 is off.
        seed: seeds a per-request generator, so the request samples the same tokens whatever
            else is in its batch; None draws from the engine's shared generator.
        max_tokens: most output tokens (>= 1, or 0 to only score the prompt, which needs
            ``prompt_logprobs``); None means up to max_model_len, resolved by the engine.
        min_tokens: EOS and stop_token_ids cannot be sampled before this many output tokens
            (0 <= min_tokens <= max_tokens).
        stop: strings that end generation when they appear in the detokenized output; a str
            or a list of non-empty str, normalised to a tuple (None -> ()).
        stop_token_ids: token ids that end generation (besides EOS), normalised to a tuple of
            non-negative ints (None -> ()).
        ignore_eos: keep generating after EOS (it may still be sampled).
        logprobs: None for no logprobs; k >= 0 returns the sampled token's logprob and the top
            k (token, logprob) pairs; the engine caps k at its ``max_logprobs`` (20 by default).
        presence_penalty: subtracted once from every token already in the output, in [-2, 2].
        frequency_penalty: subtracted per occurrence in the output, in [-2, 2].
        repetition_penalty: > 0; tokens in the prompt or output have positive logits divided
            and negative logits multiplied by it; 1 is off.
        include_stop_str_in_output: keep the matched stop string in the returned text.
        skip_special_tokens: drop special tokens when detokenizing.
        prompt_logprobs: None for none; k >= 0 returns, for every prompt token after the first,
            its logprob given the tokens before it and the top k (token, logprob) pairs (capped
            as ``logprobs``; the first prompt token has no logprob: None).
        structured_outputs: constrain the output to a JSON schema, regex, choice or grammar
            (:class:`~vmkv.structured.StructuredOutputsParams`, or a dict of its fields).
        structured_outputs_after: a token id; the structured output constraint applies only
            after the output's first such token (the end of a reasoning section: ``</think>``,
            as vLLM applies grammars once the reasoning ends); None: from the first token.
        output_kind: what each step returns (:class:`RequestOutputKind`); ``LLM.generate``
            asks for FINAL_ONLY and the server for DELTA whatever is set here.
        logit_bias: ``{token_id: bias}`` added to the logits before sampling (OpenAI's
            meaning), each bias in [-100, 100]; -100 bans the token outright.
        allowed_token_ids: only these token ids may be sampled (None: all).
        bad_words: words that must not be generated: each word's tokens (with and without a
            leading space) may not be completed in the output (vLLM's meaning).
        truncate_prompt_tokens: keep only the last k prompt tokens (k >= 1); -1 keeps the last
            ``max_model_len``. The engine truncates at admission.

    A sequence that ends on EOS or on one of ``stop_token_ids`` does not return that token's
    text unless ``include_stop_str_in_output`` is set (its id is in ``token_ids`` either way).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | dict | None = None
    structured_outputs_after: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | tuple[int, ...] | None = None
    bad_words: list[str] | tuple[str, ...] | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        self._check_numbers()
        self._check_limits()
        self._check_stops()
        self._check_token_constraints()
        if isinstance(self.structured_outputs, dict):
            self._set("structured_outputs", StructuredOutputsParams.from_dict(
                self.structured_outputs))
        elif not isinstance(self.structured_outputs, StructuredOutputsParams | None):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, a dict or "
                             f"None, got {self.structured_outputs!r}")
        after = self.structured_outputs_after
        if after is not None and (isinstance(after, bool) or not isinstance(after, Integral)
                                  or after < 0 or self.structured_outputs is None):
            raise ValueError("structured_outputs_after must be a token id (an int >= 0) and "
                             f"needs structured_outputs, got {after!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def has_token_constraints(self) -> bool:
        """True when ``logit_bias``, ``allowed_token_ids`` or ``bad_words`` shape the logits."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words)

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the argmax; top_p, top_k and min_p are then ignored."""
        return self.temperature < GREEDY_EPS

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # normalisation during validation only

    def _check_numbers(self) -> None:
        temperature = self._real("temperature")
        if not 0 <= temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {temperature}")
        top_p = self._real("top_p")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        top_k = self._int("top_k")
        if top_k < -1:
            raise ValueError(f"top_k must be >= -1 (0 or -1 disables it), got {top_k}")
        min_p = self._real("min_p")
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = self._real(name)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        repetition_penalty = self._real("repetition_penalty")
        if not repetition_penalty > 0 or math.isinf(repetition_penalty):
            raise ValueError(f"repetition_penalty must be > 0 and finite, got {repetition_penalty}")

    def _check_limits(self) -> None:
        n = self._int("n")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if self.seed is not None:
            seed = self._int("seed", "an int or None")
            if not SEED_MIN <= seed <= SEED_MAX:
                raise ValueError(f"seed must be in [-2**63, 2**64 - 1], got {seed}")
        if self.max_tokens is not None:
            max_tokens = self._int("max_tokens", "an int or None")
            if max_tokens < 0 or (max_tokens == 0 and self.prompt_logprobs is None):
                raise ValueError(f"max_tokens must be >= 1 or None (0 only with "
                                 f"prompt_logprobs), got {max_tokens}")
        min_tokens = self._int("min_tokens")
        if min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
        if self.max_tokens is not None and min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                value = self._int(name, "an int or None")
                if value < 0:
                    raise ValueError(f"{name} must be >= 0 or None, got {value}")

    def _check_stops(self) -> None:
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, Iterable):
            stop = tuple(stop)
        else:
            raise ValueError(f"stop must be a str, a list of str or None, got {stop!r}")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r} in stop")
        self._set("stop", stop)

        ids = self.stop_token_ids
        if ids is None:
            ids = ()
        elif isinstance(ids, Iterable) and not isinstance(ids, (str, bytes)):
            ids = tuple(ids)
        else:
            raise ValueError(f"stop_token_ids must be a list of int or None, got {ids!r}")
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, Integral) or i < 0:
                raise ValueError(
                    f"stop_token_ids must be non-negative ints, got {i!r} in stop_token_ids"
                )
        self._set("stop_token_ids", tuple(int(i) for i in ids))

    def _check_token_constraints(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id to bias, got "
                                 f"{self.logit_bias!r}")
            bias = {}
            for token, value in self.logit_bias.items():
                _token_id(token, "logit_bias")
                if (isinstance(value, bool) or not isinstance(value, Real)
                        or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {value!r} "
                                     f"for token {token}")
                bias[int(token)] = float(value)
            self._set("logit_bias", bias)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
                raise ValueError(f"allowed_token_ids must be a list of int, got {ids!r}")
            ids = tuple(_token_id(t, "allowed_token_ids") for t in ids)
            if not ids:
                raise ValueError("allowed_token_ids must not be empty (nothing could be sampled)")
            self._set("allowed_token_ids", ids)
        if self.bad_words is not None:
            words = self.bad_words
            if isinstance(words, str) or not isinstance(words, Iterable):
                raise ValueError(f"bad_words must be a list of str, got {words!r}")
            words = tuple(words)
            if not all(isinstance(w, str) and w.strip() for w in words):
                raise ValueError(f"bad_words must be non-blank strings, got {list(words)!r}")
            self._set("bad_words", words)
        k = self.truncate_prompt_tokens
        if k is not None and (self._int("truncate_prompt_tokens", "an int or None") < 1
                              and k != -1):
            raise ValueError(f"truncate_prompt_tokens must be >= 1, -1 (max_model_len) or None,"
                             f" got {k}")

    def _real(self, name: str) -> float:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, Real):
            raise ValueError(f"{name} must be a number, got {value!r}")
        self._set(name, float(value))
        return float(value)

    def _int(self, name: str, kind: str = "an int") -> int:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, Integral):
            raise ValueError(f"{name} must be {kind}, got {value!r}")
        self._set(name, int(value))
        return int(value)


def _token_id(token: Any, name: str) -> int:
    """``token`` as a token id (an int >= 0); ValueError naming ``name`` otherwise."""
    if isinstance(token, bool) or not isinstance(token, Integral) or token < 0:
        raise ValueError(f"{name} must hold token ids (ints >= 0), got {token!r}")
    return int(token)
