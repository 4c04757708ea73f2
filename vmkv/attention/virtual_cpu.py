"""Virtual mode on CPU: attention reads each request's slot in place (no copies).

A request in slot ``s`` with ``L`` tokens reads flat rows ``[s*T, s*T + L)`` of the layer view,
``T = slot_tokens``: all mapped, nothing past ``L`` is touched. Decodes of a step go to one
batched kernel call per layer (:mod:`vmkv.attention.cpu_decode`); prefill chunks use SDPA on
the request's strided view.
"""

from __future__ import annotations

import torch

from vmkv.attention import cpu_decode
from vmkv.attention.base import AttentionBackend, AttentionMetadata
from vmkv.attention.sdpa import attend_rows
from vmkv.kv.virtual import VirtualKVCache


def flat_rows(starts: torch.Tensor, context_lens: torch.Tensor, query_lens: torch.Tensor
              ) -> torch.Tensor:
    """Rows ``starts[i] + context_lens[i] + j`` for ``j < query_lens[i]``, concatenated."""
    first = torch.repeat_interleave(starts + context_lens, query_lens)
    offsets = torch.cumsum(query_lens, 0) - query_lens
    within = torch.arange(int(query_lens.sum())) - torch.repeat_interleave(offsets, query_lens)
    return first + within


class VirtualSdpaBackend(AttentionBackend):
    """Batched in-place decode kernel + per-request SDPA prefill over ``[slot, :len]`` views."""

    name = "virtual-cpu"

    def __init__(self, kv: VirtualKVCache) -> None:
        self.kv = kv
        self.slot_tokens = kv.layout.slot_tokens
        # [slots * slot_tokens, kv_heads, D] views per layer (a slot is exactly T token rows)
        self._flat = [(k.flatten(0, 1), v.flatten(0, 1))
                      for k, v in (kv.layer_kv(i) for i in range(kv.spec.num_layers))]
        self.batched_decode = cpu_decode.use_kernel(kv.spec.dtype)

    def prepare(self, request_ids: list[str], context_lens: list[int], query_lens: list[int]
                ) -> AttentionMetadata:
        starts = [self.kv.slot(rid) * self.slot_tokens for rid in request_ids]
        starts_t, ctx_t = torch.tensor(starts), torch.tensor(context_lens)
        write_rows = flat_rows(starts_t, ctx_t, torch.tensor(query_lens))
        seq_rows = [(s, c + q) for s, c, q in zip(starts, context_lens, query_lens, strict=True)]
        extra: dict[str, object] = {}
        idx, rows = cpu_decode.decode_positions(query_lens)
        if self.batched_decode and idx:
            sel = torch.tensor(idx)
            extra["decode"] = cpu_decode.DecodeBatch(
                query_rows=cpu_decode.query_rows(rows, len(write_rows)),
                seq_lens=(ctx_t[sel] + 1).to(torch.int32), starts=starts_t[sel])
        return AttentionMetadata(list(request_ids), list(context_lens), list(query_lens),
                                 write_rows, seq_rows, extra)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        k_flat, v_flat = self._flat[layer]
        out = cpu_decode.write_and_decode(meta, q, k, v, k_flat, v_flat, scale)
        attend_rows(out, q, k_flat, v_flat, meta, scale,
                    skip_decode=meta.extra.get("decode") is not None)
        return out
