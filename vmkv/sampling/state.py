"""Per-request sampling state: the parameters, the token history and the seeded generator."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import InitVar, dataclass, field
from typing import Any

import torch

from vmkv.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingState:
    """What the sampler needs to know about one request.

    The engine appends each accepted token to ``output_token_ids`` after a step; the sampler
    only reads the state (and advances ``generator``).

    Attributes:
        params: the request's validated sampling parameters.
        prompt_token_ids: the prompt, read by the repetition penalty.
        output_token_ids: tokens generated so far, read by all penalties and ``min_tokens``.
        eos_token_ids: the model's EOS ids, masked (unless ``ignore_eos``) together with
            ``params.stop_token_ids`` while fewer than ``params.min_tokens`` outputs exist.
        generator: seeded from ``params.seed`` when given, on ``device``; None for unseeded
            requests, which share the sampler's generator.
        grammar: the structured-output matcher (``vmkv.structured.matcher.GrammarState``) of
            a constrained request, advanced by the engine; None when unconstrained.
        bad_words_token_ids: ``params.bad_words`` as token sequences (the engine tokenises
            them at admission: ``token_constraints.bad_words_token_ids``).
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: tuple[int, ...] = ()
    generator: torch.Generator | None = None
    grammar: Any = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    device: InitVar[torch.device | str] = "cpu"

    def __post_init__(self, device: torch.device | str) -> None:
        self.eos_token_ids = tuple(self.eos_token_ids)
        if self.generator is None and self.params.seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(self.params.seed)

    @property
    def masked_token_ids(self) -> tuple[int, ...]:
        """Ids that cannot be sampled this step because of ``min_tokens``.

        Before ``params.min_tokens`` outputs exist: ``params.stop_token_ids`` plus the EOS ids
        (unless ``ignore_eos``, which makes EOS an ordinary token); afterwards, none.
        """
        if len(self.output_token_ids) >= self.params.min_tokens:
            return ()
        eos = () if self.params.ignore_eos else self.eos_token_ids
        return tuple(dict.fromkeys(eos + self.params.stop_token_ids))
