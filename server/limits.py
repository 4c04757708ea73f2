"""Input limits checked on a request body before any expensive work (pydantic validation,
tokenisation), so a hostile body costs little and a bad one gets a 400 naming the field.

    raw bytes --nesting depth--json.loads(no NaN/Infinity, finite floats)--> object
              --check_body--> pydantic

:func:`loads` refuses JSON nested deeper than :data:`MAX_JSON_DEPTH` before parsing it (a
counting pass in C: a 50,000-deep body would otherwise exhaust the parser's recursion), and
:func:`check_body` runs on the parsed JSON (lists are measured with ``len`` before anything
walks them; the walk for invalid Unicode comes last) and refuses:

- invalid Unicode: lone UTF-16 surrogates (``"\\ud800"``) anywhere in a string, which no
  tokenizer can encode;
- a text prompt longer than ``max_prompt_chars`` characters, and chat messages whose contents
  together are: ``max_model_len`` times the longest token of the vocabulary, so such a prompt
  has more tokens than the model takes with every tokenizer that does not delete characters;
- more than ``max_prompts`` prompts in one completions request, a token-id prompt longer than
  ``max_model_len`` (unless ``truncate_prompt_tokens`` cuts it), more than ``max_batch_tokens``
  token ids in one request;
- a token id that is not an integer in ``[0, vocab_size)``: in ``prompt``, ``tokens``,
  ``stop_token_ids``, ``allowed_token_ids`` and the keys of ``logit_bias`` (``1.0``,
  ``1e15`` and ``true`` included: JSON numbers are not converted);
- more than ``max_model_len`` chat messages (each costs at least one token);
- more than :data:`MAX_STOP` stop strings or stop token ids, a stop string longer than
  :data:`MAX_STOP_CHARS` characters (stop strings are matched at every step, and held back
  while streaming).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

MAX_PROMPTS = 1024  # prompts in one /v1/completions request (one engine request each)
MAX_BATCH_TOKENS = 1 << 17  # token ids in one request body (prompts or /detokenize)
MAX_STOP = 64  # stop strings, and stop token ids
MAX_STOP_CHARS = 1024  # characters of one stop string
MAX_JSON_DEPTH = 64  # nesting of arrays and objects in a body (tool and JSON schemas included)
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


class BodyError(ValueError):
    """A request body refused before validation: ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple:  # crosses from a worker process intact
        return type(self), (str(self), self.param)


@dataclass(frozen=True)
class InputLimits:
    """What one request may ask for; derived from the model at start-up (picklable: worker
    processes get a copy)."""

    max_model_len: int
    vocab_size: int
    max_prompt_chars: int
    max_prompts: int = MAX_PROMPTS
    max_batch_tokens: int = MAX_BATCH_TOKENS

    @classmethod
    def for_model(cls, tokenizer: Any, max_model_len: int, vocab_size: int) -> InputLimits:
        """Limits for a model: ``max_prompt_chars`` is ``max_model_len`` times the longest
        token string in the vocabulary (a byte-level token string has one character per byte,
        so it is never shorter than the text the token decodes to)."""
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
        return cls(max_model_len, vocab_size, max_model_len * max(1, longest),
                   max_batch_tokens=max(MAX_BATCH_TOKENS, max_model_len))

    def check_prompt_tokens(self, num_tokens: int, param: str = "prompt",
                            leave_room: bool = True) -> None:
        """A tokenised prompt that leaves no room for output is refused before it is queued
        (``leave_room`` false: one that does not fit; ``/tokenize`` generates nothing)."""
        if num_tokens > self.max_model_len or (leave_room and num_tokens == self.max_model_len):
            why = ", leaving no room for output" if num_tokens == self.max_model_len else ""
            raise BodyError(f"this model's maximum context length is {self.max_model_len} "
                            f"tokens; the prompt has {num_tokens}{why}", param)


def loads(body: bytes) -> Any:
    """Parse a JSON body; ValueError for malformed JSON, invalid UTF-8, NaN, Infinity, a
    number that overflows to infinity (``1e999``) or nesting past :data:`MAX_JSON_DEPTH`."""
    check_depth(body)
    return json.loads(body, parse_constant=_no_constant, parse_float=_finite)


def check_depth(body: bytes, limit: int = MAX_JSON_DEPTH) -> None:
    """BodyError if ``body``'s arrays and objects nest deeper than ``limit`` (brackets inside
    strings do not count; malformed JSON is left to the parser)."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return  # too few brackets to nest that deep: no need to look
    codes = np.frombuffer(_JSON_STRING.sub(b"", body), dtype=np.uint8)
    steps = np.isin(codes, (0x5B, 0x7B)).astype(np.int32) - np.isin(codes, (0x5D, 0x7D))
    if steps.size and int(np.cumsum(steps).max()) > limit:
        raise BodyError(f"the JSON body nests arrays and objects deeper than {limit} levels "
                        f"(MAX_JSON_DEPTH)")


def _no_constant(name: str) -> float:
    raise BodyError(f"{name} is not a valid JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise BodyError(f"the number {text[:32]} is out of range")
    return value


def check_body(obj: Any, limits: InputLimits) -> None:
    """Refuse what :mod:`this module <vmkv.server.limits>` lists (BodyError naming the field)."""
    if not isinstance(obj, dict):
        _check_unicode(obj, "")
        return  # pydantic says what is wrong with it
    _check_prompt(obj.get("prompt"), limits, obj.get("truncate_prompt_tokens") is not None)
    messages = obj.get("messages")
    if isinstance(messages, list):
        if len(messages) > limits.max_model_len:
            raise BodyError(f"{len(messages)} messages can never fit in {limits.max_model_len} "
                            "tokens", "messages")
        chars = sum(_content_chars(m) for m in messages)
        if chars > limits.max_prompt_chars:
            raise BodyError(f"the messages have {chars} characters, more than the "
                            f"{limits.max_prompt_chars} that can fit in {limits.max_model_len} "
                            "tokens", "messages")
    tokens = obj.get("tokens")
    if isinstance(tokens, list):
        _check_ids(tokens, limits, "tokens", limits.max_batch_tokens)
    for name in ("stop_token_ids", "allowed_token_ids"):
        if isinstance(obj.get(name), list):
            _check_ids(obj[name], limits, name, limits.vocab_size)
    if isinstance(obj.get("logit_bias"), dict):
        _check_ids([int(k) if k.isascii() and k.isdigit() else k for k in obj["logit_bias"]],
                   limits, "logit_bias", limits.vocab_size)
    _check_stops(obj.get("stop"), obj.get("stop_token_ids"))
    _check_unicode(obj, "")  # after the size checks: the walk is bounded by them


def _check_unicode(obj: Any, path: str) -> None:
    if isinstance(obj, str):
        if not obj.isascii():
            try:
                obj.encode("utf-8")
            except UnicodeEncodeError:
                raise BodyError("invalid Unicode: a string holds a lone surrogate "
                                f"(\\u{ord(obj[_surrogate_at(obj)]):04x})", path or None) from None
    elif isinstance(obj, dict):
        for key, value in obj.items():
            _check_unicode(key, path)
            _check_unicode(value, f"{path}.{key}" if path else str(key))
    elif isinstance(obj, list) and obj and not isinstance(obj[0], int):
        for i, value in enumerate(obj):
            _check_unicode(value, f"{path}.{i}")


def _surrogate_at(text: str) -> int:
    return next(i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF)


def _check_prompt(prompt: Any, limits: InputLimits, truncated: bool) -> None:
    """``truncated``: the request cuts its prompt (``truncate_prompt_tokens``), so a prompt may
    be longer than the model takes (the body's size still bounds it)."""
    longest = limits.max_batch_tokens if truncated else limits.max_model_len
    if isinstance(prompt, str):
        if not truncated:
            _check_chars(prompt, limits, "prompt")
        return
    if not isinstance(prompt, list):
        return
    if prompt and _is_number(prompt[0]):  # one prompt of token ids
        _check_ids(prompt, limits, "prompt", longest)
        return
    if len(prompt) > limits.max_prompts:
        raise BodyError(f"{len(prompt)} prompts in one request; at most {limits.max_prompts}",
                        "prompt")
    total = 0
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            if not truncated:
                _check_chars(p, limits, f"prompt.{i}")
        elif isinstance(p, list):
            _check_ids(p, limits, f"prompt.{i}", longest)
            total += len(p)
            if total > limits.max_batch_tokens:
                raise BodyError(f"more than {limits.max_batch_tokens} prompt token ids in one "
                                "request", "prompt")


def _check_chars(text: str, limits: InputLimits, param: str) -> None:
    if len(text) > limits.max_prompt_chars:
        raise BodyError(f"the prompt has {len(text)} characters, more than the "
                        f"{limits.max_prompt_chars} that can fit in {limits.max_model_len} tokens",
                        param)


def _check_ids(ids: list, limits: InputLimits, param: str, most: int) -> None:
    if len(ids) > most:
        raise BodyError(f"{len(ids)} token ids; at most {most} (max_model_len is "
                        f"{limits.max_model_len})", param)
    vocab = limits.vocab_size
    for t in ids:
        if type(t) is not int or not 0 <= t < vocab:
            raise BodyError(f"token ids must be integers in [0, {vocab}), got "
                            f"{json.dumps(t)[:32]}", param)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float)  # bool included: true is no token id either


def _content_chars(message: Any) -> int:
    if not isinstance(message, dict):
        return 0
    content = message.get("content")
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p.get("text", "")) for p in content
                   if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def _check_stops(stop: Any, stop_token_ids: Any) -> None:
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    if len(stops) > MAX_STOP:
        raise BodyError(f"{len(stops)} stop strings; at most {MAX_STOP}", "stop")
    if any(isinstance(s, str) and len(s) > MAX_STOP_CHARS for s in stops):
        raise BodyError(f"a stop string is longer than {MAX_STOP_CHARS} characters", "stop")
    if isinstance(stop_token_ids, list) and len(stop_token_ids) > MAX_STOP:
        raise BodyError(f"{len(stop_token_ids)} stop token ids; at most {MAX_STOP}",
                        "stop_token_ids")
