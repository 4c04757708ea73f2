"""``--speculative-config``: vLLM's JSON shape, parsed and checked once (nothing heavy here:
:mod:`vmkv.config` imports it before torch loads).

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
     "prompt_lookup_max": 5}
    {"method": "suffix", "num_speculative_tokens": 8}
    {"method": "draft_model", "model": null, "num_speculative_tokens": 4}

``prompt_lookup_min`` / ``prompt_lookup_max`` default as vLLM's do: both unset is 5 and 5, one
set gives the other its value. ``adaptive`` (vmkv's own; on by default) lets the engine propose
fewer tokens, or none, when the batch is large or a request's guesses keep failing
(docs/speculative.md). Every error is a ValueError naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

#: what ``method`` may name (vLLM's spellings: ``[ngram]`` is ngram)
METHODS = ("ngram", "suffix", "draft_model")
#: vLLM's defaults for prompt lookup when neither bound is given
DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    """A checked speculative-decoding configuration (see the module docstring)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    #: draft_model: the drafting model (None: the engine's own model drafts for itself)
    model: str | None = None
    #: suffix: finished outputs the shared suffix index remembers
    suffix_cache_max_requests: int = 1000
    #: propose less under load or low acceptance (vmkv's own; docs/speculative.md)
    adaptive: bool = True
    #: adaptive: no proposals when this many sequences or more decode in one step
    adaptive_max_batch: int = 32


def parse_speculative_config(value: str | dict[str, Any] | SpeculativeConfig | None
                             ) -> SpeculativeConfig | None:
    """``value`` (JSON text, a dict, a config, or None: off) as a checked config."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"speculative_config.{unknown[0]} is not a field; the fields are "
                         f"{', '.join(sorted(known))}")
    values = dict(value)
    method = values.get("method")
    if method == "[ngram]":
        method = "ngram"
    if method is None and values.get("model") is not None:
        method = "draft_model"
    if method not in METHODS:
        raise ValueError(f"speculative_config.method must be one of {METHODS}, got {method!r}")
    values["method"] = method
    if "num_speculative_tokens" not in values:
        raise ValueError("speculative_config.num_speculative_tokens must be set")
    lo, hi = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
    if lo is None and hi is None:
        lo = hi = DEFAULT_PROMPT_LOOKUP
    values["prompt_lookup_min"] = hi if lo is None else lo
    values["prompt_lookup_max"] = lo if hi is None else hi
    for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                 "suffix_cache_max_requests", "adaptive_max_batch"):
        if name in values or name.startswith("prompt"):
            _check_positive(name, values[name])
    if values["prompt_lookup_min"] > values["prompt_lookup_max"]:
        raise ValueError(
            f"speculative_config.prompt_lookup_min ({values['prompt_lookup_min']}) must not "
            f"exceed prompt_lookup_max ({values['prompt_lookup_max']})")
    if not isinstance(values.get("adaptive", True), bool):
        raise ValueError(f"speculative_config.adaptive must be true or false, got "
                         f"{values['adaptive']!r}")
    model = values.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError(f"speculative_config.model must be a path or null, got {model!r}")
    return SpeculativeConfig(**values)


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}")
