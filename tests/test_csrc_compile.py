"""CUDA C++ twins (``csrc/paged_attention.cu``): compile checks and a CPU emulation here,
numerics on a GPU.

Without a GPU: the source compiles with nvcc (no ATen/c10 headers); the shared library builds,
loads through ctypes and rejects bad arguments before touching CUDA; and the kernels themselves
run on a CPU emulator (g++, one thread per CUDA thread, see ``_EMULATOR``) against an fp32
reference. With a GPU (``gpu`` marker): the CUDA twins agree with the Triton twins and the
reference in both addressing modes, through a shuffled block table, across partitions, and with
slot offsets past 2**31 elements.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from skip_policy import NEEDS_NVCC, cpu_only, needs_nvcc

from vmkv.kernels import cuda_twins

NVCC = shutil.which("nvcc")


@needs_nvcc
def test_paged_attention_cu_compiles_for_sm90(tmp_path: Path) -> None:
    cmd = [NVCC, "-std=c++17", "-arch=sm_90", "-c", str(cuda_twins.SOURCE),
           "-o", str(tmp_path / "paged_attention.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)  # a hang guard
    assert proc.returncode == 0, proc.stderr


@needs_nvcc
def test_shared_library_loads_and_validates_arguments(tmp_path: Path) -> None:
    lib = cuda_twins.build_and_load(arch="sm_90", build_dir=tmp_path)
    assert lib.vmkv_decode_partition_size() == 512

    def call(head_size: int, strides: int) -> int:
        # null pointers: only argument checks (and, without a driver, the launch) run
        return lib.vmkv_decode_attention(0, 1, *[0] * 9, 1, 4, 2, head_size, 16, 10, 0.125,
                                         *[strides] * 11, 0)

    err = call(96, 64)
    assert err != 0 and b"head_size" in lib.vmkv_error_string(err)
    err = call(64, 3)  # 3 fp32 elements: not a multiple of 16 bytes
    assert err != 0 and b"16 bytes" in lib.vmkv_error_string(err)
    if not torch.cuda.is_available():  # the launch fails cleanly with a CUDA error, no crash
        err = call(64, 64)
        assert err not in (0, 1) and lib.vmkv_error_string(err)


@cpu_only
def test_wrappers_raise_clearly_without_cuda() -> None:
    q = torch.zeros(1, 4, 64)
    k = torch.zeros(2, 16, 2, 64)
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        cuda_twins.decode_contiguous(q, k, k, one, one, 0.125)
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        cuda_twins.decode_paged(q, k, k, one[:, None], one, 0.125)


# --------------------------------------------------------------------------------------------
# GPU numerics


def _reference(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
               scale: float) -> torch.Tensor:
    """fp32 decode attention: ``q [B, Hq, D]``, per-request K/V ``[len, Hkv, D]``."""
    outs = []
    for b, (k, v) in enumerate(zip(keys, values, strict=True)):
        group = q.shape[1] // k.shape[1]
        kk = k.float().repeat_interleave(group, 1).transpose(0, 1)  # [Hq, len, D]
        vv = v.float().repeat_interleave(group, 1).transpose(0, 1)
        scores = (q[b].float()[:, None, :] @ kk.transpose(1, 2)) * scale  # [Hq, 1, len]
        outs.append((scores.softmax(-1) @ vv)[:, 0])
    return torch.stack(outs)


def _layouts(seq_lens: list[int], kv_heads: int, head_dim: int, block_size: int,
             dtype: torch.dtype, slot_tokens: int, dev: str = "cuda", num_layers: int = 2):
    """Same K/V in an all-layers slot view and in a shuffled block pool; NaN past every length."""
    batch = len(seq_lens)
    keys = [torch.randn(n, kv_heads, head_dim, device=dev, dtype=dtype) for n in seq_lens]
    values = [torch.randn(n, kv_heads, head_dim, device=dev, dtype=dtype) for n in seq_lens]
    slot_ids = torch.randperm(batch + 1, device=dev)[:batch]
    buf = torch.full((batch + 1, slot_tokens, num_layers, 2, kv_heads, head_dim), float("nan"),
                     device=dev, dtype=dtype)
    for b, s in enumerate(slot_ids.tolist()):
        buf[s, : seq_lens[b], 1, 0] = keys[b]
        buf[s, : seq_lens[b], 1, 1] = values[b]
    k_view, v_view = buf[:, :, 1, 0], buf[:, :, 1, 1]
    per_slot = slot_tokens // block_size
    num_blocks = (batch + 1) * per_slot
    perm = torch.randperm(num_blocks, device=dev)
    k_pool = torch.empty(num_blocks, block_size, kv_heads, head_dim, device=dev, dtype=dtype)
    v_pool = torch.empty_like(k_pool)
    k_pool[perm] = k_view.reshape(num_blocks, block_size, kv_heads, head_dim)
    v_pool[perm] = v_view.reshape(num_blocks, block_size, kv_heads, head_dim)
    table = perm[slot_ids[:, None] * per_slot + torch.arange(per_slot, device=dev)]
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    return (keys, values, (k_view, v_view, slot_ids.to(torch.int32)),
            (k_pool, v_pool, table.to(torch.int32)), lens)


# CPU emulation of what the kernels use: one std::thread per CUDA thread, blocks one after
# another, __shared__ as function statics, std::barrier for __syncthreads, an exchange buffer
# per warp for __shfl_xor_sync, and an alignment check on every vector load. It checks the
# indexing, reductions and partition merge; not the GPU memory model nor performance.
_EMULATOR = r"""
#include <cuda_runtime.h>
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
#undef __global__
#undef __device__
#undef __forceinline__
#undef __shared__
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static
namespace emu {
inline thread_local uint3 tid, bid;
inline std::barrier<>* block_bar;
inline std::barrier<>* warp_bar[32];
inline float xchg[1024];
inline float shfl_xor(unsigned, float x, int mask) {
  const int t = tid.x;
  xchg[t] = x;
  warp_bar[t / 32]->arrive_and_wait();
  const float y = xchg[(t & ~31) | ((t & 31) ^ mask)];
  warp_bar[t / 32]->arrive_and_wait();
  return y;
}
template <typename F, typename P>
void launch(F kernel, dim3 grid, int threads, size_t, cudaStream_t, const P& p) {
  std::barrier<> bar(threads);
  block_bar = &bar;
  for (int w = 0; w < threads / 32; ++w) warp_bar[w] = new std::barrier<>(32);
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; ++t)
          pool.emplace_back([&, t] {
            tid = make_uint3(t, 0, 0);
            bid = make_uint3(x, y, z);
            kernel(p);
          });
        for (auto& th : pool) th.join();
      }
  for (int w = 0; w < threads / 32; ++w) delete warp_bar[w];
}
inline void check_align(const void* ptr, size_t bytes) {
  if (reinterpret_cast<uintptr_t>(ptr) % bytes) {
    std::fprintf(stderr, "misaligned vector load\n");
    std::abort();
  }
}
}  // namespace emu
#define threadIdx emu::tid
#define blockIdx emu::bid
#define __syncthreads() emu::block_bar->arrive_and_wait()
#define __shfl_xor_sync emu::shfl_xor
#define cudaGetLastError() cudaSuccess
#define cudaGetErrorString(e) "emulated"
using std::max;
using std::min;
"""


def _cuda_include() -> Path | None:
    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    if NVCC:
        roots.append(str(Path(NVCC).resolve().parents[1]))
    found = [Path(r) / "include" for r in roots if r]
    return next((inc for inc in found if (inc / "cuda_runtime.h").exists()), None)


@pytest.mark.skipif(_cuda_include() is None, reason=f"{NEEDS_NVCC}: its headers")
def test_cuda_twins_on_cpu_thread_emulator(tmp_path: Path) -> None:
    src = cuda_twins.SOURCE.read_text()
    # kernel<<<grid, threads, smem, stream>>>(args); -> emu::launch(kernel, grid, ..., args);
    src, launches = re.subn(r"([\w:]+<[^<>;]*>)\s*<<<(.*?)>>>\((.*?)\);",
                            r"emu::launch(\1, \2, \3);", src, flags=re.S)
    src = src.replace("return *reinterpret_cast<const Vec<T, N>*>(ptr);",
                      "emu::check_align(ptr, sizeof(T) * N);\n"
                      "  return *reinterpret_cast<const Vec<T, N>*>(ptr);")
    assert launches == 2 and "emu::check_align" in src
    (tmp_path / "emu.cpp").write_text(_EMULATOR + src)
    lib_path = tmp_path / "emu.so"
    proc = subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-w",
                           f"-I{_cuda_include()}", str(tmp_path / "emu.cpp"), "-o", str(lib_path),
                           "-lpthread"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lib = ctypes.CDLL(str(lib_path))
    lib.vmkv_decode_attention.argtypes = cuda_twins._ARGTYPES

    def run(q, k, v, index, lens, paged: bool, max_seq_len: int) -> torch.Tensor:
        batch, heads, dim = q.shape
        parts = -(-max_seq_len // 512)
        out = torch.full_like(q, float("nan"))
        work = torch.full((batch, heads, parts, dim + 2), float("nan"))  # tmp_out | sums | maxes
        tmp_out = work[..., :dim].contiguous()
        stats = torch.full((2, batch, heads, parts), float("nan"))
        err = lib.vmkv_decode_attention(
            cuda_twins._DTYPES[q.dtype], int(paged), out.data_ptr(), q.data_ptr(), k.data_ptr(),
            v.data_ptr(), index.data_ptr(), lens.data_ptr(), tmp_out.data_ptr(),
            stats[0].data_ptr(), stats[1].data_ptr(), batch, heads, k.shape[2], dim,
            k.shape[1] if paged else 1, max_seq_len, dim**-0.5, q.stride(0), q.stride(1),
            out.stride(0), out.stride(1), *k.stride()[:3], *v.stride()[:3],
            index.stride(0) if paged else 0, 0)
        assert err == 0
        return out

    torch.manual_seed(0)
    cases = [(torch.float32, 1, 64, 16, [1, 17, 600, 100, 0]),
             (torch.float16, 3, 128, 64, [1, 513, 1100, 30]),
             (torch.bfloat16, 4, 256, 256, [5, 512, 1024, 1536])]
    for dtype, group, dim, block_size, seq_lens in cases:
        keys, values, contig, paged, lens = _layouts(seq_lens, 2, dim, block_size, dtype,
                                                     slot_tokens=1536, dev="cpu")
        q = torch.randn(len(seq_lens), 2 * group, dim).to(dtype)
        ref = _reference(q, keys, values, dim**-0.5).nan_to_num()  # length 0: zeros
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        outs = {"contiguous": run(q, *contig, lens, False, max(seq_lens)),
                "paged": run(q, *paged, lens, True, 1536)}  # more partitions than needed
        for name, out in outs.items():
            torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol,
                                       msg=lambda m, n=name, d=dtype: f"{n} {d}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("group", "head_dim", "block_size"),
                         [(1, 64, 16), (3, 64, 64), (4, 128, 16), (8, 128, 256)])
def test_cuda_twins_match_triton_and_reference(group: int, head_dim: int, block_size: int,
                                               dtype: torch.dtype) -> None:
    from vmkv.kernels import triton_decode

    torch.manual_seed(group * 1000 + head_dim + block_size)
    seq_lens = [1, 17, 512, 513, 1500, 2048, 100]  # one, tile tails, partition edges
    kv_heads, scale = 2, head_dim**-0.5
    keys, values, contig, paged, lens = _layouts(seq_lens, kv_heads, head_dim, block_size,
                                                 dtype, slot_tokens=2048)
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim, device="cuda", dtype=dtype)
    ref = _reference(q, keys, values, scale)
    tol = 2e-3 if dtype == torch.float32 else 2e-2
    outs = {
        "cuda/contiguous": cuda_twins.decode_contiguous(q, *contig, lens, scale),
        "cuda/paged": cuda_twins.decode_paged(q, *paged, lens, scale, max_seq_len=2048),
        "triton/contiguous": triton_decode.decode_contiguous(q, *contig, lens, scale),
        "triton/paged": triton_decode.decode_paged(q, *paged, lens, scale),
    }
    torch.cuda.synchronize()
    for name, out in outs.items():
        assert torch.isfinite(out).all(), f"{name} read past a sequence's length"
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol,
                                   msg=lambda m, name=name: f"{name}: {m}")
    torch.testing.assert_close(outs["cuda/contiguous"], outs["cuda/paged"], atol=tol, rtol=tol)


@pytest.mark.gpu
def test_cuda_and_triton_twins_use_int64_slot_offsets() -> None:
    """Slot 2 of an all-layers buffer (token stride 8*2*2*64 = 2048) starts past 2**32
    elements; int32 offset arithmetic would wrap."""
    from vmkv.kernels import triton_decode

    slot_tokens, layers, kv_heads, head_dim = 1 << 20, 8, 2, 64
    buf = torch.empty(3, slot_tokens, layers, 2, kv_heads, head_dim, device="cuda",
                      dtype=torch.float16)  # 12 GiB, only the rows below are written
    k_view, v_view = buf[:, :, 3, 0], buf[:, :, 3, 1]
    assert k_view.stride(0) * 2 >= 1 << 32
    seq_lens = [700, 33]
    slots = [2, 1]
    keys = [torch.randn(n, kv_heads, head_dim, device="cuda", dtype=torch.float16)
            for n in seq_lens]
    values = [torch.randn_like(k) for k in keys]
    for s, k, v in zip(slots, keys, values, strict=True):
        k_view[s, : k.shape[0]] = k
        v_view[s, : v.shape[0]] = v
    q = torch.randn(2, 6, head_dim, device="cuda", dtype=torch.float16)
    slot_ids = torch.tensor(slots, dtype=torch.int32, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    ref = _reference(q, keys, values, 0.125)
    for out in (cuda_twins.decode_contiguous(q, k_view, v_view, slot_ids, lens, 0.125),
                triton_decode.decode_contiguous(q, k_view, v_view, slot_ids, lens, 0.125)):
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    del buf
    torch.cuda.empty_cache()
