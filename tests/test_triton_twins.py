"""Triton twins (contiguous vs paged addressing) against a float32 torch reference.

The same K/V data is read through four layouts: the all-layers slot view (token stride
``L*2*H*D``), a plain ``[slot, token, H, D]`` copy, blocks of the all-layers buffer through an
**identity** block table, and a ``[num_blocks, bs, H, D]`` pool through a **shuffled** table.
Every cache row at or past a sequence's length holds NaN (so do the spare table entries' blocks):
a kernel that lets one of them into its result fails. Without CUDA the kernels run under
``TRITON_INTERPRET=1`` on CPU tensors (small shapes: the interpreter is slow); with CUDA the
same tests compile them for the GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import triton_required
from skip_policy import cpu_only

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated (module import)

if not triton_required.EXPECTED:
    pytest.importorskip("triton", reason="triton is not installed (not a dependency here)")
from vmkv.kernels import triton_decode as td  # noqa: E402  (imports triton: required on Linux)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KV_HEADS, HEAD_DIM, NUM_LAYERS, LAYER = 2, 64, 2, 1
SLOT_TOKENS = 128
SCALE = HEAD_DIM**-0.5
# the interpreter's bf16 tl.dot returns garbage (triton 3.9; a bf16 load/store is fine): GPU only
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _tol(dtype: torch.dtype) -> float:
    return 2e-4 if dtype == torch.float32 else 2e-2


class Layouts:
    """Per-request K/V ``[len_b, KV_HEADS, HEAD_DIM]`` written into every layout."""

    def __init__(self, seq_lens: list[int], block_size: int, dtype: torch.dtype, seed: int):
        gen = torch.Generator().manual_seed(seed)
        batch = len(seq_lens)
        num_slots = batch + 2
        self.seq_lens = seq_lens
        self.keys = [torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen) for n in seq_lens]
        self.values = [torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen) for n in seq_lens]
        slot_ids = torch.randperm(num_slots, generator=gen)[:batch]
        # [slot, token, layer, k|v, kv_head, head_dim]; the other layer holds finite decoys
        buf = torch.full((num_slots, SLOT_TOKENS, NUM_LAYERS, 2, KV_HEADS, HEAD_DIM),
                         float("nan"))
        buf[:, :, 1 - LAYER] = torch.randn(buf[:, :, 1 - LAYER].shape, generator=gen)
        for b, slot in enumerate(slot_ids.tolist()):
            buf[slot, : seq_lens[b], LAYER, 0] = self.keys[b]
            buf[slot, : seq_lens[b], LAYER, 1] = self.values[b]
        buf = buf.to(device=DEVICE, dtype=dtype)
        k_all, v_all = buf[:, :, LAYER, 0], buf[:, :, LAYER, 1]  # token stride L*2*H*D
        self.slot_ids = slot_ids.to(device=DEVICE, dtype=torch.int32)
        self.contiguous = {"all-layers": (k_all, v_all),
                           "per-layer": (k_all.contiguous(), v_all.contiguous())}

        blocks_per_slot = SLOT_TOKENS // block_size
        num_blocks = num_slots * blocks_per_slot
        ident = (slot_ids[:, None] * blocks_per_slot + torch.arange(blocks_per_slot)).to(
            torch.int32)  # [B, blocks_per_slot]: every entry past a length is a NaN block
        k_blocks = k_all.reshape(num_blocks, block_size, KV_HEADS, HEAD_DIM)  # views of buf
        v_blocks = v_all.reshape(num_blocks, block_size, KV_HEADS, HEAD_DIM)
        assert k_blocks.data_ptr() == k_all.data_ptr() and k_blocks.stride(1) == k_all.stride(1)
        perm = torch.randperm(num_blocks, generator=gen)
        k_pool = torch.empty((num_blocks, block_size, KV_HEADS, HEAD_DIM), dtype=dtype,
                             device=DEVICE)
        v_pool = torch.empty_like(k_pool)
        k_pool[perm.to(DEVICE)] = k_blocks
        v_pool[perm.to(DEVICE)] = v_blocks
        self.paged = {
            "identity": (k_blocks, v_blocks, ident.to(DEVICE)),
            "shuffled": (k_pool, v_pool, perm[ident.long()].to(device=DEVICE, dtype=torch.int32)),
        }
        self.lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               context_len: int) -> torch.Tensor:
    """fp32 causal attention of ``q [n, Hq, D]`` (positions ``context_len..``) over K/V."""
    n, heads, _ = q.shape
    group = heads // keys.shape[1]
    k = keys.float().repeat_interleave(group, 1).transpose(0, 1)  # [Hq, len, D]
    v = values.float().repeat_interleave(group, 1).transpose(0, 1)
    scores = q.float().transpose(0, 1) @ k.transpose(1, 2) * SCALE  # [Hq, n, len]
    pos = torch.arange(keys.shape[0])
    visible = pos[None, :] <= (context_len + torch.arange(n))[:, None]  # [n, len]
    scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)  # [n, Hq, D]


def _all_outputs(lay: Layouts, run_contig, run_paged) -> dict[str, torch.Tensor]:
    outs = {f"contiguous/{name}": run_contig(k, v, lay.slot_ids)
            for name, (k, v) in lay.contiguous.items()}
    outs |= {f"paged/{name}": run_paged(k, v, table) for name, (k, v, table) in lay.paged.items()}
    return outs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("group", "block_size", "block_n", "num_splits"), [
    (1, 16, 16, 1),  # one table entry per tile
    (3, 16, 32, 1),  # tiles span two blocks: per-token table loads
    (3, 64, 32, 3),  # split-KV, sequences shorter than the splits
    (1, 64, 16, 2),
])
def test_decode_twins_match_reference(group: int, block_size: int, block_n: int,
                                      num_splits: int, dtype: torch.dtype) -> None:
    seq_lens = [1, 17, 64, 100] if block_size == 16 else [1, 70, 0, 128, 5]  # 0: zeros
    lay = Layouts(seq_lens, block_size, dtype, seed=group * 100 + block_size)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(len(seq_lens), KV_HEADS * group, HEAD_DIM, generator=gen).to(DEVICE, dtype)
    cfg = {"num_splits": num_splits, "block_n": block_n}

    outs = _all_outputs(
        lay,
        lambda k, v, slots: td.decode_contiguous(q, k, v, slots, lay.lens, SCALE, **cfg),
        lambda k, v, table: td.decode_paged(q, k, v, table, lay.lens, SCALE, **cfg),
    )
    ref = torch.stack([_reference(q[b : b + 1].cpu(), lay.keys[b], lay.values[b], n - 1)[0]
                       for b, n in enumerate(seq_lens)])
    for name, out in outs.items():
        assert out.shape == q.shape and out.dtype == dtype, name
        assert torch.isfinite(out).all(), f"{name}: read a NaN row past a sequence's length"
        torch.testing.assert_close(out.float().cpu(), ref, atol=_tol(dtype), rtol=_tol(dtype),
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("group", "block_size"), [(3, 16), (1, 64)])
def test_prefill_twins_match_reference(group: int, block_size: int, dtype: torch.dtype) -> None:
    # (context_len, query_len): fresh prefill, decode, chunk after context, tiny prompt
    requests = [(0, 13), (40, 1), (23, 20), (0, 1)]
    seq_lens = [c + n for c, n in requests]
    lay = Layouts(seq_lens, block_size, dtype, seed=group + block_size)
    gen = torch.Generator().manual_seed(11)
    query_lens = [n for _, n in requests]
    q = torch.randn(sum(query_lens), KV_HEADS * group, HEAD_DIM, generator=gen).to(DEVICE, dtype)
    cu = torch.tensor([0] + query_lens, device=DEVICE).cumsum(0).to(torch.int32)
    cfg = {"block_m": 16, "block_n": 16}
    max_q = max(query_lens)

    outs = _all_outputs(
        lay,
        lambda k, v, slots: td.prefill_contiguous(q, k, v, slots, cu, lay.lens, max_q, SCALE,
                                                  **cfg),
        lambda k, v, table: td.prefill_paged(q, k, v, table, cu, lay.lens, max_q, SCALE, **cfg),
    )
    ref = torch.cat([_reference(q[cu[b] : cu[b + 1]].cpu(), lay.keys[b], lay.values[b], c)
                     for b, (c, _) in enumerate(requests)])
    for name, out in outs.items():
        assert torch.isfinite(out).all(), f"{name}: read a NaN row past a sequence's length"
        torch.testing.assert_close(out.float().cpu(), ref, atol=_tol(dtype), rtol=_tol(dtype),
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_bad_arguments_raise_value_error() -> None:
    q = torch.zeros(2, 4, HEAD_DIM, device=DEVICE)
    k = torch.zeros(3, 16, 2, HEAD_DIM, device=DEVICE)
    lens = torch.ones(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="int32"):
        td.decode_contiguous(q, k, k, torch.zeros(2, dtype=torch.int64, device=DEVICE), lens, 1.0)
    with pytest.raises(ValueError, match="do not fit"):
        td.decode_contiguous(q[:, :3], k, k, lens, lens, 1.0)
    strided = torch.zeros(3, 16, 2, 2 * HEAD_DIM, device=DEVICE)[..., ::2]
    with pytest.raises(ValueError, match="unit stride"):
        td.decode_paged(q, strided, strided, lens[:, None], lens, 1.0)


def test_tiny_head_dims_run_on_a_tile_of_at_least_16() -> None:
    """``tl.dot`` needs an inner size >= 16 for 16-bit inputs on Triton 3.6 GPUs: the head-dim
    tile is clamped (masked lanes), tiles smaller than that are refused."""
    assert [td.block_d(d) for d in (4, 8, 16, 24, 64)] == [16, 16, 16, 32, 64]
    gen = torch.Generator().manual_seed(3)
    dim, lens = 8, [5, 1, 30]
    keys = [torch.randn(n, KV_HEADS, dim, generator=gen) for n in lens]
    values = [torch.randn(n, KV_HEADS, dim, generator=gen) for n in lens]
    k = torch.zeros(len(lens), 32, KV_HEADS, dim)
    v = torch.zeros_like(k)
    for b, n in enumerate(lens):
        k[b, :n], v[b, :n] = keys[b], values[b]
    k, v = k.to(DEVICE, torch.float16), v.to(DEVICE, torch.float16)
    slots = torch.arange(len(lens), dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), 2 * KV_HEADS, dim, generator=gen).to(DEVICE, torch.float16)
    out = td.decode_contiguous(q, k, v, slots, seq_lens, SCALE, block_n=16)
    ref = torch.stack([_reference(q[b : b + 1].cpu(), keys[b], values[b], n - 1)[0]
                       for b, n in enumerate(lens)])
    torch.testing.assert_close(out.float().cpu(), ref, atol=2e-2, rtol=2e-2)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32, device=DEVICE)
    out = td.prefill_contiguous(q, k, v, slots, cu, seq_lens, 1, SCALE, block_m=16, block_n=16)
    torch.testing.assert_close(out.float().cpu(), ref, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16"):
        td.decode_contiguous(q, k, v, slots, seq_lens, SCALE, block_n=8)


_CHILD = textwrap.dedent(
    """
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from vmkv.kernels import triton_decode as td
    from vmkv.kv import KVSpec, PagedKVCache, VirtualKVCache
    from vmkv.memory import PagePool
    from vmkv.memory.host import HostMemoryBackend
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64)  # 2 KiB a token: 32 a 64 KiB page
    # slots of 2**22 tokens (8 GiB of VA): slot s >= 1 starts at s * 2**31 fp32 elements
    virt = VirtualKVCache(spec, pool=PagePool(HostMemoryBackend(65536, 16), 16), num_slots=3,
                          max_model_len=1 << 22)
    paged = PagedKVCache(spec, num_blocks=16, block_size=16, max_model_len=1 << 22)
    lens = [32, 64, 96]  # whole pages: token lens[b] of a slot lies on an unmapped page
    gen = torch.Generator().manual_seed(0)
    k_v, v_v = virt.layer_kv(1)
    k_p, v_p = paged.layer_kv(1)
    for b, n in enumerate(lens):
        virt.allocate(f"r{b}", n)
        paged.allocate(f"r{b}", n)
        k, v = torch.randn(2, n, 2, 64, generator=gen)
        s = virt.slot(f"r{b}")
        k_v[s, :n], v_v[s, :n] = k, v
        pos = torch.arange(n)
        rows = torch.tensor(paged.block_table(f"r{b}"))[pos // 16] * 16 + pos % 16
        k_p.flatten(0, 1)[rows], v_p.flatten(0, 1)[rows] = k, v
    slots = torch.tensor([virt.slot(f"r{b}") for b in range(3)], dtype=torch.int32)
    tables = torch.tensor([paged.block_table(f"r{b}") + [0] * (6 - -(-n // 16))
                           for b, n in enumerate(lens)], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32) + int(sys.argv[1])
    q = torch.randn(3, 6, 64, generator=gen)
    a = td.decode_contiguous(q, k_v, v_v, slots, seq_lens, 0.125, block_n=16, num_splits=2)
    c = td.decode_paged(q, k_p, v_p, tables, seq_lens, 0.125, block_n=16)
    print(json.dumps({"slots": slots.tolist(), "max_diff": float((a - c).abs().max())}))
    """
)


@cpu_only  # a host-VMM child under the CPU interpreter
@pytest.mark.parametrize(("extra", "returncode"), [(0, 0), (1, -11)])
def test_virtual_slots_need_int64_and_read_only_mapped_tokens(extra: int, returncode: int
                                                                ) -> None:
    """On a real host VirtualKVCache (slot offsets >= 2**31 elements, pages mapped up to each
    length) the contiguous twin matches the paged twin on a PagedKVCache with the same data;
    asking for one token more touches an unmapped page (SIGSEGV), so the test can see reads."""
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(extra)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == returncode, proc.stderr[-2000:]
    if returncode == 0:
        result = json.loads(proc.stdout.splitlines()[-1])
        assert max(result["slots"]) >= 1
        assert result["max_diff"] < 1e-5


def test_the_block_table_width_never_recompiles_a_kernel() -> None:
    """Triton compiles one variant per class of each integer argument (== 1, divisible by 16,
    other): a block table growing from 16 to 17 blocks recompiled the paged kernels mid-run on
    an H200 (0.4-0.65 s in one step). Their compiled (not interpreted) form, imported in a child
    without ``TRITON_INTERPRET``, takes ``stride_index`` unspecialised and every other integer
    argument is a layout stride fixed by the model."""
    child = textwrap.dedent(
        """
        import json
        from vmkv.kernels import triton_decode as td
        print(json.dumps({name: [p.name for p in getattr(td, name).params
                                 if p.do_not_specialize]
                          for name in ("_decode_kernel", "_prefill_kernel")}))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    unspecialised = json.loads(proc.stdout.splitlines()[-1])
    assert unspecialised == {"_decode_kernel": ["stride_index"],
                             "_prefill_kernel": ["stride_index"]}
