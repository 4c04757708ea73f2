"""Prompt logprobs in ``/v1/completions``: ``echo: true`` with ``logprobs: k`` returns the prompt's
tokens with their logprobs (the first ``null``) before the completion's, as OpenAI's legacy API
did and lm-evaluation-harness reads for every log-likelihood task (``max_tokens`` 0 or 1)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from vmkv.engine.outputs import RequestOutput
from vmkv.server import responses as R


def prompt_logprobs_wanted(body: Any, max_tokens: int) -> int | None:
    """How many top logprobs each prompt token needs (None: none): vLLM's ``prompt_logprobs``,
    or ``logprobs`` when the prompt is echoed; an echo-only ``max_tokens: 0`` scores with k=0."""
    if body.prompt_logprobs is not None:
        return body.prompt_logprobs
    if body.echo and body.logprobs is not None:
        return body.logprobs
    if body.echo and max_tokens == 0:
        return 0
    return None


def vllm_prompt_logprobs(token_text: R.TokenText, out: RequestOutput
                         ) -> Iterator[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` (asked for with the ``prompt_logprobs: k`` extra), made as
    it is serialised (server/bodies.py): ``None`` for the first prompt token, then per token
    ``{token_id: {"logprob", "decoded_token"}}``, the prompt token first, then the top k (no
    ``rank``: not computed)."""
    return (None if entry is None else
            {str(t): {"logprob": v, "decoded_token": token_text(t)} for t, v in entry.items()}
            for entry in out.prompt_logprobs or [])


def echo_logprobs(token_text: R.TokenText, out: RequestOutput,
                  completion: dict[str, Any] | None, num_top: int,
                  offsets: list[int] | None = None) -> dict[str, Any]:
    """The legacy ``logprobs`` object of the prompt tokens, followed by ``completion``'s;
    ``offsets``: where each prompt token starts in the echoed prompt (default: the lengths of
    the tokens' texts, added up). Its ``top_logprobs`` is an iterator, made as it is
    serialised (server/bodies.py)."""
    ids, entries = out.prompt_token_ids, out.prompt_logprobs or []
    first = token_text(ids[0])
    rest = R.completion_logprobs(token_text, ids[1:], entries[1:], len(first), num_top,
                                 lazy=True)
    prompt = {"tokens": [first, *rest["tokens"]],
              "token_logprobs": [None, *rest["token_logprobs"]],
              "top_logprobs": itertools.chain([None], rest["top_logprobs"]),
              "text_offset": offsets or [0, *rest["text_offset"]]}
    if completion is None:
        return prompt
    return {key: itertools.chain(prompt[key], completion[key]) if key == "top_logprobs"
            else prompt[key] + completion[key] for key in prompt}


def prompt_text_offsets(tokenizer: Any, text: str, ids: list[int],
                        add_special_tokens: bool) -> list[int] | None:
    """Where each of ``ids`` starts in ``text``, the prompt they were tokenised from (a token
    the tokenizer added, such as BOS, starts at 0: it is not in the text); None when ``ids``
    are not ``text``'s tokens (the prompt was truncated) or the tokenizer gives no offsets."""
    try:
        encoded = tokenizer(text, add_special_tokens=add_special_tokens,
                            return_offsets_mapping=True)
    except (NotImplementedError, ValueError):  # a slow (Python) tokenizer
        return None
    if list(encoded.input_ids) != list(ids):
        return None
    return [start for start, _ in encoded.offset_mapping]
