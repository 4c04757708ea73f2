"""Response bodies and stream chunks in OpenAI's shapes, from the engine's outputs."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from vmkv.engine.async_engine import EngineDeadError
from vmkv.server.errors import APIError, error_body

logger = logging.getLogger("vmkv.server")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: {json}\\n\\n`` (or the literal ``[DONE]``)."""
    body = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {body}\n\n"


async def ending_with_errors(events: AsyncIterator[str | bytes]
                            ) -> AsyncIterator[str | bytes]:
    """``events``, but a failure after the stream began (the status line is sent) ends it with
    an error event and ``[DONE]`` (vLLM's convention) instead of a cut connection."""
    try:
        async with contextlib.aclosing(events):  # closed at once when the client leaves
            async for event in events:
                yield event
    except APIError as exc:
        yield sse(error_body(exc.status, exc.message, exc.param))
        yield sse("[DONE]")
    except EngineDeadError as exc:
        yield sse(error_body(503, str(exc)))
        yield sse("[DONE]")
    except Exception as exc:  # noqa: BLE001 - the client must see an end, not a hang
        logger.exception("stream failed")
        yield sse(error_body(500, f"internal error: {type(exc).__name__}"))
        yield sse("[DONE]")


def envelope(request_id: str, obj: str, model: str, created: int | None = None
             ) -> dict[str, Any]:
    return {"id": request_id, "object": obj, "created": created or int(time.time()),
            "model": model}


class TokenText:
    """Token id -> text, cached (decoding single tokens is hot in logprobs responses)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._cache[token_id] = text
        return text


def _top(entry: dict[int, float], num_top: int) -> list[tuple[int, float]]:
    """The ``num_top`` most likely tokens of an entry (the sampled token plus the top k)."""
    return sorted(entry.items(), key=lambda x: -x[1])[:num_top]


def completion_logprobs(token_text: TokenText, token_ids: list[int],
                        logprobs: list[dict[int, float]], text_offset: int, num_top: int,
                        lazy: bool = False) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object; ``lazy``: ``top_logprobs`` is an iterator,
    made as it is serialised (server/bodies.py)."""
    tokens, token_lps, offsets = [], [], []
    for tok, entry in zip(token_ids, logprobs, strict=False):
        text = token_text(tok)
        tokens.append(text)
        token_lps.append(entry.get(tok))
        offsets.append(text_offset)
        text_offset += len(text)
    tops = ({token_text(t): lp for t, lp in _top(entry, num_top)} or None
            for entry in logprobs[: len(tokens)])
    return {"tokens": tokens, "token_logprobs": token_lps,
            "top_logprobs": tops if lazy else list(tops), "text_offset": offsets}


def chat_logprobs(token_text: TokenText, token_ids: list[int],
                  logprobs: list[dict[int, float]], num_top: int,
                  lazy: bool = False) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``;
    ``lazy``: ``content`` is an iterator, made as it is serialised (server/bodies.py)."""
    content = (_chat_entry(token_text, tok, entry, num_top)
               for tok, entry in zip(token_ids, logprobs, strict=False))
    return {"content": content if lazy else list(content)}


def _chat_entry(token_text: TokenText, tok: int, entry: dict[int, float], num_top: int
                ) -> dict[str, Any]:
    text = token_text(tok)
    return {"token": text, "logprob": entry.get(tok), "bytes": list(text.encode()),
            "top_logprobs": [{"token": token_text(t), "logprob": lp,
                              "bytes": list(token_text(t).encode())}
                             for t, lp in _top(entry, num_top)]}


def token_id_text(token_id: int) -> str:
    """A token as vLLM's ``return_tokens_as_token_ids`` names it: ``"token_id:<id>"``."""
    return f"token_id:{token_id}"
