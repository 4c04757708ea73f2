"""What the scheduler asks before it schedules a decoding sequence: how many tokens to guess,
and which (the configured method), under the adaptive policy.

    SpecDecoding.propose(seq, room, batch)   -> proposals (maybe none) for k + 1 query rows
    SpecDecoding.verified(seq, drafted, n)   the verify step's outcome (counters, policy)
    SpecDecoding.finished(seq)               a sequence ended (the suffix index learns it)

The adaptive policy (on unless ``"adaptive": false``): no proposals while ``adaptive_max_batch``
or more sequences decode together (a big batch already reads each weight once for many
tokens, so verifying guesses only adds work: vLLM and SGLang users switch speculation off
under load for the same reason), and per sequence fewer proposals as its acceptance falls
(an exponential average): ``k * 2 * acceptance`` of them, and below 10 % one probe every
eighth step only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from vmkv.config import EngineConfig
from vmkv.engine.sequence import Sequence
from vmkv.sampling import Sampler
from vmkv.spec_decode.config import SpeculativeConfig
from vmkv.spec_decode.metrics import SpecDecodeCounters
from vmkv.spec_decode.ngram import propose_ngram
from vmkv.spec_decode.verifier import Append, verify

#: weight of the newest verify step in a sequence's acceptance average
ACCEPTANCE_EMA = 0.3
#: below this acceptance a sequence only probes, one step in PROBE_EVERY
LOW_ACCEPTANCE, PROBE_EVERY = 0.1, 8


class Proposer(Protocol):
    """A method: up to ``k`` guesses of what follows ``seq``'s tokens."""

    def propose(self, seq: Sequence, k: int) -> list[int]: ...

    def finished(self, seq: Sequence) -> None: ...

    def close(self) -> None: ...


class NgramProposer:
    """Prompt lookup over the sequence's prompt and output (:mod:`vmkv.spec_decode.ngram`)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, seq: Sequence, k: int) -> list[int]:
        tokens = np.fromiter(seq.token_ids, np.int64, len(seq.token_ids))
        return propose_ngram(tokens, self.min_n, self.max_n, k)

    def finished(self, seq: Sequence) -> None:
        pass

    def close(self) -> None:
        pass


class SpecDecoding:
    """The engine's speculative decoding: the method's proposer, the adaptive policy and
    vLLM's counters."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int
                 ) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.counters = SpecDecodeCounters(config.num_speculative_tokens)
        self._acceptance: dict[str, float] = {}  # seq_id -> its acceptance average
        self._skipped: dict[str, int] = {}  # seq_id -> steps without a probe
        #: benches set it to {} to learn which output positions were accepted proposals
        self.accepted_positions: dict[str, list[int]] | None = None

    def propose(self, seq: Sequence, room: int, batch_size: int) -> list[int]:
        """Proposals for ``seq``'s next step: at most ``room`` (the step's budget left), none
        past its ``max_tokens`` or ``max_model_len``, none under the adaptive policy's load."""
        config = self.config
        k = min(config.num_speculative_tokens, room,
                seq.request.max_tokens - seq.num_output_tokens - 1,
                self.max_model_len - seq.num_tokens)
        if config.adaptive:
            if batch_size >= config.adaptive_max_batch:
                return []
            rate = self._acceptance.get(seq.seq_id, 1.0)
            if rate < LOW_ACCEPTANCE:
                skipped = self._skipped.get(seq.seq_id, 0) + 1
                self._skipped[seq.seq_id] = skipped % PROBE_EVERY
                if skipped < PROBE_EVERY:
                    return []
                k = min(k, 1)
            else:
                k = min(k, max(1, math.ceil(2 * rate * k)))
        if k <= 0:
            return []
        return self.proposer.propose(seq, k)

    def verified(self, seq: Sequence, num_drafted: int, num_emitted: int) -> None:
        """``seq``'s verify step emitted ``num_emitted`` tokens for ``num_drafted``
        proposals."""
        accepted = min(num_emitted - 1, num_drafted)
        self.counters.count(num_drafted, accepted)
        if self.accepted_positions is not None:
            first = seq.num_output_tokens - num_emitted
            self.accepted_positions.setdefault(seq.seq_id, []).extend(
                range(first, first + accepted))
        old = self._acceptance.get(seq.seq_id, 1.0)
        self._acceptance[seq.seq_id] = ((1 - ACCEPTANCE_EMA) * old
                                        + ACCEPTANCE_EMA * accepted / num_drafted)

    def verify(self, sampler: Sampler, logits: torch.Tensor, ready: list[Sequence],
               append: Append, rollback: Callable[[Sequence, int], None]
               ) -> tuple[list[Sequence], list[int], list[Sequence]]:
        """Verify the sequences of ``ready`` that ran proposals (their ``1 + k`` rows of
        ``logits``; :func:`~vmkv.spec_decode.verifier.verify`), count them, and ``rollback``
        each to its verified tokens; returns them, and the logits rows and sequences of the
        others (one row each)."""
        batch: list[tuple[Sequence, int]] = []
        rows: list[int] = []
        plain: list[Sequence] = []
        row = 0
        for seq in ready:
            if seq.draft_token_ids:
                batch.append((seq, row))
            else:
                plain.append(seq)
                rows.append(row)
            row += 1 + len(seq.draft_token_ids)
        emitted = verify(sampler, logits, batch, append)
        for (seq, _), num in zip(batch, emitted, strict=True):
            drafted = len(seq.draft_token_ids)
            self.verified(seq, drafted, num)
            rollback(seq, seq.num_computed_tokens - 1 - drafted + num)
        return [seq for seq, _ in batch], rows, plain

    def finished(self, seq: Sequence) -> None:
        """``seq`` ended: forget its average, let the method learn its output."""
        self._acceptance.pop(seq.seq_id, None)
        self._skipped.pop(seq.seq_id, None)
        self.proposer.finished(seq)

    def close(self) -> None:
        """Release what the method holds (a draft model and its cache)."""
        self.proposer.close()


def create_spec_decoding(engine_config: EngineConfig, max_model_len: int) -> SpecDecoding:
    """The :class:`SpecDecoding` of ``engine_config.speculative_config``'s method."""
    config = engine_config.speculative_config
    assert config is not None
    if config.method == "ngram":
        return SpecDecoding(config, NgramProposer(config), max_model_len)
    if config.method == "suffix":
        from vmkv.spec_decode.suffix import SuffixProposer
        return SpecDecoding(config, SuffixProposer(config), max_model_len)
    if config.method == "draft_model":
        from vmkv.spec_decode.draft_model import DraftModelProposer
        return SpecDecoding(config, DraftModelProposer(engine_config), max_model_len)
    raise ValueError(f"speculative_config.method {config.method!r} is not served yet")
