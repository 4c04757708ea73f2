"""Chat templating, once, for ``LLM.chat`` and the server's chat endpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: ``apply_chat_template``'s own parameters: template variables may not take these names
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class NoChatTemplateError(ValueError):
    """The model's tokenizer has no chat template (and none was given)."""


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], *,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                tools: list[dict[str, Any]] | None = None,
                documents: list[dict[str, Any]] | None = None, chat_template: str | None = None,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text of a conversation under ``chat_template`` (default: the tokenizer's).

    ``continue_final_message``: the last message is left open (no end-of-turn after it), for
    the model to continue; it excludes ``add_generation_prompt``. ``tools`` (OpenAI tool
    definitions), ``documents`` and ``template_kwargs`` (more template variables, e.g.
    ``enable_thinking``) reach the template as variables.

    Raises :class:`NoChatTemplateError` when there is no template, ValueError for
    ``template_kwargs`` that reuse a name of :data:`RESERVED_TEMPLATE_KWARGS`.
    """
    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise NoChatTemplateError("this model's tokenizer has no chat template")
    kwargs = dict(template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {reserved[0]!r} (a parameter of "
                         "the renderer, not a template variable)")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt exclude each "
                         "other: set add_generation_prompt to false to continue the last message")
    return tokenizer.apply_chat_template(
        messages, tools=tools, documents=documents, chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, tokenize=False, **kwargs)


def chat_token_ids(tokenizer: Any, messages: list[dict[str, Any]],
                   add_generation_prompt: bool = True,
                   tools: list[dict[str, Any]] | None = None, *,
                   add_special_tokens: bool = False, **options: Any) -> list[int]:
    """Token ids of a conversation (:func:`render_chat` with ``options``), tokenised as the
    template wrote it: the tokenizer adds no special tokens of its own unless
    ``add_special_tokens`` (the template already writes BOS where the model wants one)."""
    text = render_chat(tokenizer, messages, add_generation_prompt=add_generation_prompt,
                       tools=tools, **options)
    return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)


def load_chat_template(spec: str | None) -> str | None:
    """``--chat-template``: the text of a template file, or the template itself when ``spec``
    is Jinja (it holds ``{{`` or ``{%``); None stays None (the tokenizer's is used). ValueError
    for a path that does not exist."""
    if spec is None:
        return None
    if "{{" in spec or "{%" in spec:
        return spec
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(f"chat_template {spec!r} is neither a file nor a Jinja template")
    return path.read_text()
