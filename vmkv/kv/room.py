"""Room per request: what each request holds, and what more would take (no side effects).

    request r:  | < num_tokens(r): room already allocated > | < allocate(r, n): n more > |
                  units_of(r): its pages or blocks            units_needed(r, n), can_allocate

The scheduler asks these before it allocates, preempts or admits; the tensor-parallel check
(vmkv/distributed/kv_checks.py) digests ``request_ids``, ``num_tokens`` and ``units_of``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class KVRoom(ABC):
    """Per-request queries of one KV manager; ``tokens`` is its state's token counts."""

    def __init__(self, tokens: dict[str, int], max_model_len: int) -> None:
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        self._tokens = tokens
        #: the most tokens one request may hold (allocate raises ValueError past it)
        self.max_model_len = max_model_len

    def num_tokens(self, request_id: str) -> int:
        """Tokens of room allocated to ``request_id`` so far (0 if unknown)."""
        return self._tokens.get(request_id, 0)

    def holds(self, request_id: str) -> bool:
        """Whether ``request_id`` holds memory (a slot or a block table, even of 0 tokens)."""
        return request_id in self._tokens

    def request_ids(self) -> list[str]:
        """Requests currently holding memory."""
        return list(self._tokens)

    @abstractmethod
    def units_of(self, request_id: str) -> list[int]:
        """The physical units holding ``request_id``'s tokens: its block ids, or its slot's
        pages in the first region (what must agree on every tensor-parallel rank)."""

    @abstractmethod
    def units_needed(self, request_id: str, num_new_tokens: int) -> int | None:
        """Memory units (pages over all regions, or blocks) ``allocate`` would take, copies
        included; None when the request could not get a slot at all."""

    @property
    @abstractmethod
    def free_units(self) -> int:
        """Units free or reclaimable now (the scheduler's admission headroom)."""

    @abstractmethod
    def can_allocate(self, request_id: str, num_new_tokens: int) -> bool:
        """Whether ``allocate`` with the same arguments would succeed now."""

    def check_length(self, request_id: str, new_len: int) -> None:
        """Raise ValueError when ``request_id`` would hold more than ``max_model_len``."""
        if new_len > self.max_model_len:
            raise ValueError(
                f"request {request_id!r} would hold {new_len} tokens, over max_model_len "
                f"({self.max_model_len})"
            )
