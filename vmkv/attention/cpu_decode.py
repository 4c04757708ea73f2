"""Decode requests of a CPU step, batched into one in-place kernel call per layer.

A step mixes decodes (1 new token, attends over its cache) and prefill chunks. The CPU backends
hand every decode to :func:`vmkv.kernels.cpu_attention.decode` at once (reading the cache in
place: slot rows in virtual mode, block-table rows in paged mode) and run SDPA per prefill chunk,
where the per-call cost is amortised over many tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vmkv.kernels import cpu_attention
from vmkv.kv.addressing import Addressing


@dataclass
class DecodeBatch:
    """The decoding requests of a step and how to address their rows."""

    query_rows: torch.Tensor | None  # rows of q/out that decode; None: every row decodes
    seq_lens: torch.Tensor  # [n] int32, cached tokens + the new one
    starts: torch.Tensor | None = None  # virtual: [n] int64 first flat row of each slot
    block_table: torch.Tensor | None = None  # paged: [n, max_blocks] int32
    block_size: int = 0


def use_kernel(dtype: torch.dtype) -> bool:
    """Whether decodes go to the batched kernel (float32 and a C++ compiler present)."""
    return dtype == torch.float32 and cpu_attention.available()


def decode_batch(addr: Addressing, context_lens: list[int], query_lens: list[int]
                 ) -> DecodeBatch | None:
    """The one-token requests of a step, addressed for the kernel; None when there are none."""
    idx, rows, pos = [], [], 0
    for i, n in enumerate(query_lens):
        if n == 1:
            idx.append(i)
            rows.append(pos)
        pos += n
    if not idx:
        return None
    sel = np.asarray(idx)
    batch = DecodeBatch(
        query_rows=None if len(rows) == pos else torch.tensor(rows, dtype=torch.int64),
        seq_lens=torch.tensor([context_lens[i] + 1 for i in idx], dtype=torch.int32))
    if addr.paged:
        batch.block_table = torch.from_numpy(np.ascontiguousarray(addr.block_table[sel]))
        batch.block_size = addr.block_size
    else:
        batch.starts = torch.from_numpy(addr.slot_ids[sel] * addr.slot_tokens)
    return batch


def run(batch: DecodeBatch, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
        out: torch.Tensor, scale: float) -> None:
    """Attend every decode of ``batch`` and write its rows of ``out [T, heads*D]``."""
    qd = q if batch.query_rows is None else q.index_select(0, batch.query_rows)
    res = cpu_attention.decode(qd, k_flat, v_flat, batch.seq_lens, scale, starts=batch.starts,
                               block_table=batch.block_table, block_size=batch.block_size)
    if batch.query_rows is None:
        out.copy_(res)
    else:
        out.index_copy_(0, batch.query_rows, res)
