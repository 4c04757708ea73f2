"""One sequence's grammar matcher: which tokens may come next, and what was accepted.

The matcher's state is a function of the sequence's output tokens only. Those survive every
engine event, so the state never needs rebuilding: recompute preemption drops the KV but keeps
the tokens (and the matcher), swap keeps both, a fork copies it (``fork``), stop strings and
aborts end the sequence and the matcher with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import xgrammar as xgr


class GrammarState:
    """A ``xgrammar.GrammarMatcher`` over one compiled grammar."""

    def __init__(self, compiled: xgr.CompiledGrammar,
                 matcher: xgr.GrammarMatcher | None = None) -> None:
        import xgrammar as xgr  # loaded with the first grammar (compiler.py)

        self.compiled = compiled
        self.matcher = matcher or xgr.GrammarMatcher(compiled)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (``[B, ceil(V / 32)]`` int32)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the grammar forbids it."""
        return self.matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: nothing may follow."""
        return self.matcher.is_terminated()

    def fork(self) -> GrammarState:
        """An independent copy in the same state (for the samples of ``n > 1``)."""
        return GrammarState(self.compiled, self.matcher.fork())
