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
    """A ``xgrammar.GrammarMatcher`` over one compiled grammar; with ``after_token``, the
    grammar waits (constrains nothing, sees no token) until the output's first
    ``after_token``, and applies from the next token on (the end of a reasoning section)."""

    def __init__(self, compiled: xgr.CompiledGrammar,
                 matcher: xgr.GrammarMatcher | None = None,
                 after_token: int | None = None) -> None:
        import xgrammar as xgr  # loaded with the first grammar (compiler.py)

        self.compiled = compiled
        self.matcher = matcher or xgr.GrammarMatcher(compiled)
        self.after_token = after_token  # None: the grammar applies now

    @property
    def is_active(self) -> bool:
        """Whether the grammar constrains the next token (it no longer waits)."""
        return self.after_token is None

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (``[B, ceil(V / 32)]`` int32)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the grammar forbids it."""
        if self.after_token is not None:
            if token_id == self.after_token:
                self.after_token = None
            return True
        return self.matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: nothing may follow."""
        return self.after_token is None and self.matcher.is_terminated()

    def fork(self) -> GrammarState:
        """An independent copy in the same state (for the samples of ``n > 1``)."""
        return GrammarState(self.compiled, self.matcher.fork(), self.after_token)
