"""Decode CUDA graphs: buckets, padding, static-buffer plumbing, mapper pause.

On CPU the graph is a test double (``graph_scenarios.RecordedGraph``) that freezes what a
capture freezes: the kernels a capture ran, with their arguments, are what a replay runs; new
inputs arrive only through the static buffers, so anything baked in at capture time, or read
from Python state afterwards, fails the replay = eager comparison (shown by a planted read
below). The kernels are the real ones (Triton under TRITON_INTERPRET=1, or the
injected FlashAttention reference). Real ``torch.cuda.CUDAGraph`` capture and replay run only
in the ``gpu`` tests below. The scenarios live in ``graph_scenarios`` (pytest-free: the GPU
check runs them too).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from attention_scenarios import run_child  # sets TRITON_INTERPRET without CUDA
from graph_scenarios import (
    RecordedGraph,
    eager,
    gpu_paged_replay,
    gpu_virtual_replay,
    tiny_model,
    virtual_setup,
)
from skip_policy import cpu_only
from triton_required import needs_triton

from vmkv.executor.cuda_graphs import (
    DecodeGraphRunner,
    default_batch_sizes,
    maybe_create_graph_runner,
)
from vmkv.memory.mapper import BackgroundMapper

CUDA = torch.cuda.is_available()


def test_batch_sizes_and_buckets() -> None:
    assert default_batch_sizes(1) == [1]
    assert default_batch_sizes(6) == [1, 2, 4, 6]
    assert default_batch_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    with pytest.raises(ValueError):
        default_batch_sizes(0)
    model, cfg = tiny_model(torch.float16, "cpu")
    kv, attn = virtual_setup("aten-flash", cfg)
    runner = DecodeGraphRunner(model, attn, max_batch_size=6, graph_factory=RecordedGraph)
    assert [runner.bucket_for(n) for n in (1, 2, 3, 5, 6, 7)] == [1, 2, 4, 6, 6, None]
    assert runner.can_run([1, 1, 1]) and not runner.can_run([1, 2]) and not runner.can_run([])
    assert not runner.can_run([1] * 7)
    with pytest.raises(ValueError, match="reach 6"):
        DecodeGraphRunner(model, attn, max_batch_size=6, batch_sizes=[1, 2])
    with pytest.raises(ValueError, match="no captured graph"):
        runner.run(["a"], [0], [1], [0])


@cpu_only  # the CPU double of the graph (GPU: test_gpu_graphs_*)
@pytest.mark.parametrize("case", [
    "virtual-aten-flash",
    pytest.param("virtual-triton", marks=needs_triton),
    pytest.param("paged-triton", marks=needs_triton),
])
def test_replay_through_static_buffers_equals_eager(case: str) -> None:
    proc = run_child("graph_scenarios", "cpu_replay", case)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"


def _decode_graph_vs_eager(plant: bool) -> float:
    """One decode step of two requests through a captured graph and eagerly; the largest
    difference. ``plant``: the attention reads the sequence lengths from Python state (the
    host array of the latest step built) instead of the step's device tensor."""
    model, cfg = tiny_model(torch.float16, "cpu")
    kv, attn = virtual_setup("aten-flash", cfg)
    if plant:
        build_step, kernel = attn.build_step, attn._kernel

        def remembering(*args, **kwargs):  # type: ignore[no-untyped-def]
            step = build_step(*args, **kwargs)
            attn.host_seq_lens = step.arrays["seq_lens"]  # type: ignore[attr-defined]
            return step

        def reading_host_state(layer, q, meta, scale):  # type: ignore[no-untyped-def]
            lens = torch.from_numpy(attn.host_seq_lens)  # type: ignore[attr-defined]
            return kernel(layer, q, replace(meta, seq_lens=lens), scale)

        attn.build_step, attn._kernel = remembering, reading_host_state  # type: ignore
    runner = DecodeGraphRunner(model, attn, max_batch_size=2, graph_factory=RecordedGraph)
    runner.capture()
    assert kv.allocate("a", 5) and kv.allocate("b", 9)
    eager(model, attn, ["a", "b"], [0, 0], [5, 9], list(range(3, 17)))
    assert kv.allocate("a", 1) and kv.allocate("b", 1)
    graph = runner.run(["a", "b"], [5, 9], [20, 21], [5, 9]).clone()
    ref = eager(model, attn, ["a", "b"], [5, 9], [1, 1], [20, 21])
    return float((graph.float() - ref.float()).abs().max())


def test_the_graph_double_catches_a_replay_time_read_of_python_state() -> None:
    """A real graph replays the kernels of its capture with the arguments they had then; the
    double does the same, so a forward that reads Python state after the capture (planted
    here) gives a replay that differs from the eager step, as it would on a GPU. (A double
    that re-ran the Python of the step on each replay passed it.)"""
    assert _decode_graph_vs_eager(plant=False) == 0.0
    assert _decode_graph_vs_eager(plant=True) > 0.1  # the capture's lengths (0): no keys read


def test_capture_pauses_the_mapper_and_drops_its_work() -> None:
    model, cfg = tiny_model(torch.float16, "cpu")
    kv, attn = virtual_setup("aten-flash", cfg)
    mapper = BackgroundMapper(kv.backend)
    kv.mapping.attach(mapper)  # the KV manager owns it; the runner pauses it through the KV
    dropped: list[int] = []
    factory = lambda: RecordedGraph(  # noqa: E731
        lambda: dropped.append(mapper.submit([lambda: None])))
    runner = DecodeGraphRunner(model, attn, max_batch_size=2, graph_factory=factory,
                               pause_mapping=kv.mapping.paused)
    runner.capture()
    assert dropped == [0, 0] and mapper.stats.units_dropped == 2
    assert mapper.submit([lambda: None]) == 1  # resumed after the capture
    mapper.wait()
    kv.mapping.close()


def test_a_step_with_a_different_layout_is_refused() -> None:
    model, cfg = tiny_model(torch.float16, "cpu")
    kv, attn = virtual_setup("aten-flash", cfg)
    runner = DecodeGraphRunner(model, attn, max_batch_size=2, graph_factory=RecordedGraph)
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
    kv, attn = virtual_setup("sdpa", cfg, torch.float32)
    assert not attn.supports_cuda_graphs
    with pytest.raises(ValueError, match="cannot be captured"):
        DecodeGraphRunner(model, attn, max_batch_size=2, graph_factory=RecordedGraph)
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
    kv, attn = virtual_setup("aten-flash", cfg)
    mapper = BackgroundMapper(kv.backend)
    kv.mapping.attach(mapper)
    # a CUDA model as far as the factory looks (its device); the forward runs on the CPU
    cuda_model = SimpleNamespace(device=torch.device("cuda"), forward=model.forward)
    with caplog.at_level(logging.WARNING, logger="vmkv"):
        runner = maybe_create_graph_runner(cuda_model, attn, max_batch_size=2,
                                           pause_mapping=kv.mapping.paused,
                                           graph_factory=CaptureFails)
    assert runner is None
    assert ("capturing the decode steps failed: ValueError: Pointer argument (at 2) cannot be "
            "accessed from Triton (cpu tensor?) (surfaced as: RuntimeError: CUDA error: "
            "operation not permitted when stream is capturing); every step runs eagerly"
            ) in caplog.text
    assert mapper.submit([lambda: None]) == 1  # not left paused
    mapper.wait()
    kv.mapping.close()
    assert kv.allocate("a", 3)  # an eager step still runs
    eager(model, attn, ["a"], [0], [3], [1, 2, 3])
    kv.free("a")
    kv.accounting.check()


# -- GPU: real CUDA graphs ----------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["aten-flash", "triton"])
def test_gpu_graphs_virtual_replay_equals_eager_while_pages_are_mapped(kernel: str) -> None:
    gpu_virtual_replay(kernel)


@pytest.mark.gpu
def test_gpu_graphs_paged_replay_equals_eager() -> None:
    gpu_paged_replay()
