"""Chat templating, once, for ``LLM.chat`` and the server's chat endpoints."""

from __future__ import annotations

from typing import Any


class NoChatTemplateError(ValueError):
    """The model's tokenizer has no chat template."""


def chat_token_ids(tokenizer: Any, messages: list[dict[str, Any]],
                   add_generation_prompt: bool = True,
                   tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of a conversation under ``tokenizer``'s chat template (``tools``: OpenAI
    tool definitions, rendered by templates that support them).

    Raises :class:`NoChatTemplateError` when the tokenizer has none.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplateError("this model's tokenizer has no chat template")
    ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True,
                                        add_generation_prompt=add_generation_prompt)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding (a dict)
        ids = ids["input_ids"]
    return list(ids)
