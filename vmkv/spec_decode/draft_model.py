"""The ``draft_model`` method: a (smaller) model with its own executor and KV cache guesses
the next ``k`` tokens greedily, one decode step each; the target verifies them as any proposals.

Its cache follows each sequence: before proposing, what it holds past the sequence's verified
tokens (its own guesses the target rejected) is rolled back (``kv.free(id, keep_tokens=n)``,
the same verb the target's rollback uses), the tokens it has not seen yet (the target's bonus
token, or the whole prompt the first time) are fed in one step, then it decodes. Greedy
drafts are point masses, so verification keeps the target's distribution exactly
(vmkv/spec_decode/verifier.py). ``"model": null`` lets the engine's own model draft for
itself: every proposal is then accepted under greedy decoding, a test of the mechanics (it
makes nothing faster).
"""

from __future__ import annotations

import weakref
from dataclasses import replace

from vmkv.config import EngineConfig
from vmkv.engine.sequence import Sequence
from vmkv.executor import create_executor
from vmkv.executor.plan import StepPlan
from vmkv.models import resolve_model


class DraftModelProposer:
    """Greedy proposals of a draft model run on its own executor (one rank)."""

    def __init__(self, config: EngineConfig) -> None:
        spec = config.speculative_config
        assert spec is not None
        draft = replace(config, model=spec.model or config.model, speculative_config=None,
                        tensor_parallel_size=1, kv_cache_memory=config.kv_cache_memory // 2,
                        enable_prefix_caching=False)
        self.executor = create_executor(draft, resolve_model(draft.model))
        self._closed = weakref.finalize(self, self.executor.close)
        self._fed: dict[str, list[int]] = {}  # seq_id -> the tokens its draft KV holds

    def propose(self, seq: Sequence, k: int) -> list[int]:
        kv, rid, tokens = self.executor.kv, seq.seq_id, seq.token_ids
        fed = self._fed.get(rid, [])
        same = (i for i, (a, b) in enumerate(zip(fed, tokens, strict=False)) if a != b)
        keep = next(same, min(len(fed), len(tokens)))
        keep = min(keep, len(tokens) - 1)  # the last token is always fed (its logits)
        if kv.room.holds(rid) and kv.room.num_tokens(rid) > keep:
            kv.free(rid, keep_tokens=keep)
        drafts: list[int] = []
        new = tokens[keep:]
        while len(drafts) < k:
            if len(tokens) + len(drafts) > kv.room.max_model_len or not kv.allocate(rid,
                                                                                      len(new)):
                break
            start = keep
            plan = StepPlan([rid], [start], [len(new)], list(new),
                            list(range(start, start + len(new))), [len(new) - 1])
            logits = self.executor.execute(plan).logits  # [1, vocab]
            keep += len(new)
            drafts.append(int(logits[0].argmax()))
            new = [drafts[-1]]
        self._fed[rid] = (list(tokens) + drafts)[:keep]
        return drafts

    def finished(self, seq: Sequence) -> None:
        self._fed.pop(seq.seq_id, None)
        if self.executor.kv.room.holds(seq.seq_id):
            self.executor.kv.free(seq.seq_id)

    def close(self) -> None:
        """Release the draft model and its cache."""
        self._closed()
