"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's): a prompt or a chat rendered as chat
completions render it, to token ids; token ids back to text. Both on the worker threads."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from vmkv.server.protocol import DetokenizeRequest, TokenizeRequest
from vmkv.server.session import ServingSession


class TokenizeHandler:
    """Serves ``/tokenize`` (``{"tokens", "count", "max_model_len"}``, + ``token_strs`` when
    asked) and ``/detokenize`` (``{"prompt"}``: the tokens' text, special tokens included)
    over a :class:`ServingSession`. The methods are the routes (no docstrings: they would
    become OpenAPI descriptions)."""

    def __init__(self, session: ServingSession) -> None:
        self.session = session

    async def tokenize(self, raw: Request) -> dict:
        s = self.session
        body = await s.parse(raw, TokenizeRequest)
        s.check_model(body.model)
        if body.messages is not None:
            ids = await s.chat_ids(body, body.tools, leave_room=False)  # max_model_len fits
        else:
            ids = await s.encode(body.prompt, body.add_special_tokens is not False)
        result: dict[str, Any] = {"tokens": ids, "count": len(ids),
                                  "max_model_len": s.front.max_model_len}
        if body.return_token_strs:
            result["token_strs"] = s.tokenizer.convert_ids_to_tokens(ids)
        return result

    async def detokenize(self, raw: Request) -> dict:
        s = self.session
        body = await s.parse(raw, DetokenizeRequest)
        s.check_model(body.model)
        return {"prompt": await s.workers.decode(body.tokens)}
