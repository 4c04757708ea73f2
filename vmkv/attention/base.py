"""The attention contract: write the step's new K/V into the cache, then attend over it.

A step's batch is a list of requests, each contributing ``query_len`` new tokens after
``context_len`` tokens already cached (prefill chunks and decodes alike, no phases):

    tokens:  | req 0: q0 new | req 1: q1 new | ... |       (flattened, num_tokens rows)
    req i attends over cache rows [0, context_len_i + query_len_i) of its own sequence,
    causally: new token j sees cached tokens and new tokens 0..j.

Both KV modes expose every layer's cache as a flat ``[rows, kv_head, head_dim]`` view (virtual:
``slot * slot_tokens + position``; paged: ``block * block_size + offset``), so the write path is
one ``index_copy_`` of the new rows in either mode; only reading differs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """One step's batch, with the addressing a backend prepared for it.

    Attributes:
        request_ids: requests in batch order.
        context_lens: tokens each request had cached before this step.
        query_lens: new tokens each request brings this step.
        write_rows: ``[num_tokens]`` int64 flat cache row of every new token.
        seq_rows: per request, the flat rows of its whole sequence (``context + query``):
            a ``(start, length)`` pair for contiguous slots, an index tensor for block tables.
        extra: backend-specific tensors (block tables, slot ids, lengths on device...).
    """

    request_ids: list[str]
    context_lens: list[int]
    query_lens: list[int]
    write_rows: torch.Tensor
    seq_rows: list[tuple[int, int] | torch.Tensor]
    extra: dict[str, object]

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens)

    def seq_lens(self) -> list[int]:
        return [c + q for c, q in zip(self.context_lens, self.query_lens, strict=True)]


class AttentionBackend(ABC):
    """Attention over one KV cache manager's memory (one per engine)."""

    #: short name shown in logs and benchmarks
    name: str

    @abstractmethod
    def prepare(
        self, request_ids: list[str], context_lens: list[int], query_lens: list[int]
    ) -> AttentionMetadata:
        """Build the step's metadata; the KV manager must already hold room for every token."""

    @abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Store ``k``/``v`` of the new tokens, attend, return ``[num_tokens, heads*head_dim]``.

        Shapes: ``q [num_tokens, heads, head_dim]``, ``k, v [num_tokens, kv_heads, head_dim]``.
        """
