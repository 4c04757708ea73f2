"""What the server logs about requests: the fields it ignores (always, as vLLM warns), and
each request with ``--enable-log-requests`` (its id, route, user, sampling parameters and the
first ``--max-log-len`` characters of its prompt)."""

from __future__ import annotations

import json
import logging
from typing import Any

from pydantic import BaseModel

from vmkv.sampling_params import SamplingParams
from vmkv.server.protocol import ignored_fields

logger = logging.getLogger("vmkv.server")


def warn_ignored(body: BaseModel, route: str) -> None:
    """Warn about the fields of ``body`` no model declares (they are ignored)."""
    names = ignored_fields(body)
    if names:
        logger.warning("%s: ignored request fields (vmkv does not know them): %s", route,
                       ", ".join(names))


def log_request(request_id: str, route: str, body: Any, params: SamplingParams,
                num_prompt_tokens: int, max_len: int) -> None:
    """One line per request (``--enable-log-requests``)."""
    prompt = _prompt_of(body, max_len)
    logger.info("request %s %s user=%s prompt_tokens=%d params=%s prompt=%s", request_id, route,
                getattr(body, "user", None), num_prompt_tokens, params,
                prompt[:max_len] + ("..." if len(prompt) > max_len else ""))


def _prompt_of(body: Any, max_len: int) -> str:
    """The request's prompt as JSON text, at least ``max_len`` characters of it (a long
    prompt is not serialised whole)."""
    for name in ("prompt", "messages", "input"):
        value = getattr(body, name, None)
        if isinstance(value, str):
            return json.dumps(value[: max_len + 1], ensure_ascii=False)
        if value is not None:
            parts: list[str] = []
            for item in value:
                item = item.model_dump(exclude_none=True) if isinstance(item, BaseModel) else item
                parts.append(json.dumps(item, ensure_ascii=False)[: max_len + 1])
                if sum(map(len, parts)) > max_len:
                    break
            return "[" + ", ".join(parts)
    return ""
