"""Every tensor vmkv hands to a kernel has a mapped base address (the anchor slot).

Triton's launcher asks the driver about the pointer of each tensor argument and refuses the
launch when nothing is mapped there, even if the kernel would never read that address. Each
layer's K/V view starts at the first page of its region, so that page must be mapped whenever a
kernel can run. The CUDA backend runs here on the fake driver (``tests/fake_cuda_driver.py``):
real host memory at the addresses it manages, and a pointer query that fails on unmapped VA as
the real driver's does; every launch goes through :func:`vmkv.kernels.launch.launch` with that
query installed as Triton's check.

Reproduction of the defect: on commit d8357b7 (before the anchor slot), with this file, the fake
driver and the launch seam added, the state machines failed on the first invariant check of a
fresh cache, before any request existed::

    ValueError: Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)
    Failing test case: <state machine>
    state = AnyOpSequence()
    state.kernel_arguments_have_mapped_bases()
    state.teardown()

and ``test_a_real_triton_step_with_slot_zero_idle`` failed in the K/V store of the decode step
after the request in the first slot had finished and its pages were unmapped::

    File "tests/test_kernel_pointers.py", line 237, in _triton_step
        step(["b"], [40], [1])  # decode with the first request's slot idle and unmapped
    ...
    ValueError: Pointer argument (at 2) cannot be accessed from Triton (cpu tensor?)
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when Triton kernels are decorated (import)

from attention_scenarios import run_child  # noqa: E402
from fake_cuda_driver import FakeDriver, SimulatedCudaBackend, triton_pointer_guard  # noqa: E402
from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    rule,
    run_state_machine_as_test,
)
from skip_policy import cpu_only  # noqa: E402
from triton_required import needs_triton  # noqa: E402

from vmkv.attention.cuda import CudaAttentionBackend  # noqa: E402
from vmkv.attention.kv_store import (  # noqa: E402
    default_store,
    store_index_copy,
    store_triton,
    triton_usable,
)
from vmkv.kernels.launch import launch, pointer_guard  # noqa: E402
from vmkv.kv import KVSpec, VirtualKVCache  # noqa: E402
from vmkv.memory import PagePool, VirtualRegion  # noqa: E402

GRAN = 16 << 10  # the fake driver's granularity: small pages, few tokens each
SPEC = KVSpec(num_layers=2, num_kv_heads=4, head_dim=16, dtype=torch.float16)  # 512 B/token
SLOTS = 4
MAX_LEN = 256
PROMPTS = [np.random.default_rng(i).integers(3, 500, MAX_LEN).tolist() for i in range(3)]


class RecordingKernel:
    """A kernel object with Triton's launch syntax that only records (the checks come first)."""

    def __init__(self) -> None:
        self.launches = 0

    def __getitem__(self, grid: tuple[int, ...]):  # type: ignore[no-untyped-def]
        def run(*args: object, **constexprs: object) -> None:
            self.launches += 1

        return run


def simulated_cuda_cache(layout: str, *, pages: int = 48, max_idle_pages: int | None = None,
                         prefix: bool = True) -> tuple[VirtualKVCache, FakeDriver]:
    """A virtual KV cache on the real CUDA backend over the fake driver (CPU tensors)."""
    driver = FakeDriver(GRAN)
    backend = SimulatedCudaBackend(None, pages, driver=driver)
    backend.device = torch.device("cpu")  # the simulated device memory is host memory
    regions = 1 if layout == "all-layers" else 2 * SPEC.num_layers
    pool = PagePool(backend, pages, partitions=regions, max_idle_pages=max_idle_pages)
    kv = VirtualKVCache(SPEC, pool=pool, num_slots=SLOTS, max_model_len=MAX_LEN, layout=layout,
                        max_idle_pages=max_idle_pages, enable_prefix_caching=prefix)
    return kv, driver


def launch_with_every_kv_tensor(attn: CudaAttentionBackend, driver: FakeDriver) -> None:
    """Launch a kernel with every K/V tensor the attention backend passes to kernels (the slot
    views and their flat row views of every layer), under the driver's pointer check."""
    kernel = RecordingKernel()
    tensors = [t for layer in range(SPEC.num_layers)
               for t in (*attn._views[layer], *attn.flat_kv(layer))]
    with pointer_guard(triton_pointer_guard(driver)):
        launch(kernel, (1,), *tensors)
    assert kernel.launches == 1


def test_the_guard_refuses_a_tensor_whose_base_is_unmapped() -> None:
    """The fake driver and the seam fail exactly as Triton does on a GPU."""
    driver = FakeDriver(GRAN)
    backend = SimulatedCudaBackend(None, 4, driver=driver)
    pool = PagePool(backend, 4)
    region = VirtualRegion(pool, 4 * GRAN)
    region.map_new(1, 1)  # the second page only
    data = region.as_bytes()  # the wrap anchors a scratch page just for itself
    kernel = RecordingKernel()
    with pointer_guard(triton_pointer_guard(driver)):
        launch(kernel, (1,), data[GRAN:])  # a mapped base: fine
        with pytest.raises(ValueError, match=r"Pointer argument \(at 1\) cannot be accessed "
                                             r"from Triton \(cpu tensor\?\)"):
            launch(kernel, (1,), data[GRAN:], data)
    assert kernel.launches == 1
    launch(kernel, (1,), data)  # no guard installed: the seam launches as it is
    region.close()
    pool.release_all_idle()


class AnyOpSequence(RuleBasedStateMachine):
    """Random allocate / grow / free / fork / swap / prefix-hit sequences, under memory
    pressure (reclaim of idle slots and tails, eviction of cached pages)."""

    layout = "all-layers"
    max_idle_pages: int | None = None
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.kv, self.driver = simulated_cuda_cache(self.layout,
                                                    max_idle_pages=self.max_idle_pages)
        self.attn = CudaAttentionBackend(self.kv, "sdpa")
        self.prompt_of: dict[str, list[int]] = {}
        self.counter = 0

    def _new_id(self) -> str:
        self.counter += 1
        return f"r{self.counter}"

    @rule(target=requests, which=st.integers(0, len(PROMPTS) - 1), n=st.integers(1, MAX_LEN))
    def add(self, which: int, n: int) -> str:
        rid = self._new_id()
        if len(self.kv.room.request_ids()) >= SLOTS:
            return rid
        tokens = PROMPTS[which][:n]
        cached = self.kv.prefix.match(rid, tokens)  # a prefix hit maps cached pages
        if self.kv.allocate(rid, n - cached):
            self.kv.prefix.publish(rid, tokens, n)
            self.prompt_of[rid] = tokens
        elif cached:
            self.kv.free(rid)
        return rid

    @rule(rid=requests, n=st.integers(1, 64))
    def grow(self, rid: str, n: int) -> None:
        if rid in self.prompt_of and self.kv.room.num_tokens(rid) + n <= MAX_LEN:
            self.kv.allocate(rid, n)

    @rule(target=requests, rid=requests)
    def fork(self, rid: str) -> str:
        child = self._new_id()
        if rid in self.prompt_of and self.kv.fork(rid, child):
            self.prompt_of[child] = self.prompt_of[rid]
        return child

    @rule(rid=requests)
    def swap(self, rid: str) -> None:
        if rid not in self.prompt_of:
            return
        swapped = self.kv.swap.out(rid)
        if not self.kv.swap.back(rid, swapped):
            del self.prompt_of[rid]

    @rule(rid=consumes(requests))
    def free(self, rid: str) -> None:
        if rid in self.prompt_of:
            self.kv.free(rid)
            del self.prompt_of[rid]

    @invariant()
    def kernel_arguments_have_mapped_bases(self) -> None:
        launch_with_every_kv_tensor(self.attn, self.driver)
        self.kv.accounting.check()

    def teardown(self) -> None:
        for rid in list(self.prompt_of):
            self.kv.free(rid)
        self.kv.close()
        self.kv.backend.close()
        assert not self.driver.maps and not self.driver.handles
        assert not self.driver.reservations


class AnyOpSequencePerLayerNoIdle(AnyOpSequence):
    layout = "per-layer"
    max_idle_pages = 0  # idle slots are unmapped eagerly: the first slot's pages come and go


def _run_machine(layout: str) -> None:
    """Child-process body (a failing check would make pytest print VA-backed tensors, touching
    unmapped pages, and kill the whole run)."""
    machine = AnyOpSequence if layout == "all-layers" else AnyOpSequencePerLayerNoIdle
    run_state_machine_as_test(machine, settings=settings(max_examples=30, deadline=None,
                                                         stateful_step_count=25))


@pytest.mark.parametrize("layout", ["all-layers", "per-layer"])
def test_any_op_sequence_keeps_kernel_bases_mapped(layout: str) -> None:
    proc = run_child("test_kernel_pointers", "_run_machine", layout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"


@needs_triton
@pytest.mark.parametrize("layout", ["all-layers", "per-layer"])
def test_a_real_triton_step_with_slot_zero_idle(layout: str) -> None:
    """The real Triton K/V store and decode/prefill twins, launched through the seam with the
    driver's pointer check, on a fresh cache and after the first request's pages are gone."""
    proc = run_child("test_kernel_pointers", "_triton_step", layout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"


def _triton_step(layout: str) -> None:
    kv, driver = simulated_cuda_cache(layout, max_idle_pages=0, prefix=False)
    attn = CudaAttentionBackend(kv, "triton", store=store_triton)  # the Triton write on CPU too
    gen = torch.Generator().manual_seed(0)

    def step(rids: list[str], ctx: list[int], qlens: list[int]) -> None:
        for rid, n in zip(rids, qlens, strict=True):
            assert kv.allocate(rid, n)
        meta = attn.prepare(rids, ctx, qlens)
        total = sum(qlens)
        q = torch.randn(total, 8, SPEC.head_dim, generator=gen).half()
        k, v = (torch.randn(total, SPEC.num_kv_heads, SPEC.head_dim, generator=gen).half()
                for _ in range(2))
        out = attn.forward(0, q, k, v, meta, SPEC.head_dim**-0.5)
        assert torch.isfinite(out).all()

    with pointer_guard(triton_pointer_guard(driver)):
        step(["a", "b"], [0, 0], [5, 40])  # prefill, fresh cache
        kv.free("a")  # max_idle_pages=0: its pages are unmapped at once
        step(["b"], [40], [1])  # decode with the first request's slot idle and unmapped
        step(["c", "b"], [0, 41], [3, 1])
    kv.free("b")
    kv.free("c")
    kv.accounting.check()
    kv.close()


@cpu_only  # a device where Triton cannot launch: here, none at all
def test_triton_that_cannot_launch_means_the_torch_paths_with_one_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    """An import is not enough: Triton must launch a kernel on the device (here none exists, as
    on a GPU machine whose Triton cannot build its launcher without a C compiler)."""
    cuda = torch.device("cuda")
    triton_usable.cache_clear()
    with caplog.at_level(logging.WARNING, logger="vmkv"):
        assert not triton_usable(cuda) and not triton_usable(cuda)
        assert default_store(cuda) == (store_index_copy, False)
    warnings = [r for r in caplog.records if "cannot launch a kernel on cuda" in r.message]
    assert len(warnings) == 1 and "using the torch paths instead" in warnings[0].message
    assert triton_usable(torch.device("cpu"))  # CPU tensors: the interpreter (tests)
    triton_usable.cache_clear()
