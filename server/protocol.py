"""OpenAI request bodies (plus vLLM's sampling extras), validated by pydantic."""

from __future__ import annotations

import contextlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from vmkv.sampling_params import SamplingParams


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown fields are ignored, as vLLM does


class StreamOptions(_Base):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Base):
    """Fields shared by both endpoints, with vLLM's extras."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    user: str | None = None
    # vLLM extras (OpenAI clients send them through extra_body)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None  # requests with different salts never share cached KV
    # structured outputs (server/structured.py): OpenAI's, vLLM's, and vLLM's older names
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("cache_salt")
    @classmethod
    def _salted(cls, salt: str | None) -> str | None:
        if salt is not None and not salt:  # "" would silently share the unsalted cache
            raise ValueError("cache_salt must be a non-empty string; omit it to share the "
                             "unsalted cache")
        return salt

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        **extra: Any) -> SamplingParams:
        """The engine's parameters (``extra``: more SamplingParams fields); raises ValueError
        naming the bad field."""
        kw: dict[str, Any] = dict(extra,
            n=self.n, max_tokens=max_tokens, stop=self.stop, seed=self.seed,
            min_tokens=self.min_tokens, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
        )
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k",
                     "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        return SamplingParams(**kw)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM's extra; echo + logprobs implies it
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of must equal n (vmkv returns every sample)")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list of strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatMessage(_Base):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call
    name: str | None = None

    def as_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):  # OpenAI content parts: only text parts are supported
            texts = []
            for part in content:
                if part.get("type") != "text":
                    raise ValueError(f"unsupported content part type {part.get('type')!r}")
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        message = {"role": "system" if self.role == "developer" else self.role,
                   "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [template_tool_call(c) for c in self.tool_calls]
        for name in ("tool_call_id", "name"):
            if getattr(self, name) is not None:
                message[name] = getattr(self, name)
        return message


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else (
            self.max_tokens)


def template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call as chat templates expect it: the arguments as an object (as vLLM
    passes them; templates render them with ``tojson``)."""
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        with contextlib.suppress(json.JSONDecodeError):
            fn["arguments"] = json.loads(args)
    return {**call, "function": fn}


class TokenizeRequest(_Base):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _check(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[int]
