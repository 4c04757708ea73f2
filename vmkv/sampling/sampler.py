"""The sampler: one batched step from logits to token ids (and logprobs), in vLLM's order.

    raw logits --log_softmax--> logprobs returned to the user (see ``logprobs.py``)
        |
    penalties (repetition over prompt+output; presence/frequency over output)
    token constraints (logit_bias, allowed_token_ids, bad_words: token_constraints.py)
    min_tokens (EOS and stop ids at -inf until enough outputs)
    grammar bitmask (structured outputs: tokens the row's grammar forbids at -inf)
        |-- greedy rows: argmax
        '-- random rows: / temperature -> min_p -> top_k -> top_p -> softmax
                         -> inverse CDF: the first token whose running probability passes
                            one uniform draw (cpu_argmax.sample_rows: one kernel on the CPU)

Every step is a whole-batch tensor operation; a stage no request needs is skipped. A request
with a seed draws its uniform from its own generator and every stage is row-wise and an exact
no-op on rows that do not use it, so its tokens do not depend on the rest of its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from vmkv.kernels.cpu_argmax import argmax_rows, sample_rows
from vmkv.sampling.grammar import apply_grammar_bitmask, constrained_rows
from vmkv.sampling.logprobs import gather_logprobs
from vmkv.sampling.penalties import apply_min_tokens, apply_penalties
from vmkv.sampling.state import SamplingState
from vmkv.sampling.token_constraints import apply_token_constraints
from vmkv.sampling.truncation import apply_min_p, apply_top_k, apply_top_p
from vmkv.sampling_params import SamplingParams


class SamplerOutput(NamedTuple):
    """One step's result, in batch order.

    Attributes:
        token_ids: the sampled token of every request.
        logprobs: every request's sampled-token logprob under the raw logits' log_softmax;
            None when no request in the batch asked for logprobs.
        top_logprobs: per request, its ``params.logprobs`` most likely (token_id, logprob)
            pairs, most likely first ([] for requests that asked for none); None as above.
    """

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


class Sampler:
    """Samples one token per request from ``logits: [B, V]``.

    ``generator`` serves every unseeded request (one batched draw per step); None uses torch's
    default generator for the logits' device. Seeded requests use ``SamplingState.generator``,
    which must live on the logits' device.
    """

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> SamplerOutput:
        """Sample row i of ``logits`` (``[B, V]``, left unmodified) as ``states[i]`` asks."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(
                f"logits must be [len(states)={len(states)}, V], got {tuple(logits.shape)}"
            )
        num_top = [s.params.logprobs for s in states]
        has_logprobs = any(k is not None for k in num_top)
        raw_logprobs = logits.float().log_softmax(dim=-1) if has_logprobs else None

        penalised_rows = [i for i, s in enumerate(states) if _has_penalty(s.params)]
        grammar_rows = constrained_rows(states)
        token_rows = [i for i, s in enumerate(states) if s.params.has_token_constraints]
        edits_logits = (penalised_rows or grammar_rows or token_rows
                        or any(s.masked_token_ids for s in states))
        if not edits_logits and all(s.params.is_greedy for s in states):
            token_ids = argmax_rows(logits)  # the common greedy batch: no copy of [B, V]
        elif not edits_logits:  # sampling alone reads the logits: no copy either
            token_ids = self._sample(logits.float(), states)  # token_ids: [B] int64
        else:
            logits = logits.to(torch.float32, copy=True)  # logits: [B, V]
            apply_penalties(logits, states, penalised_rows)
            apply_token_constraints(logits, states, token_rows)
            apply_min_tokens(logits, states, skip_rows=grammar_rows)
            apply_grammar_bitmask(logits, states, grammar_rows)
            token_ids = self._sample(logits, states)
        if raw_logprobs is None:
            return SamplerOutput(token_ids.tolist(), None, None)
        sampled, top = gather_logprobs(raw_logprobs, token_ids, [k or 0 for k in num_top])
        return SamplerOutput(token_ids.tolist(), sampled, top)

    def _sample(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        random_rows = [i for i, s in enumerate(states) if not s.params.is_greedy]
        if not random_rows:
            return argmax_rows(logits)
        if len(random_rows) == len(states):
            return self._sample_random(logits, states)
        token_ids = argmax_rows(logits)
        index = torch.tensor(random_rows, device=logits.device)
        random_states = [states[i] for i in random_rows]
        token_ids[index] = self._sample_random(logits.index_select(0, index), random_states)
        return token_ids

    def _sample_random(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        """Temperature, truncation and the inverse-CDF draw for non-greedy rows: ``[R]``."""
        params = [s.params for s in states]
        device, vocab_size = logits.device, logits.shape[-1]
        temperature = torch.tensor([p.temperature for p in params], device=device)
        top_k = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]
        truncated = any(p.min_p > 0 or p.top_p < 1.0 for p in params) or any(top_k)
        if truncated:  # truncation sees the tempered distribution
            logits = logits / temperature[:, None]
            temperature = torch.ones_like(temperature)
        if any(p.min_p > 0 for p in params):
            logits = apply_min_p(logits, torch.tensor([p.min_p for p in params], device=device))
        if any(top_k):
            logits = apply_top_k(logits, torch.tensor(top_k, device=device), max(top_k))
        if any(p.top_p < 1.0 for p in params):
            logits = apply_top_p(logits, torch.tensor([p.top_p for p in params], device=device))
        return sample_rows(logits, temperature, self._uniforms(states, device))

    def _uniforms(self, states: Sequence[SamplingState], device: torch.device) -> torch.Tensor:
        """One float64 uniform in [0, 1) per row: seeded rows from their own generators, the
        rest in one draw from ``self.generator``."""
        uniforms = torch.empty(len(states), dtype=torch.float64, device=device)  # uniforms: [R]
        unseeded = [i for i, s in enumerate(states) if s.generator is None]
        if len(unseeded) == len(states):
            uniforms.uniform_(generator=self.generator)
        elif unseeded:
            draw = torch.empty(len(unseeded), dtype=torch.float64, device=device)
            uniforms[torch.tensor(unseeded, device=device)] = draw.uniform_(
                generator=self.generator)
        for i, state in enumerate(states):
            if state.generator is not None:
                uniforms[i] = torch.empty(1, dtype=torch.float64, device=device).uniform_(
                    generator=state.generator)[0]
        return uniforms


def _has_penalty(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )
