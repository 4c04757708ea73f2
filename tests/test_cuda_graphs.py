"""Decode CUDA graphs: buckets, padding, static-buffer plumbing, mapper pause.

On CPU the graph itself is a test double (:class:`ReplayByRerun`): "replay" re-runs the
function captured at start-up and copies its result into the output tensor captured then. That
is a faithful stand-in for what matters here: a replay only sees new inputs through the static
buffers, so if anything the captured step reads were fixed at capture time (a host int, the
dummy request list, a tensor built outside the static buffer), replay would disagree with the
eager step and the test fails. The kernels are the real ones (Triton under TRITON_INTERPRET=1,
or the injected FlashAttention reference of test_attention_cuda). Real ``torch.cuda.CUDAGraph``
capture and replay run only in the ``gpu`` tests below.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_attention_cuda import ReferenceVarlen, run_child  # sets TRITON_INTERPRET
from triton_required import needs_triton

from vmkv.attention.kv_store import store_index_copy, store_triton
from vmkv.attention.paged_cuda import PagedCudaBackend
from vmkv.attention.virtual_cuda import VirtualCudaBackend
from vmkv.engine.cuda_graphs import (
    DecodeGraphRunner,
    default_batch_sizes,
    maybe_create_graph_runner,
)
from vmkv.kv import PagedKVCache, VirtualKVCache
from vmkv.memory import PagePool
from vmkv.memory.host import HostMemoryBackend
from vmkv.memory.mapper import BackgroundMapper
from vmkv.models import LlamaModel, ModelConfig

CUDA = torch.cuda.is_available()
transformers = pytest.importorskip("transformers")


class ReplayByRerun:
    """CPU stand-in for a CUDA graph (see the module docstring)."""

    def __init__(self, on_capture=None) -> None:  # type: ignore[no-untyped-def]
        self.on_capture = on_capture

    def capture(self, fn):  # type: ignore[no-untyped-def]
        if self.on_capture is not None:
            self.on_capture()
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        self.out.copy_(self.fn())


def tiny_model(dtype: torch.dtype, device: str, *, layers: int = 2, head_dim: int = 32
               ) -> tuple[LlamaModel, ModelConfig]:
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


def eager(model: LlamaModel, attn, rids: list[str], ctx: list[int], qlens: list[int],
          ids: list[int]) -> torch.Tensor:
    meta = attn.prepare(rids, ctx, qlens)
    pos = [p for c, n in zip(ctx, qlens, strict=True) for p in range(c, c + n)]
    dev = model.device
    with torch.inference_mode():
        return model.forward(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev),
                             attn, meta)


def drive(model: LlamaModel, kv, attn, runner: DecodeGraphRunner, *, prompts: dict[str, int],
          decode_plan: list[list[str]], tol: float, seed: int = 0) -> list[int]:
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
        ctx = [kv.num_tokens(r) for r in step]
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


PLAN = [["a", "b", "c"], ["a", "b", "c"], ["c", "a", "b", "d", "e"], ["e"], ["b", "d"]]


def test_batch_sizes_and_buckets() -> None:
    assert default_batch_sizes(1) == [1]
    assert default_batch_sizes(6) == [1, 2, 4, 6]
    assert default_batch_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    with pytest.raises(ValueError):
        default_batch_sizes(0)
    model, cfg = tiny_model(torch.float16, "cpu")
    kv, attn = _virtual_setup("aten-flash", cfg)
    runner = DecodeGraphRunner(model, attn, max_batch_size=6, graph_factory=ReplayByRerun)
    assert [runner.bucket_for(n) for n in (1, 2, 3, 5, 6, 7)] == [1, 2, 4, 6, 6, None]
    assert runner.can_run([1, 1, 1]) and not runner.can_run([1, 2]) and not runner.can_run([])
    assert not runner.can_run([1] * 7)
    with pytest.raises(ValueError, match="reach 6"):
        DecodeGraphRunner(model, attn, max_batch_size=6, batch_sizes=[1, 2])
    with pytest.raises(ValueError, match="no captured graph"):
        runner.run(["a"], [0], [1], [0])


def host_kv(cfg: ModelConfig, dtype: torch.dtype = torch.float16, slots: int = 6
            ) -> VirtualKVCache:
    """A host virtual cache (real mmap, 64 KiB pages) for ``cfg``'s KV shape."""
    pool = PagePool(HostMemoryBackend(64 * 1024, 64), 64)
    return VirtualKVCache(cfg.kv_spec(dtype), pool=pool, num_slots=slots, max_model_len=512)


def _virtual_setup(kernel: str, cfg: ModelConfig, dtype: torch.dtype = torch.float16
                   ) -> tuple[VirtualKVCache, VirtualCudaBackend]:
    kv = host_kv(cfg, dtype)
    if kernel == "aten-flash":
        attn = VirtualCudaBackend(kv, kernel, varlen_fn=ReferenceVarlen(),
                                  store=store_index_copy)
    else:  # the real masked Triton write (interpreted on CPU), as on CUDA
        attn = VirtualCudaBackend(kv, kernel, store=None if CUDA else store_triton)
    return kv, attn


@pytest.mark.skipif(CUDA, reason="CPU double of the graph (GPU: test_gpu_graphs_*)")
@pytest.mark.parametrize("case", [
    "virtual-aten-flash",
    pytest.param("virtual-triton", marks=needs_triton),
    pytest.param("paged-triton", marks=needs_triton),
])
def test_replay_through_static_buffers_equals_eager(case: str) -> None:
    proc = run_child("_replay_scenario", case, module="test_cuda_graphs")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"


def _replay_scenario(case: str) -> None:
    """Child-process body: capture (CPU double), then decode steps graph vs eager."""
    model, cfg = tiny_model(torch.float16, "cpu")
    mapper = None
    if case.startswith("virtual"):
        kv, attn = _virtual_setup(case.removeprefix("virtual-"), cfg)
        # the model's KV (2 layers x 2 heads x 32 x fp16) is 512 B/token: 128 tokens per page
        assert kv.layout.tokens_in(1) == 128
        mapper = BackgroundMapper(kv.backend)
    else:
        kv = PagedKVCache(cfg.kv_spec(torch.float16), num_blocks=64, block_size=16,
                          max_model_len=1024)
        attn = PagedCudaBackend(kv, "triton", store=store_triton)
    assert attn.supports_cuda_graphs
    paused_at_capture: list[bool] = []
    factory = lambda: ReplayByRerun(  # noqa: E731
        lambda: paused_at_capture.append(mapper is None or mapper._paused > 0))
    runner = DecodeGraphRunner(model, attn, max_batch_size=6, graph_factory=factory,
                               mapper=mapper)
    runner.capture()
    assert runner.captured == [1, 2, 4, 6] and all(paused_at_capture)
    prompts = {"a": 5, "b": 126, "c": 33, "d": 1, "e": 7}  # b crosses a page after capture
    buckets = drive(model, kv, attn, runner, prompts=prompts, decode_plan=PLAN, tol=2e-2)
    assert buckets == [4, 4, 6, 1, 2] and runner.num_replays == len(PLAN)
    kv.check()
    if mapper is not None:
        mapper.close()


def test_capture_pauses_the_mapper_and_drops_its_work() -> None:
    model, cfg = tiny_model(torch.float16, "cpu")
    kv, attn = _virtual_setup("aten-flash", cfg)
    mapper = BackgroundMapper(kv.backend)
    dropped: list[int] = []
    factory = lambda: ReplayByRerun(  # noqa: E731
        lambda: dropped.append(mapper.submit([lambda: None])))
    runner = DecodeGraphRunner(model, attn, max_batch_size=2, graph_factory=factory,
                               mapper=mapper)
    runner.capture()
    assert dropped == [0, 0] and mapper.stats.units_dropped == 2
    assert mapper.submit([lambda: None]) == 1  # resumed after the capture
    mapper.wait()
    mapper.close()


def test_a_step_with_a_different_layout_is_refused() -> None:
    model, cfg = tiny_model(torch.float16, "cpu")
    kv, attn = _virtual_setup("aten-flash", cfg)
    runner = DecodeGraphRunner(model, attn, max_batch_size=2, graph_factory=ReplayByRerun)
    runner.capture()
    assert kv.allocate("a", 3)
    original = attn.build_step

    def extra_field(*args, **kwargs):  # type: ignore[no-untyped-def]
        step = original(*args, **kwargs)
        step.arrays["surprise"] = np.zeros(1, np.int32)
        return step

    attn.build_step = extra_field  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="differs from the captured one"):
        runner.run(["a"], [2], [1], [2])


def test_backends_that_cannot_be_captured_are_refused(caplog: pytest.LogCaptureFixture) -> None:
    model, cfg = tiny_model(torch.float32, "cpu")
    kv, attn = _virtual_setup("sdpa", cfg, torch.float32)
    assert not attn.supports_cuda_graphs
    with pytest.raises(ValueError, match="cannot be captured"):
        DecodeGraphRunner(model, attn, max_batch_size=2, graph_factory=ReplayByRerun)
    assert maybe_create_graph_runner(model, attn, max_batch_size=2) is None  # CPU model
    # a CUDA model with this backend: refused with a warning, before anything is captured
    # (a stand-in for the model: only its device is read on this path; no GPU here)
    cuda_model = SimpleNamespace(device=torch.device("cuda"))
    with caplog.at_level(logging.WARNING, logger="vmkv"):
        assert maybe_create_graph_runner(cuda_model, attn, max_batch_size=2) is None
    assert "cannot be captured" in caplog.text


class CaptureFails:
    """A graph whose capture fails as torch's does: the kernel's error, then ``graph.__exit__``
    ending the capture raises a stream-capture error chained over it."""

    def capture(self, fn):  # type: ignore[no-untyped-def]
        try:
            raise ValueError("Pointer argument (at 2) cannot be accessed from Triton (cpu tensor?)")
        except ValueError:
            raise RuntimeError("CUDA error: operation not permitted when stream is "  # noqa: B904
                               "capturing")  # chained implicitly (__context__), like torch

    def replay(self) -> None:
        raise AssertionError("never captured")


def test_a_failed_capture_logs_its_cause_and_leaves_steps_eager(
        caplog: pytest.LogCaptureFixture) -> None:
    model, cfg = tiny_model(torch.float16, "cpu")
    kv, attn = _virtual_setup("aten-flash", cfg)
    mapper = BackgroundMapper(kv.backend)
    # a CUDA model as far as the factory looks (its device); the forward runs on the CPU
    cuda_model = SimpleNamespace(device=torch.device("cuda"), forward=model.forward)
    with caplog.at_level(logging.WARNING, logger="vmkv"):
        runner = maybe_create_graph_runner(cuda_model, attn, max_batch_size=2, mapper=mapper,
                                           graph_factory=CaptureFails)
    assert runner is None
    assert ("capturing the decode steps failed: ValueError: Pointer argument (at 2) cannot be "
            "accessed from Triton (cpu tensor?) (surfaced as: RuntimeError: CUDA error: "
            "operation not permitted when stream is capturing); every step runs eagerly"
            ) in caplog.text
    assert mapper.submit([lambda: None]) == 1  # not left paused
    mapper.wait()
    mapper.close()
    assert kv.allocate("a", 3)  # an eager step still runs
    eager(model, attn, ["a"], [0], [3], [1, 2, 3])
    kv.free("a")
    kv.check()


# -- GPU: real CUDA graphs ----------------------------------------------------------------------
def _cuda_virtual(cfg: ModelConfig, kernel: str) -> tuple[VirtualKVCache, VirtualCudaBackend]:
    from vmkv.memory.cuda import CudaMemoryBackend

    spec = cfg.kv_spec(torch.bfloat16)
    backend = CudaMemoryBackend(None, 64)
    kv = VirtualKVCache(spec, pool=PagePool(backend, 64), num_slots=6, max_model_len=2048)
    return kv, VirtualCudaBackend(kv, kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["aten-flash", "triton"])
def test_gpu_graphs_virtual_replay_equals_eager_while_pages_are_mapped(kernel: str) -> None:
    # 4 layers x 2 kv heads x 64 x bf16 x K,V = 2 KiB/token: 1024 tokens per 2 MiB page
    model, cfg = tiny_model(torch.bfloat16, "cuda", layers=4, head_dim=64)
    kv, attn = _cuda_virtual(cfg, kernel)
    assert kv.layout.tokens_in(1) == 1024
    mapper = BackgroundMapper(kv.backend)
    runner = DecodeGraphRunner(model, attn, max_batch_size=6, mapper=mapper)
    runner.capture()
    maps_before = kv.backend.stats.ops["map"].calls
    prompts = {"a": 5, "b": 1022, "c": 33, "d": 1, "e": 7}  # b maps a new page mid-decode
    drive(model, kv, attn, runner, prompts=prompts, decode_plan=PLAN, tol=2e-2)
    torch.cuda.synchronize()
    assert kv.backend.stats.ops["map"].calls > maps_before
    kv.check()
    mapper.close()
    kv.close()


@pytest.mark.gpu
def test_gpu_graphs_paged_replay_equals_eager() -> None:
    model, cfg = tiny_model(torch.bfloat16, "cuda", layers=4, head_dim=64)
    kv = PagedKVCache(cfg.kv_spec(torch.bfloat16), num_blocks=256, block_size=16,
                      max_model_len=2048, device="cuda")
    attn = PagedCudaBackend(kv)
    runner = DecodeGraphRunner(model, attn, max_batch_size=6)
    runner.capture()
    drive(model, kv, attn, runner, prompts={"a": 5, "b": 300, "c": 33, "d": 1, "e": 7},
          decode_plan=PLAN, tol=2e-2)
