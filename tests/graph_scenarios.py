"""Decode CUDA-graph scenarios shared by the tests and the GPU check (no pytest: the GPU image
may lack it).

A scenario captures a :class:`DecodeGraphRunner`, prefills a few requests eagerly, then runs
every decode step both through the graph and eagerly and compares the hidden states.

* On CPU the graph is a test double (:class:`RecordedGraph`) that freezes what a capture
  freezes: capturing runs the step once and records its kernels (every aten op, every Triton
  launch, every stand-in kernel wrapped by :func:`as_kernel`) with their arguments; a replay
  runs exactly those kernels again, on the same tensors, with the same scalars and grids. No
  Python of the step runs at replay, so a step that reads host state after the capture (a
  length, a list, a tensor built from Python values) replays what the capture saw and
  disagrees with the eager step, as it would on a GPU; new inputs arrive only through the
  static buffers.
* On CUDA (:func:`gpu_virtual_replay`, :func:`gpu_paged_replay`) the graphs are real
  ``torch.cuda.CUDAGraph`` captures over VMM-backed views, with new pages mapped under them.

Used by ``tests/test_cuda_graphs.py`` and step 3 of the GPU check (``benchmarks/gpu/``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import transformers
from attention_scenarios import ReferenceVarlen  # sets TRITON_INTERPRET without CUDA
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from vmkv.attention.cuda import CudaAttentionBackend
from vmkv.attention.kv_store import store_index_copy, store_triton
from vmkv.executor.cuda_graphs import DecodeGraphRunner
from vmkv.kernels.launch import launch_through
from vmkv.kv import PagedKVCache, VirtualKVCache
from vmkv.memory import PagePool
from vmkv.memory.host import HostMemoryBackend
from vmkv.memory.mapper import BackgroundMapper
from vmkv.models import LlamaModel, ModelConfig

CUDA = torch.cuda.is_available()
#: decode steps of the scenarios: which requests decode one token each (buckets 4, 4, 6, 1, 2)
PLAN = [["a", "b", "c"], ["a", "b", "c"], ["c", "a", "b", "d", "e"], ["e"], ["b", "d"]]


#: ops that read device data on the host: a capture refuses them ("operation not permitted when
#: stream is capturing"), and so does the double
_HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
               torch.ops.aten.equal.default, torch.ops.aten.nonzero.default}


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _copy_into(captured: Any, result: Any, which: list[bool] | None = None) -> None:
    """Copy each tensor of ``result`` into the tensor at the same place of ``captured`` (only
    where ``which`` says so, when given)."""
    leaves = zip(pytree.tree_leaves(captured), pytree.tree_leaves(result), strict=True)
    for i, (old, new) in enumerate(leaves):
        if isinstance(old, torch.Tensor) and (which is None or which[i]):
            old.copy_(new)


class KernelTape(TorchDispatchMode):
    """While active, records every kernel a step runs, as a CUDA graph capture does: each aten
    op (what launches one kernel on a GPU) with its arguments, each Triton launch through
    :func:`vmkv.kernels.launch.launch`, and each call of a function wrapped by
    :func:`as_kernel`. Tensors are kept by reference (a kernel holds pointers), everything else
    by the value it had (a kernel's scalar arguments and grid are fixed at capture)."""

    active: KernelTape | None = None

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Callable[[], None]] = []

    def __enter__(self) -> KernelTape:
        KernelTape.active = self
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        KernelTape.active = None
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if func in _HOST_READS:
            raise RuntimeError(f"{func} reads device data on the host: not permitted while a "
                               "CUDA graph is captured")
        args, kwargs = pytree.tree_map(lambda x: x, (args, kwargs or {}))  # own containers
        out = func(*args, **kwargs)
        if any(a.alias_info is not None and a.alias_info.is_write
               for a in func._schema.arguments):
            self.calls.append(lambda: func(*args, **kwargs))  # in place: run it again
            return out
        inputs = {_storage(t) for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        fresh = [isinstance(t, torch.Tensor) and _storage(t) not in inputs
                 for t in pytree.tree_leaves(out)]
        if any(fresh) and "empty" not in func.overloadpacket.__name__:
            # recomputed into the tensors the capture allocated; views of an input and bare
            # allocations launch no kernel
            self.calls.append(lambda: _copy_into(out, func(*args, **kwargs), fresh))
        return out

    def opaque(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` as one kernel: unrecorded inside, repeated whole at replay."""
        with _disable_current_modes():
            out = fn(*args, **kwargs)
        self.calls.append(lambda: _copy_into(out, fn(*args, **kwargs)))
        return out

    def launch(self, kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...],
               constexprs: dict[str, Any]) -> None:
        """A Triton launch (the seam's runner while capturing)."""
        self.opaque(lambda: kernel[grid](*args, **constexprs))


def as_kernel(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a stand-in for a GPU kernel, such as :class:`ReferenceVarlen`) as one kernel
    for :class:`KernelTape`: what it reads is read again at every replay, like a kernel reads
    device memory; outside a capture it is ``fn``."""

    def call(*args: Any, **kwargs: Any) -> Any:
        tape = KernelTape.active
        return fn(*args, **kwargs) if tape is None else tape.opaque(fn, *args, **kwargs)

    return call


class RecordedGraph:
    """CPU stand-in for a CUDA graph (see the module docstring): capture runs ``fn`` once
    under a :class:`KernelTape`; replay runs the recorded kernels again, nothing else."""

    def __init__(self, on_capture: Callable[[], Any] | None = None) -> None:
        self.on_capture = on_capture
        self.calls: list[Callable[[], None]] = []

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run ``fn`` once, recording its kernels; its output tensor is the graph's."""
        if self.on_capture is not None:
            self.on_capture()
        tape = KernelTape()
        with tape, launch_through(tape.launch):
            out = fn()
        self.calls = tape.calls
        return out

    def replay(self) -> None:
        """Run the captured kernels, with the arguments they were captured with."""
        for call in self.calls:
            call()


def tiny_model(dtype: torch.dtype, device: str, *, layers: int = 2, head_dim: int = 32
               ) -> tuple[LlamaModel, ModelConfig]:
    """A random-weight vmkv Llama (4 heads, 2 KV heads) small enough for interpreted kernels."""
    hf = transformers.LlamaConfig(vocab_size=128, hidden_size=4 * head_dim,
                                  intermediate_size=256, num_hidden_layers=layers,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=2048)
    cfg = ModelConfig.from_hf(hf)
    model = LlamaModel(cfg, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.05 * noise)
    return model, cfg


def eager(model: LlamaModel, attn: Any, rids: list[str], ctx: list[int], qlens: list[int],
          ids: list[int]) -> torch.Tensor:
    """One eager step: request i brings ``qlens[i]`` tokens after ``ctx[i]`` cached ones."""
    meta = attn.prepare(rids, ctx, qlens)
    pos = [p for c, n in zip(ctx, qlens, strict=True) for p in range(c, c + n)]
    dev = model.device
    with torch.inference_mode():
        return model.forward(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev),
                             attn, meta)


def drive(model: LlamaModel, kv: Any, attn: Any, runner: DecodeGraphRunner, *,
          prompts: dict[str, int], decode_plan: list[list[str]], tol: float, seed: int = 0
          ) -> list[int]:
    """Prefill ``prompts`` eagerly, then run each decode step both as a graph and eagerly (the
    eager run rewrites the same K/V rows with the same values) and compare; returns the
    buckets used."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    rids = list(prompts)
    for rid in rids:
        assert kv.allocate(rid, prompts[rid])
    ids = torch.randint(0, vocab, (sum(prompts.values()),), generator=gen).tolist()
    eager(model, attn, rids, [0] * len(rids), [prompts[r] for r in rids], ids)
    buckets = []
    for step in decode_plan:
        ctx = [kv.room.num_tokens(r) for r in step]
        for rid in step:
            assert kv.allocate(rid, 1)
        ids = torch.randint(0, vocab, (len(step),), generator=gen).tolist()
        graph_hidden = runner.run(step, ctx, ids, ctx).clone()
        ref = eager(model, attn, step, ctx, [1] * len(step), ids)
        assert graph_hidden.shape == ref.shape
        err = float((graph_hidden.float() - ref.float()).abs().max() / ref.float().abs().max())
        assert err < tol, (step, err)
        buckets.append(runner.bucket_for(len(step)))
    return buckets


def host_kv(cfg: ModelConfig, dtype: torch.dtype = torch.float16, slots: int = 6
            ) -> VirtualKVCache:
    """A host virtual cache (real mmap, 64 KiB pages) for ``cfg``'s KV shape."""
    pool = PagePool(HostMemoryBackend(64 * 1024, 64), 64)
    return VirtualKVCache(cfg.kv_spec(dtype), pool=pool, num_slots=slots, max_model_len=512)


def virtual_setup(kernel: str, cfg: ModelConfig, dtype: torch.dtype = torch.float16
                  ) -> tuple[VirtualKVCache, CudaAttentionBackend]:
    """A host cache and a virtual CUDA backend on it: ``aten-flash`` through the injected
    reference, any other kernel with the real masked Triton write (interpreted on CPU)."""
    kv = host_kv(cfg, dtype)
    if kernel == "aten-flash":  # the reference and the write each stand for one GPU kernel
        attn = CudaAttentionBackend(kv, kernel, varlen_fn=as_kernel(ReferenceVarlen()),
                                    store=as_kernel(store_index_copy))
    else:
        attn = CudaAttentionBackend(kv, kernel, store=None if CUDA else store_triton)
    return kv, attn


def cpu_replay(case: str) -> None:
    """Capture with the CPU double, then decode steps graph vs eager; ``case`` is
    ``virtual-aten-flash``, ``virtual-triton`` or ``paged-triton``."""
    model, cfg = tiny_model(torch.float16, "cpu")
    mapper = None
    if case.startswith("virtual"):
        kv, attn = virtual_setup(case.removeprefix("virtual-"), cfg)
        # the model's KV (2 layers x 2 heads x 32 x fp16) is 512 B/token: 128 tokens per page
        assert kv.layout.tokens_in(1) == 128
        mapper = BackgroundMapper(kv.backend)
        kv.mapping.attach(mapper)  # closed with the KV manager
    else:
        kv = PagedKVCache(cfg.kv_spec(torch.float16), num_blocks=64, block_size=16,
                          max_model_len=1024)
        attn = CudaAttentionBackend(kv, "triton", store=store_triton)
    assert attn.supports_cuda_graphs
    paused_at_capture: list[bool] = []
    factory = lambda: RecordedGraph(  # noqa: E731
        lambda: paused_at_capture.append(mapper is None or mapper._paused > 0))
    runner = DecodeGraphRunner(model, attn, max_batch_size=6, graph_factory=factory,
                               pause_mapping=kv.mapping.paused)
    runner.capture()
    assert runner.captured == [1, 2, 4, 6] and all(paused_at_capture)
    prompts = {"a": 5, "b": 126, "c": 33, "d": 1, "e": 7}  # b crosses a page after capture
    buckets = drive(model, kv, attn, runner, prompts=prompts, decode_plan=PLAN, tol=2e-2)
    assert buckets == [4, 4, 6, 1, 2] and runner.num_replays == len(PLAN)
    kv.accounting.check()
    kv.mapping.close()


def gpu_virtual_replay(kernel: str) -> None:
    """Real CUDA graphs over VMM-backed views (``aten-flash`` or ``triton``): replay = eager
    while the background mapper maps new pages under the captured graphs."""
    from vmkv.memory.cuda import CudaMemoryBackend

    # 4 layers x 2 kv heads x 64 x bf16 x K,V = 2 KiB/token: 1024 tokens per 2 MiB page
    model, cfg = tiny_model(torch.bfloat16, "cuda", layers=4, head_dim=64)
    backend = CudaMemoryBackend(None, 64)
    kv = VirtualKVCache(cfg.kv_spec(torch.bfloat16), pool=PagePool(backend, 64), num_slots=6,
                        max_model_len=2048)
    attn = CudaAttentionBackend(kv, kernel)
    assert kv.layout.tokens_in(1) == 1024
    kv.mapping.attach(BackgroundMapper(kv.backend))
    runner = DecodeGraphRunner(model, attn, max_batch_size=6, pause_mapping=kv.mapping.paused)
    runner.capture()
    maps_before = kv.backend.stats.ops["map"].calls
    prompts = {"a": 5, "b": 1022, "c": 33, "d": 1, "e": 7}  # b maps a new page mid-decode
    drive(model, kv, attn, runner, prompts=prompts, decode_plan=PLAN, tol=2e-2)
    torch.cuda.synchronize()
    assert kv.backend.stats.ops["map"].calls > maps_before
    kv.accounting.check()
    kv.close()  # its mapper too


def gpu_paged_replay() -> None:
    """Real CUDA graphs over a paged cache (the Triton paged twin): replay = eager."""
    model, cfg = tiny_model(torch.bfloat16, "cuda", layers=4, head_dim=64)
    kv = PagedKVCache(cfg.kv_spec(torch.bfloat16), num_blocks=256, block_size=16,
                      max_model_len=2048, device="cuda")
    attn = CudaAttentionBackend(kv)
    runner = DecodeGraphRunner(model, attn, max_batch_size=6)
    runner.capture()
    drive(model, kv, attn, runner, prompts={"a": 5, "b": 300, "c": 33, "d": 1, "e": 7},
          decode_plan=PLAN, tol=2e-2)
