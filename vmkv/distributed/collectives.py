"""The tensor-parallel process groups of this process, and the one collective the model uses.

    init_tensor_parallel(rank, size, init_method, device, timeout)
        compute group: gloo on CPU / NCCL on CUDA, ``timeout`` per collective (the default
                       group, joined first, only meets the ranks)
        control group: gloo, for step messages from rank 0 (workers wait idle without a
                       limit; rank 0 waits at most its timeout for them)
    all_reduce(x)   sum over the ranks; ``vmkv::all_reduce`` under torch.compile (opaque);
                    skipped inside ``local_only()`` (warm-up)
    close_tensor_parallel()

One tensor-parallel engine per process: its groups are process state, as torch.distributed's
default group is. Rank 0 is the engine; ranks 1..N-1 are workers (:mod:`vmkv.distributed.worker`).
"""

from __future__ import annotations

import datetime
import pickle
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

#: how long an idle worker waits for rank 0's next message (it is woken by a broken
#: connection long before, when rank 0 dies)
CONTROL_TIMEOUT = datetime.timedelta(days=365)
#: the least time the ranks wait for each other to join (starting an interpreter and
#: importing torch takes seconds, more on a loaded machine), whatever the collective timeout
RENDEZVOUS_TIMEOUT = 120.0


@dataclass
class TensorParallelGroup:
    """This process's rank among ``size`` and its two groups."""

    rank: int
    size: int
    compute: dist.ProcessGroup  # gloo / NCCL: the model's all-reduces
    control: dist.ProcessGroup  # gloo: pickled step messages, rank 0 -> all


_group: TensorParallelGroup | None = None
_local = False  # inside local_only(): collectives skipped


def init_tensor_parallel(rank: int, size: int, init_method: str, device: str,
                         timeout: float) -> TensorParallelGroup:
    """Join the ``size`` ranks at ``init_method`` (``tcp://host:port`` or ``env://``) as
    ``rank``; returns the groups. RuntimeError if this process already has a group, or
    torch.distributed's own error when the rendezvous fails or times out.

    The rendezvous waits at least :data:`RENDEZVOUS_TIMEOUT` seconds for the other ranks (a
    worker still starting its interpreter on a busy machine is not a hung one); ``timeout``
    bounds every collective after it."""
    global _group
    if _group is not None or dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group: one "
                           "tensor-parallel engine per process")
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(device)  # NCCL, Triton and graphs use the current device
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=max(timeout,
                                                                       RENDEZVOUS_TIMEOUT)))
    except BaseException:
        _forget_failed_group()
        raise
    compute = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=timeout))
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    _group = TensorParallelGroup(rank, size, compute, control)
    return _group


def _forget_failed_group() -> None:
    """torch counts a default group whose rendezvous failed, and the count names the store keys
    of this process's next groups: a later engine's rank 0 would wait for keys its fresh
    workers (counting from 0) never write. Reset the count while no group exists."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if not dist.is_initialized() and world is not None and hasattr(world, "group_count"):
        world.group_count = 0


def tensor_parallel_group() -> TensorParallelGroup | None:
    """This process's group, None outside a tensor-parallel engine."""
    return _group


def close_tensor_parallel() -> None:
    """Leave the groups (a no-op when there are none)."""
    global _group
    _group = None
    if dist.is_initialized():
        dist.destroy_process_group()


def broadcast_message(message: object = None, timeout: float | None = None) -> object:
    """Rank 0 sends ``message`` (any picklable object) to every rank; every rank returns it.

    ``timeout`` (rank 0): seconds to wait for the ranks to take it (gloo hands data over only
    to a rank that posted its receive, so a hung rank would block the sender forever);
    RuntimeError when it passes. Workers wait for the next message without a limit.
    """
    group = _require()
    if group.rank == 0:
        data = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    _wait(dist.broadcast(size, src=0, group=group.control, async_op=True), timeout)
    if group.rank != 0:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    _wait(dist.broadcast(data, src=0, group=group.control, async_op=True), timeout)
    return message if group.rank == 0 else pickle.loads(data.numpy().tobytes())


def agree_min(value: int, timeout: float | None = None,
              alive: Callable[[], None] | None = None) -> int:
    """The smallest ``value`` over the ranks (a barrier too). ``timeout``: seconds to wait,
    calling ``alive()`` (which raises when a rank is known dead) while waiting."""
    box = torch.tensor([value], dtype=torch.int64)
    _wait(dist.all_reduce(box, op=dist.ReduceOp.MIN, group=_require().control, async_op=True),
          timeout, alive)
    return int(box.item())


def _wait(work: dist.Work | None, timeout: float | None,
          alive: Callable[[], None] | None = None) -> None:
    assert work is not None
    if timeout is None:
        work.wait()
        return
    if alive is None:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
        return
    deadline = time.monotonic() + timeout
    while not work.is_completed():
        alive()
        if time.monotonic() > deadline:
            raise RuntimeError(f"a rank did not answer within {timeout:.0f} s")
        time.sleep(0.05)
    work.wait()


def gather_messages(message: object) -> list[object] | None:
    """Every rank sends ``message``; rank 0 gets them in rank order, the others None."""
    group = _require()
    box: list[object] | None = [None] * group.size if group.rank == 0 else None
    dist.gather_object(message, box, dst=0, group=group.control)
    return box


def barrier(timeout: float | None) -> None:
    """Every rank meets here (on the control group): rank 0 waits at most ``timeout`` seconds
    (RuntimeError then), its check that the ranks still answer; workers wait (None)."""
    _wait(dist.barrier(group=_require().control, async_op=True), timeout)


@contextmanager
def local_only() -> Iterator[None]:
    """Inside, :func:`all_reduce` returns its input: every rank's warm-up forward (compiling
    or eager, whatever each rank decided) makes no collective, so no rank can be left waiting
    for another's."""
    global _local
    _local, outer = True, _local
    try:
        yield
    finally:
        _local = outer


def _require() -> TensorParallelGroup:
    if _group is None:
        raise RuntimeError("no tensor-parallel group in this process")
    return _group


def _all_reduce_eager(x: torch.Tensor) -> torch.Tensor:
    if not _local:
        dist.all_reduce(x, group=_require().compute)
    return x


@torch.library.custom_op("vmkv::all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor) -> torch.Tensor:
    return _all_reduce_eager(x.clone())


@_all_reduce_op.register_fake
def _all_reduce_shape(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel ranks (in place when eager; the sum is returned).

    Under ``torch.compile`` it is the custom op ``vmkv::all_reduce``, which the compiler does
    not look into (as ``vmkv::attention``): the graph around it still fuses.
    """
    if torch.compiler.is_compiling():
        return torch.ops.vmkv.all_reduce(x)
    return _all_reduce_eager(x)
