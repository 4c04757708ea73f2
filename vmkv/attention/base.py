"""The attention contract: write the step's new K/V into the cache, then attend over it.

A step's batch is a list of requests, each contributing ``query_len`` new tokens after
``context_len`` tokens already cached (prefill chunks and decodes alike, no phases):

    tokens:  | req 0: q0 new | req 1: q1 new | ... |       (flattened, num_tokens rows)
    req i attends over cache rows [0, context_len_i + query_len_i) of its own sequence,
    causally: new token j sees cached tokens and new tokens 0..j.

The KV manager says where each request's rows are (:mod:`vmkv.kv.addressing`: slot ids or a
block table); both modes expose each layer's cache as flat rows, so the write is one scatter of
the new rows in either mode and only the kernels' reading differs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from vmkv.kv.addressing import Addressing


@dataclass
class AttentionMetadata:
    """One step's batch and its addressing; backends extend it with their own typed fields.

    Attributes:
        request_ids: requests in batch order.
        context_lens: tokens each request had cached before this step.
        query_lens: new tokens each request brings this step.
        write_rows: ``[num_tokens]`` int64 flat cache row of every new token (-1: padding).
        addressing: the step's slot ids or block table (host arrays).
    """

    request_ids: list[str]
    context_lens: list[int]
    query_lens: list[int]
    write_rows: torch.Tensor
    addressing: Addressing


class AttentionBackend(ABC):
    """Attention over one KV cache manager's memory (one per engine)."""

    #: short name shown in logs and benchmarks ("virtual-cpu", "paged-triton", ...)
    name: str
    #: whether a decode step can be captured in a CUDA graph (see vmkv.executor.cuda_graphs)
    supports_cuda_graphs: bool = False

    @abstractmethod
    def prepare(
        self, request_ids: list[str], context_lens: list[int], query_lens: list[int]
    ) -> AttentionMetadata:
        """Build the step's metadata; the KV manager must already hold room for every token."""

    @abstractmethod
    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        """Store the step's new ``k, v [num_tokens, kv_heads, head_dim]`` in ``layer``'s
        cache at ``meta.write_rows``."""

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, meta: AttentionMetadata, scale: float
               ) -> torch.Tensor:
        """Attention of ``q [num_tokens, heads, head_dim]`` over ``layer``'s cache (the new
        rows already written); returns ``[num_tokens, heads * head_dim]``."""

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
        self.write_kv(layer, k, v, meta)
        return self.attend(layer, q, meta, scale)

    def close(self) -> None:
        """Drop the views of the KV cache (the manager is closing: a view would keep a paged
        cache's tensor alive); the backend is unusable afterwards."""
