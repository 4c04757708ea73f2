"""Per-request token constraints: ``logit_bias``, ``allowed_token_ids`` and ``bad_words``.

Each edits ``logits: [B, V]`` in place for the rows that ask for it and leaves the other rows
untouched, bit for bit:

- ``logit_bias``: ``{token: bias}`` added to the row (OpenAI's meaning, as vLLM adds it), except
  that a bias of -100 sets the logit to -inf, so the token is banned exactly rather than very
  nearly (``exp(-100)`` is a denormal, not zero, in float32);
- ``allowed_token_ids``: every other token of the row at -inf;
- ``bad_words``: for each banned token sequence, its last token at -inf when the output ends
  with the others (a one-token word is banned everywhere); vLLM's meaning.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vmkv.sampling.state import SamplingState
from vmkv.sampling_params import MAX_LOGIT_BIAS


def apply_token_constraints(logits: torch.Tensor, states: Sequence[SamplingState],
                            rows: list[int]) -> None:
    """Apply the constraints of ``states[i]`` for each ``i`` in ``rows`` (``logits: [B, V]``
    float32, in place)."""
    rows_idx: list[int] = []
    tokens: list[int] = []
    values: list[float] = []
    banned_rows: list[int] = []
    banned: list[int] = []
    for i in rows:
        state = states[i]
        params = state.params
        for token, bias in (params.logit_bias or {}).items():
            if bias <= -MAX_LOGIT_BIAS:
                banned_rows.append(i)
                banned.append(token)
            else:
                rows_idx.append(i)
                tokens.append(token)
                values.append(bias)
        for token in banned_words_next(state.bad_words_token_ids, state.output_token_ids):
            banned_rows.append(i)
            banned.append(token)
        if params.allowed_token_ids is not None:
            _keep_only(logits, i, params.allowed_token_ids)
    device = logits.device
    if tokens:
        logits.index_put_((torch.tensor(rows_idx, device=device),
                           torch.tensor(tokens, device=device)),
                          torch.tensor(values, dtype=logits.dtype, device=device),
                          accumulate=True)
    if banned:
        logits.index_put_((torch.tensor(banned_rows, device=device),
                           torch.tensor(banned, device=device)),
                          torch.tensor(float("-inf"), device=device))


def _keep_only(logits: torch.Tensor, row: int, allowed: Sequence[int]) -> None:
    """Set every logit of ``logits[row]`` but ``allowed``'s to -inf."""
    keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)  # keep: [V]
    keep[torch.tensor(allowed, device=logits.device)] = True
    logits[row].masked_fill_(~keep, float("-inf"))


def banned_words_next(words: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The tokens that would complete one of ``words`` (token sequences) after ``output``."""
    banned = []
    for word in words:
        head = len(word) - 1
        if head == 0 or (len(output) >= head and list(output[-head:]) == list(word[:-1])):
            banned.append(word[-1])
    return banned


def bad_words_token_ids(tokenizer: object, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The token sequences of ``words``: each as written (stripped of leading spaces) and after
    a space, as it is tokenised at the start of a text and after another word (once each)."""
    sequences: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))  # type: ignore[attr-defined]
            if ids:
                sequences[ids] = None
    return tuple(sequences)
