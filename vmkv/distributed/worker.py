"""A tensor-parallel worker: ranks 1..N-1, each one process holding its shard and KV.

    join the groups ─▶ receive the worker settings from rank 0 ─▶ Worker (same warm-up)
    loop: receive StepMessage ─▶ apply rank 0's KV changes (decide nothing) ─▶ the worker's
          runner runs the step's forward (its all-reduces meet rank 0's) ─▶
          [barrier | send a KV digest]
    until Stop, or until rank 0's connection breaks (then it exits with an error)

Started by the engine (:class:`~vmkv.distributed.executor.TensorParallelExecutor`, spawn) or,
for ranks on other machines, by ``vmkv tp-worker`` (torchrun-style ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; see docs/distributed.md).
"""

from __future__ import annotations

import logging
import os
import sys

from vmkv.commands import Stop
from vmkv.parent_death import die_with_parent

logger = logging.getLogger("vmkv")


def rank_device(device: str, local_rank: int) -> str:
    """The device of the ``local_rank``-th rank on a machine: the CPU, or consecutive GPUs
    from ``device``'s index."""
    if device == "cpu":
        return "cpu"
    base = int(device.partition(":")[2] or 0)
    return f"cuda:{base + local_rank}"


def local_worker_command(rank: int, size: int, init_method: str, device: str,
                         timeout: float, threads: int) -> list[str]:
    """The command line of a worker the engine starts on its own machine (a fresh
    interpreter: nothing of the caller's ``__main__`` is re-run, unlike multiprocessing's
    spawn)."""
    return [sys.executable, "-m", "vmkv.distributed.worker", str(rank), str(size), init_method,
            device, str(timeout), str(threads), str(os.getpid())]


def main(argv: list[str]) -> None:
    """Entry point of a worker the engine started: it dies with the engine (SIGKILL on the
    parent's death, Linux), uses ``threads`` CPU threads, then serves ``rank``."""
    rank, size, init_method, device, timeout, threads, parent = argv
    die_with_parent(int(parent))
    import torch

    torch.set_num_threads(int(threads))
    serve_rank(int(rank), int(size), init_method, device, float(timeout))


def serve_rank(rank: int, size: int, init_method: str, device: str, timeout: float) -> None:
    """Join the group as ``rank`` and serve rank 0's steps until it says Stop."""
    from vmkv.distributed.collectives import (
        barrier,
        broadcast_message,
        close_tensor_parallel,
        gather_messages,
        init_tensor_parallel,
    )
    from vmkv.distributed.kv_checks import agree_vma_budget, kv_digest
    from vmkv.distributed.messages import StepMessage
    from vmkv.executor.worker import Worker

    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s vmkv tp rank {rank} %(levelname)s %(message)s")
    init_tensor_parallel(rank, size, init_method, device, timeout)
    try:
        settings = broadcast_message()  # rank 0's WorkerSettings
        worker = Worker(settings, rank=rank, device=device)
        agree_vma_budget(worker.kv)  # ready: rank 0 waits for every shard
        logger.info("serving %s, KV: %s", worker.model.config.architecture,
                    worker.kv.accounting.describe())
        while True:
            try:
                message = broadcast_message()
            except RuntimeError as exc:  # rank 0 is gone: nothing is left to serve
                logger.error("rank 0 went away (%s); exiting", str(exc).splitlines()[0])
                raise SystemExit(1) from None
            if isinstance(message, Stop):
                break
            assert isinstance(message, StepMessage)
            worker.kv.changes.apply(message.kv_changes)
            if message.step is not None:
                worker.runner.forward(message.step)
            if message.ping:
                barrier(None)
            if message.check:
                gather_messages(kv_digest(worker.kv))
        worker.close()
    finally:
        close_tensor_parallel()


if __name__ == "__main__":
    main(sys.argv[1:])
