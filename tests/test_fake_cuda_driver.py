"""The fake CUDA driver (tests/fake_cuda_driver.py) refuses what ``cuda.h`` refuses, with the
documented ``CUresult``, one test per rule; and its memory protection is real (a child process
faults where the device could not read or write)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from fake_cuda_driver import (
    CUmemAccess_flags,
    CUmemAllocationHandleType,
    CUmemAllocationType,
    CUmemLocationType,
    CUresult,
    FakeDriver,
    triton_pointer_guard,
)

GRAN = 64 << 10
OK = CUresult.CUDA_SUCCESS
INVALID = CUresult.CUDA_ERROR_INVALID_VALUE
POINTER = FakeDriver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_POINTER


def ready(device_count: int = 1) -> FakeDriver:
    """A driver after cuInit, with device 0's primary context current in this thread."""
    drv = FakeDriver(GRAN, device_count=device_count)
    assert drv.cuInit(0) == (OK,)
    _, dev = drv.cuDeviceGet(0)
    _, ctx = drv.cuDevicePrimaryCtxRetain(dev)
    assert drv.cuCtxSetCurrent(ctx) == (OK,)
    return drv


def prop(**changes: object) -> SimpleNamespace:
    """A valid allocation prop (pinned, device 0), with ``changes``."""
    p = FakeDriver.CUmemAllocationProp()
    p.type = CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.location.type = CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.location.id = 0
    for name, value in changes.items():
        target, attr = (p.location, name[9:]) if name.startswith("location_") else (p, name)
        setattr(target, attr, value)
    return p


def desc(flags: int = CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
         location_type: int = CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE,
         device: int = 0) -> SimpleNamespace:
    d = FakeDriver.CUmemAccessDesc()
    d.location.type, d.location.id, d.flags = location_type, device, flags
    return d


def mapped(drv: FakeDriver, granules: int = 2) -> tuple[int, int]:
    """A reservation of 4 granules with one handle of ``granules`` mapped at its base."""
    _, base = drv.cuMemAddressReserve(4 * GRAN, 0, 0, 0)
    _, handle = drv.cuMemCreate(granules * GRAN, prop(), 0)
    assert drv.cuMemMap(base, granules * GRAN, 0, handle, 0) == (OK,)
    return int(base), handle


def test_every_call_before_cuinit_is_not_initialized_and_cuinit_takes_flags_0() -> None:
    drv = FakeDriver(GRAN)
    refused = (CUresult.CUDA_ERROR_NOT_INITIALIZED, None)
    assert drv.cuDeviceGet(0) == refused and drv.cuCtxGetCurrent() == refused
    assert drv.cuMemCreate(GRAN, prop(), 0) == refused
    assert drv.cuMemAddressReserve(GRAN, 0, 0, 0) == refused
    assert drv.cuMemGetAllocationGranularity(prop(), 0) == refused
    assert drv.cuInit(1) == (INVALID, None)
    assert drv.cuInit(0) == (OK,) and drv.cuDeviceGet(0)[0] == OK


def test_device_ordinals_must_exist() -> None:
    drv = ready(device_count=2)
    assert drv.cuDeviceGet(1) == (OK, 1)
    for bad in (2, -1):
        assert drv.cuDeviceGet(bad) == (CUresult.CUDA_ERROR_INVALID_DEVICE, None)
    assert drv.cuDevicePrimaryCtxRetain(7) == (CUresult.CUDA_ERROR_INVALID_DEVICE, None)
    assert drv.cuMemCreate(GRAN, prop(location_id=2), 0) == (
        CUresult.CUDA_ERROR_INVALID_DEVICE, None)


def test_the_current_context_is_per_thread() -> None:
    drv = ready()
    _, ctx = drv.cuCtxGetCurrent()
    assert ctx != 0 and drv.cuPointerGetAttribute(POINTER, 0x1000)[0] == OK
    seen: list[tuple] = []

    def elsewhere() -> None:
        seen.append(drv.cuCtxGetCurrent())
        seen.append(drv.cuPointerGetAttribute(POINTER, 0x1000))
        seen.append(drv.cuCtxSetCurrent(ctx))
        seen.append(drv.cuPointerGetAttribute(POINTER, 0x1000)[0])

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert seen == [(OK, 0), (CUresult.CUDA_ERROR_INVALID_CONTEXT, None), (OK,), OK]
    assert drv.cuCtxSetCurrent(12345) == (CUresult.CUDA_ERROR_INVALID_CONTEXT, None)
    assert drv.cuCtxSetCurrent(None) == (OK,) and drv.cuCtxGetCurrent() == (OK, 0)
    assert drv.cuPointerGetAttribute(POINTER, 0x1000) == (
        CUresult.CUDA_ERROR_INVALID_CONTEXT, None)
    with pytest.raises(RuntimeError, match=r"Triton Error \[CUDA\]: "
                                           "CUDA_ERROR_INVALID_CONTEXT"):
        triton_pointer_guard(drv)(0, SimpleNamespace(data_ptr=lambda: 0x1000))


@pytest.mark.parametrize(("changes", "result"), [
    ({"type": 0}, INVALID),
    ({"type": CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_MANAGED}, INVALID),
    ({"location_type": CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST}, INVALID),
    ({"location_type": 0}, INVALID),
    ({"requestedHandleTypes": CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR},
     INVALID),
    ({"location_id": 1}, CUresult.CUDA_ERROR_INVALID_DEVICE),
])
def test_a_bad_prop_is_refused_by_create_and_granularity(changes: dict, result: CUresult
                                                         ) -> None:
    drv = ready()
    assert drv.cuMemGetAllocationGranularity(prop(**changes), 0) == (result, None)
    assert drv.cuMemCreate(GRAN, prop(**changes), 0) == (result, None)
    assert not drv.handles


def test_create_granularity_and_reserve_arguments() -> None:
    drv = ready()
    assert drv.cuMemGetAllocationGranularity(prop(), 1) == (OK, GRAN)  # RECOMMENDED
    assert drv.cuMemGetAllocationGranularity(prop(), 2) == (INVALID, None)
    assert drv.cuMemCreate(GRAN, prop(), 1) == (INVALID, None)  # flags must be 0
    assert drv.cuMemCreate(GRAN + 4096, prop(), 0) == (INVALID, None)  # not a granule multiple
    assert drv.cuMemAddressReserve(1000, 0, 0, 0) == (INVALID, None)  # not a host-page multiple
    assert drv.cuMemAddressReserve(GRAN, 3 * GRAN, 0, 0) == (INVALID, None)  # alignment
    assert drv.cuMemAddressReserve(GRAN, 0, 0, 1) == (INVALID, None)  # flags
    assert not drv.reservations and not drv.handles


def test_map_refuses_an_offset_or_flags_even_in_bounds() -> None:
    drv = ready()
    _, base = drv.cuMemAddressReserve(4 * GRAN, 0, 0, 0)
    _, handle = drv.cuMemCreate(2 * GRAN, prop(), 0)
    assert drv.cuMemMap(base, GRAN, GRAN, handle, 0) == (INVALID, None)  # offset: must be 0
    assert drv.cuMemMap(base, GRAN, 0, handle, 1) == (INVALID, None)  # flags: must be 0
    assert drv.cuMemMap(base, 3 * GRAN, 0, handle, 0) == (INVALID, None)  # past the handle
    assert drv.cuMemMap(int(base) + 4096, GRAN, 0, handle, 0) == (INVALID, None)  # unaligned
    assert drv.cuMemMap(int(base) + 4 * GRAN, GRAN, 0, handle, 0) == (INVALID, None)  # outside
    assert drv.cuMemMap(base, GRAN, 0, 999, 0) == (INVALID, None)  # no such handle
    assert not drv.maps
    assert drv.cuMemMap(base, GRAN, 0, handle, 0) == (OK,)
    assert drv.cuMemMap(base, GRAN, 0, handle, 0) == (INVALID, None)  # already mapped there
    assert drv.cuMemUnmap(base, GRAN) == (OK,)


@pytest.mark.parametrize(("descs", "count", "result"), [
    ([desc()], 0, INVALID),  # no descriptor
    ([desc()], 2, INVALID),  # more than given
    ([desc(location_type=CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST)], 1, INVALID),
    ([desc(flags=2)], 1, INVALID),  # not NONE, READ or READWRITE
    ([desc(), desc(device=1)], 2, CUresult.CUDA_ERROR_INVALID_DEVICE),
])
def test_set_access_checks_each_descriptor(descs: list, count: int, result: CUresult) -> None:
    drv = ready()
    base, _ = mapped(drv)
    assert drv.cuMemSetAccess(base, 2 * GRAN, descs, count) == (result, None)
    assert not drv.accessible  # nothing applied


def test_set_access_needs_whole_mappings_over_a_fully_mapped_range() -> None:
    drv = ready()
    base, _ = mapped(drv, granules=2)
    assert drv.cuMemSetAccess(base, 3 * GRAN, [desc()], 1) == (INVALID, None)  # a hole
    assert drv.cuMemSetAccess(base, GRAN, [desc()], 1) == (INVALID, None)  # half a mapping
    assert drv.cuMemSetAccess(base, 2 * GRAN, [desc()], 1) == (OK,)
    assert drv.accessible == {base, base + GRAN}


def test_release_of_a_mapped_handle_is_deferred_until_its_last_unmap() -> None:
    drv = ready()
    base, handle = mapped(drv)
    assert drv.cuMemSetAccess(base, 2 * GRAN, [desc()], 1) == (OK,)
    left = drv.memory_left
    assert drv.cuMemRelease(handle) == (OK,)  # still mapped: the memory stays
    assert handle not in drv.handles and drv.memory_left == left
    assert drv.cuPointerGetAttribute(POINTER, base)[0] == OK  # still readable by the device
    assert drv.cuMemRelease(handle) == (INVALID, None)  # released already
    _, other = drv.cuMemAddressReserve(2 * GRAN, 0, 0, 0)
    assert drv.cuMemMap(other, 2 * GRAN, 0, handle, 0) == (INVALID, None)  # no longer valid
    assert drv.cuMemAddressFree(base, 4 * GRAN) == (INVALID, None)  # something is mapped
    assert drv.cuMemUnmap(base, GRAN) == (INVALID, None)  # a sub-range of the mapping
    assert drv.cuMemUnmap(base, 2 * GRAN) == (OK,)
    assert drv.memory_left == left + 2 * GRAN and not drv.released  # freed now
    assert drv.cuMemAddressFree(base, 4 * GRAN) == (OK,)
    assert drv.cuMemAddressFree(other, GRAN) == (INVALID, None)  # not the reserved size


def test_the_pointer_query_needs_device_access_to_a_mapped_page() -> None:
    drv = ready()
    base, _ = mapped(drv)
    assert drv.cuPointerGetAttribute(POINTER, base) == (INVALID, None)  # mapped, no access
    assert drv.cuPointerGetAttribute(POINTER, base + 2 * GRAN) == (INVALID, None)  # unmapped
    read = desc(CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ)
    assert drv.cuMemSetAccess(base, 2 * GRAN, [read], 1) == (OK,)
    assert drv.cuPointerGetAttribute(POINTER, base) == (OK, base)
    assert drv.cuPointerGetAttribute(FakeDriver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_CONTEXT,
                                     base) == (INVALID, None)  # not modelled: refused


CHILD = textwrap.dedent("""
    import ctypes, sys
    from test_fake_cuda_driver import desc, mapped, ready

    drv = ready()
    base, _ = mapped(drv)
    flags = {"none": 0, "read": 1, "readwrite": 3}[sys.argv[1]]
    assert drv.cuMemSetAccess(base, 2 * (64 << 10), [desc(flags)], 1) == (0,)
    cell = ctypes.c_uint8.from_address(base + 100)
    print("read", cell.value, flush=True)
    cell.value = 7
    print("wrote", cell.value, flush=True)
""")


@pytest.mark.parametrize(("access", "returncode", "printed"), [
    ("readwrite", 0, ["read 0", "wrote 7"]),
    ("read", -11, ["read 0"]),  # the write faults
    ("none", -11, []),  # the read faults
])
def test_set_access_really_protects_the_memory(access: str, returncode: int,
                                               printed: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                                        *sys.path])}
    proc = subprocess.run([sys.executable, "-c", CHILD, access], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == returncode, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:-1] == printed
