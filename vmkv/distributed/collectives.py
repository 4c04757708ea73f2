"""The tensor-parallel process groups of this process, and the one collective the model uses.

    init_tensor_parallel(rank, size, init_method, device, timeout)
        compute group: the default group, gloo on CPU / NCCL on CUDA, ``timeout`` per collective
        control group: gloo, for step messages from rank 0 (no timeout: workers wait idle)
    all_reduce(x)   sum over the ranks; ``vmkv::all_reduce`` under torch.compile (opaque)
    close_tensor_parallel()

One tensor-parallel engine per process: its groups are process state, as torch.distributed's
default group is. Rank 0 is the engine; ranks 1..N-1 are workers (:mod:`vmkv.distributed.worker`).
"""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist

#: how long an idle worker waits for rank 0's next message (it is woken by a broken
#: connection long before, when rank 0 dies)
CONTROL_TIMEOUT = datetime.timedelta(days=365)


@dataclass
class TensorParallelGroup:
    """This process's rank among ``size`` and its two groups."""

    rank: int
    size: int
    control: dist.ProcessGroup  # gloo: pickled step messages, rank 0 -> all


_group: TensorParallelGroup | None = None


def init_tensor_parallel(rank: int, size: int, init_method: str, device: str,
                         timeout: float) -> TensorParallelGroup:
    """Join the ``size`` ranks at ``init_method`` (``tcp://host:port`` or ``env://``) as
    ``rank``; returns the groups. RuntimeError if this process already has a group, or
    torch.distributed's own error when the rendezvous fails or times out."""
    global _group
    if _group is not None or dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group: one "
                           "tensor-parallel engine per process")
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout))
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    _group = TensorParallelGroup(rank, size, control)
    return _group


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


def _wait(work: dist.Work | None, timeout: float | None) -> None:
    assert work is not None
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout=datetime.timedelta(seconds=timeout))


def gather_messages(message: object) -> list[object] | None:
    """Every rank sends ``message``; rank 0 gets them in rank order, the others None."""
    group = _require()
    box: list[object] | None = [None] * group.size if group.rank == 0 else None
    dist.gather_object(message, box, dst=0, group=group.control)
    return box


def barrier() -> None:
    """Wait until every rank got here (on the control group: no timeout, but a rank that dies
    breaks it at once)."""
    dist.barrier(group=_require().control)


def _require() -> TensorParallelGroup:
    if _group is None:
        raise RuntimeError("no tensor-parallel group in this process")
    return _group


def _all_reduce_eager(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
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
