"""What every endpoint handler shares: :class:`ServingSession`, the path of a request from its
body to engine streams (server/streams.py merges them back).

A body is parsed off the event loop when large (server/workers.py), checked against the served
model names and ``n``, tokenised (a chat rendered with its template), truncated and checked
against the context, and submitted as one engine request per prompt, all or none. The handlers
(server/completions.py, chat.py, responses_api.py, tokenization.py) build their bodies and
events over it; none of them imports another.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from fastapi import Request
from jinja2 import TemplateError

from vmkv.chat_template import NoChatTemplateError, load_chat_template
from vmkv.config import ServerConfig
from vmkv.engine.front import ServingEngine, Stream
from vmkv.engine.outputs import RequestOutput
from vmkv.sampling_params import RequestOutputKind, SamplingParams
from vmkv.server import responses as R
from vmkv.server.errors import RETRY_AFTER, APIError
from vmkv.server.generation_config import generation_defaults
from vmkv.server.http_options import request_id_header
from vmkv.server.metrics import Metrics
from vmkv.server.protocol import StreamOptions
from vmkv.server.reasoning import reasoning_parser
from vmkv.server.request_log import log_request, warn_ignored
from vmkv.server.shutdown import Lifecycle
from vmkv.server.streams import StreamMerger
from vmkv.server.tool_parsers import check_parser_name, load_plugin
from vmkv.server.workers import Workers

M = TypeVar("M")


class ServingSession:
    """The request machinery of one server, shared by its handlers.

    Attributes:
        engine, config, metrics, workers, lifecycle: the server's parts.
        front: the engine's front (tokenizer, limits, grammar compiler).
        tokenizer: the front's tokenizer; ``token_text`` its cached id -> text.
        model_name: the name responses report (the first served name).
        chat_template: ``--chat-template`` read (None: the tokenizer's).
        reasoning_parser: ``--reasoning-parser``'s (server/reasoning/), or None.
        defaults: sampling defaults of requests that leave them unset (``--generation-config``).

    Every method raises :class:`~vmkv.server.errors.APIError` for what the client must fix.
    """

    def __init__(self, engine: ServingEngine, config: ServerConfig, metrics: Metrics,
                 workers: Workers, lifecycle: Lifecycle) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.workers = workers
        self.lifecycle = lifecycle
        self.front = engine.front
        self.tokenizer = self.front.tokenizer
        self.token_text = R.TokenText(self.tokenizer)
        self.model_name = config.served_model_name[0]
        self.chat_template = load_chat_template(config.chat_template)
        if config.tool_parser_plugin is not None:  # registers parsers, before the name check
            load_plugin(config.tool_parser_plugin)
        check_parser_name(config.tool_call_parser)
        self.reasoning_parser = reasoning_parser(config.reasoning_parser, self.tokenizer)
        self.defaults = generation_defaults(config.generation_config,
                                            _model_dir(self.front.config.model))
        self._merger = StreamMerger(engine, metrics, config.request_timeout)

    # -- the body -----------------------------------------------------------------------------
    async def parse(self, raw: Request, model: type[M]) -> M:
        """The body as ``model``, after vmkv/server/limits.py's checks (off the loop when
        large, vmkv/server/workers.py); the fields it ignores are logged."""
        body = await self.workers.parse(await raw.body(), model)
        warn_ignored(body, raw.url.path)
        if (self.config.enable_force_include_usage and getattr(body, "stream", False)
                and "stream_options" in type(body).model_fields):  # --enable-force-include-usage
            options = body.stream_options or StreamOptions()
            body.stream_options = options.model_copy(update={"include_usage": True})
        return body

    def check_model(self, name: str | None) -> None:
        """404 unless ``name`` is None or one of the served names."""
        if name is not None and name not in self.config.served_model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "model")

    def check_n(self, n: int) -> None:
        """400 unless ``1 <= n <= max_n``."""
        if not 1 <= n <= self.config.max_n:
            raise APIError(400, f"n must be in 1..{self.config.max_n}, got {n}", "n")

    def response_id(self, prefix: str, raw: Request, body: Any) -> str:
        """``<prefix><id>``: the request's X-Request-Id, else its ``request_id``, else new."""
        header = request_id_header(raw.scope)
        base = header.decode("latin-1") if header else (
            getattr(body, "request_id", None) or uuid.uuid4().hex)
        return f"{prefix}{base}"

    # -- the prompt ---------------------------------------------------------------------------
    async def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """``prompt``'s token ids, tokenised on a worker thread."""
        return await self.workers.encode(prompt, add_special_tokens)

    def prompt_ids(self, ids: list[int], body: Any, param: str = "prompt",
                   leave_room: bool = True) -> list[int]:
        """``ids`` truncated as the request asks (``truncate_prompt_tokens``,
        ``truncation_side``), then checked against the context length (``leave_room``: with
        room for one output token)."""
        keep = getattr(body, "truncate_prompt_tokens", None)
        if keep is not None:
            keep = self.front.max_model_len if keep == -1 else keep
            if keep < 1:
                raise APIError(400, "truncate_prompt_tokens must be >= 1 or -1, got "
                               f"{body.truncate_prompt_tokens}", "truncate_prompt_tokens")
            ids = ids[:keep] if body.truncation_side == "right" else ids[-keep:]
        self.workers.limits.check_prompt_tokens(len(ids), param, leave_room)
        return ids

    def template_kwargs(self, body: Any) -> dict[str, Any]:
        """The template variables of a chat request: its own (``chat_template_kwargs``,
        ``reasoning_effort``) over ``--default-chat-template-kwargs``, as :meth:`chat_ids`
        renders them."""
        return {**(self.config.default_chat_template_kwargs or {}),
                **(body.template_options()["template_kwargs"] or {})}

    async def chat_ids(self, body: Any, tools: list[dict] | None = None,
                       messages: list[dict] | None = None, leave_room: bool = True
                       ) -> list[int]:
        """The prompt of a chat request (``messages``: instead of the body's), rendered with
        the request's template options (over ``--default-chat-template-kwargs``) and the
        server's ``--chat-template``, truncated as the request asks."""
        options = body.template_options()
        if self.config.default_chat_template_kwargs:
            options["template_kwargs"] = {**self.config.default_chat_template_kwargs,
                                          **(options["template_kwargs"] or {})}
        if options["chat_template"] is not None and not self.config.trust_request_chat_template:
            raise APIError(400, "a request's chat_template is refused unless the server runs "
                           "with --trust-request-chat-template", "chat_template")
        options["chat_template"] = options["chat_template"] or self.chat_template
        if messages is None:
            messages = [m.as_dict() for m in body.messages]
        try:
            ids = await self.workers.encode_chat(messages, body.add_generation_prompt, tools,
                                                 **options)
        except NoChatTemplateError as exc:
            raise APIError(400, f"{exc}: start the server with --chat-template (a file or the "
                           "template itself), or use /v1/completions", "messages") from None
        except ValueError as exc:  # reserved chat_template_kwargs, conflicting options
            raise APIError(400, str(exc), "chat_template_kwargs" if "chat_template_kwargs"
                           in str(exc) else "continue_final_message") from None
        except TemplateError as exc:  # the template refuses the conversation (raise_exception)
            raise APIError(400, f"the chat template refused the messages: {exc}",
                           "messages") from None
        return self.prompt_ids(ids, body, "messages", leave_room)

    # -- the engine ---------------------------------------------------------------------------
    async def submit(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                     cache_salt: str | None, body: Any = None,
                     route: str = "") -> list[Stream]:
        """Queue one engine request per prompt, all or none (logged with
        ``--enable-log-requests``); their streams yield deltas."""
        if self.lifecycle.aborting:  # past the shutdown deadline: nothing new starts
            raise APIError(503, "the server is shutting down", headers=RETRY_AFTER)
        if self.config.enable_log_requests:
            log_request(request_id, route, body, params, sum(map(len, prompts)),
                        self.config.max_log_len)
        params = replace(params, output_kind=RequestOutputKind.DELTA)
        streams: list[Stream] = []
        # the engine's ids are unique even when clients reuse an X-Request-Id (vLLM's too)
        unique = secrets.token_hex(4)
        try:
            for i, ids in enumerate(prompts):
                streams.append(await self.engine.add(
                    f"{request_id}-{i}-{unique}", ids, params, cache_salt,
                    max_waiting=self.config.max_waiting_requests or None))
        except ValueError as exc:
            for s in streams:
                s.abort()
            raise _as_sent(exc, body) from None
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams

    def merged(self, streams: list[Stream], started: float
               ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The streams' deltas as they come (:meth:`StreamMerger.merged`)."""
        return self._merger.merged(streams, started)

    async def collect(self, raw: Request, streams: list[Stream], started: float
                      ) -> list[RequestOutput]:
        """The streams' final outputs (:meth:`StreamMerger.collect`)."""
        return await self._merger.collect(raw, streams, started)


def _as_sent(exc: ValueError, body: Any) -> ValueError | APIError:
    """The engine's refusal named after the field the client sent: a chat or Responses
    request asks for logprobs with ``top_logprobs``."""
    message = str(exc)
    if message.startswith("logprobs ") and getattr(body, "top_logprobs", None) is not None:
        return APIError(400, "top_" + message, "top_logprobs")
    return exc


def _model_dir(model: str | None) -> Path | None:
    """The folder of the served model (None for a single-file model)."""
    from vmkv.models import resolve_model

    path = resolve_model(model, progress=False)
    return path if path.is_dir() else None
