"""OpenAI request bodies (plus vLLM's extras), validated by pydantic.

Every field a model declares is honoured, or refused with a 400 naming it when set to a value
vmkv cannot honour (:data:`REFUSED`: beam search, multimodal inputs, ...). Fields no model
declares are ignored, as vLLM ignores them, but never silently: they are kept in
``model_extra`` and the server logs them with a warning (:func:`ignored_fields`). The table of
every field against vLLM's is in docs/server.md.
"""

from __future__ import annotations

import contextlib
import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from vmkv.sampling_params import SamplingParams

#: a token id: a JSON integer (1.0, 1e15 and true are refused, not converted)
TokenId = Annotated[StrictInt, Field(ge=0)]

#: declared fields vmkv cannot honour: (the value that asks for nothing, why it is refused)
REFUSED: dict[str, tuple[Any, str]] = {
    "use_beam_search": (False, "beam search is not supported"),
    "length_penalty": (1.0, "length_penalty applies to beam search, which is not supported"),
    "watermarking": (False, "watermarking is not supported"),
    "spaces_between_special_tokens": (True, "special tokens are always decoded without "
                                      "spaces between them"),
    "logprob_token_ids": (None, "logprobs of chosen token ids are not supported; use "
                          "logprobs / top_logprobs"),
    "priority": (0, "priority scheduling is not supported"),
    "repetition_detection": (None, "repetition detection is not supported"),
    "thinking_token_budget": (None, "thinking budgets are not supported"),
    "mm_processor_kwargs": (None, "multimodal inputs are not supported"),
    "media_io_kwargs": (None, "multimodal inputs are not supported"),
    "prompt_embeds": (None, "prompt embeddings are not supported"),
    "functions": (None, "the legacy functions API is not supported; use tools"),
    "function_call": (None, "the legacy functions API is not supported; use tool_choice"),
    "audio": (None, "audio output is not supported"),
}


#: fields whose explicit ``null`` means their default, as in vLLM (real clients send
#: ``"n": null``); the handlers always see a value
NULL_IS_DEFAULT = ("n", "stream", "logprobs", "echo", "parallel_tool_calls")


class RequestModel(BaseModel):
    """A request body: declared fields honoured or refused (:data:`REFUSED`), others logged;
    a ``null`` in :data:`NULL_IS_DEFAULT` is the field's default."""

    # unknown fields are kept (model_extra) so the server can log what it ignores
    model_config = ConfigDict(extra="allow")

    @field_validator(*NULL_IS_DEFAULT, mode="before", check_fields=False)
    @classmethod
    def _null_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        return cls.model_fields[info.field_name].get_default() if value is None else value

    @field_validator(*REFUSED, check_fields=False)
    @classmethod
    def _refused(cls, value: Any, info: ValidationInfo) -> Any:
        neutral, why = REFUSED[info.field_name]
        if value is not None and value != neutral:
            raise ValueError(f"{why} (vmkv refuses {info.field_name}={json.dumps(value)[:40]} "
                             "rather than ignore it)")
        return value


def ignored_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """The dotted names of every field of ``model`` (and the models it holds) that no model
    declares: the server ignores them and logs them (a chat message's go to the template)."""
    names = [] if isinstance(model, ChatMessage) else [
        f"{prefix}{k}" for k in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, BaseModel):
                index = f".{i}" if isinstance(value, list) else ""
                names += ignored_fields(item, f"{prefix}{name}{index}.")
    return names


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage in every chunk (with include_usage)


class _Sampling(RequestModel):
    """Fields shared by both endpoints, with vLLM's extras."""

    model: str | None = None
    n: int | None = 1  # null: 1 (NULL_IS_DEFAULT)
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # {"token id": bias in [-100, 100]}
    seed: int | None = None
    user: str | None = None  # logged with --enable-log-requests
    # vLLM extras (OpenAI clients send them through extra_body)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[TokenId] | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens (-1: the model's)
    truncation_side: Literal["left", "right"] | None = None  # left (default): keep the end
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool | None = None  # logprob tokens as "token_id:<id>"
    return_token_ids: bool | None = None  # token ids beside the text
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    cache_salt: str | None = None  # requests with different salts never share cached KV
    # structured outputs (server/structured.py): OpenAI's, vLLM's, and vLLM's older names
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # refused unless left at their default (REFUSED)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    watermarking: bool | None = None
    spaces_between_special_tokens: bool = True
    logprob_token_ids: list[int] | None = None
    priority: int = 0
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    @field_validator("cache_salt")
    @classmethod
    def _salted(cls, salt: str | None) -> str | None:
        if salt is not None and not salt:  # "" would silently share the unsalted cache
            raise ValueError("cache_salt must be a non-empty string; omit it to share the "
                             "unsalted cache")
        return salt

    @model_validator(mode="after")
    def _streaming(self) -> _Sampling:
        """vLLM's refusals: stream options without a stream, prompt logprobs with one (they
        would be computed and never sent)."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be given with stream: true")
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs are not available with stream: true")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"logit_bias keys must be token ids (\"123\"), got {key!r}")
        return bias

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: dict[str, Any] | None = None,
                        **extra: Any) -> SamplingParams:
        """The engine's parameters (``extra``: more SamplingParams fields; ``defaults``: the
        server's default sampling, for the fields the request leaves unset); raises
        ValueError naming the bad field."""
        defaults = defaults or {}
        kw: dict[str, Any] = dict(extra,
            n=self.n, max_tokens=max_tokens, stop=self.stop, seed=self.seed,
            min_tokens=self.min_tokens, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words or None,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            logit_bias=None if self.logit_bias is None else {
                int(k): v for k, v in self.logit_bias.items()},
        )
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k",
                     "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if value is None:
                value = defaults.get(name)
            if value is not None:
                kw[name] = value
        return SamplingParams(**kw)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every streamed chunk (vLLM's ``continuous_usage_stats``)."""
        options = self.stream_options
        return bool(options and options.include_usage and options.continuous_usage_stats)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    logprobs: int | None = None
    echo: bool | None = False  # prompt_logprobs: vLLM's extra; echo + logprobs implies it
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True  # the tokenizer's BOS etc. around a text prompt
    prompt_embeds: str | list[str] | None = None

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


class ChatMessage(RequestModel):
    """One message; fields beyond these (``reasoning_content``, ...) reach the chat template
    as they are."""

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
                if part.get("type") not in ("text", "input_text", "output_text"):
                    raise ValueError(f"unsupported content part type {part.get('type')!r}")
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        message = {**(self.model_extra or {}),
                   "role": "system" if self.role == "developer" else self.role,
                   "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [template_tool_call(c) for c in self.tool_calls]
        for name in ("tool_call_id", "name"):
            if getattr(self, name) is not None:
                message[name] = getattr(self, name)
        return message


class _Templated(RequestModel):
    """How a conversation becomes a prompt (chat completions and /tokenize)."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # leave the last message open for the model
    add_special_tokens: bool = False  # the tokenizer's own BOS on top of the template's
    chat_template: str | None = None  # needs --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None  # more template variables
    documents: list[dict[str, Any]] | None = None  # for templates that render documents
    tools: list[dict[str, Any]] | None = None

    def template_options(self) -> dict[str, Any]:
        """What :func:`vmkv.chat_template.render_chat` takes from the request (but tools)."""
        return {"continue_final_message": self.continue_final_message,
                "documents": self.documents, "chat_template": self.chat_template,
                "template_kwargs": self.chat_template_kwargs,
                "add_special_tokens": bool(self.add_special_tokens)}


class ChatCompletionRequest(_Templated, _Sampling):
    """``POST /v1/chat/completions``."""

    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    echo: bool | None = False  # the reply goes on from the last message when it has the role
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    modalities: list[Literal["text"]] | None = None
    include_reasoning: bool = True  # false: no reasoning fields (with --reasoning-parser)
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    def template_options(self) -> dict[str, Any]:
        """As :meth:`_Templated.template_options`; ``reasoning_effort`` reaches the template
        as a variable, with ``enable_thinking`` (false for "none") unless the request sets it,
        as vLLM passes them."""
        options = super().template_options()
        if self.reasoning_effort is not None:
            kwargs = {"reasoning_effort": self.reasoning_effort,
                      "enable_thinking": self.reasoning_effort != "none"}
            options["template_kwargs"] = {**kwargs, **(self.chat_template_kwargs or {})}
        return options

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def reply_role(self, response_role: str) -> str:
        """The role of the reply (vLLM's): ``--response-role`` when a generation prompt is
        added, else the last message's (the reply continues it)."""
        return response_role if self.add_generation_prompt else self.messages[-1].role

    def echoed(self, response_role: str) -> str:
        """What ``echo`` puts before the reply: the last message's text when its role is the
        reply's (vLLM's rule), else nothing."""
        last = self.messages[-1]
        if not self.echo or last.role != self.reply_role(response_role):
            return ""
        return last.as_dict()["content"]

    @property
    def wanted_prompt_logprobs(self) -> int | None:
        """How many top logprobs each prompt token needs: ``prompt_logprobs``, or with
        ``echo`` (not streamed) ``top_logprobs`` (0 unset), as vLLM derives them."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return (self.top_logprobs or 0) if self.echo and not self.stream else None

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


class TokenizeRequest(_Templated):
    """``POST /tokenize``: ``prompt`` (a text) or ``messages`` (a conversation, rendered as
    chat completions render it)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None  # type: ignore[assignment]
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    return_token_strs: bool = False  # also the tokens' text

    @model_validator(mode="after")
    def _check(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]
