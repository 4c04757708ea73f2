"""Rank 0's side of tensor parallelism: start the workers, send every step, notice failures.

    TensorParallelExecutor(config, model_path)     spawn ranks 1..local-1, join the groups,
                                                   send them the config; build rank 0's
                                                   Worker (they build theirs), wait for all
    executor.kv                                    rank 0's KV manager, recording its changes
    executor.execute(plan)                         the workers apply the changes, then run the
                                                   same forward (all-reduces meet)
    executor.check_health()                        idle: workers alive? (a barrier every 5 s)
    executor.close()                               Stop, join, kill what is left, leave groups

It is an :class:`~vmkv.executor.base.Executor`: the engine drives it as it drives the
single-rank :class:`~vmkv.executor.local.LocalExecutor`.

The scheduler runs here only, and only rank 0's KV manager decides: the workers apply its
changes (:mod:`vmkv.kv.changes`), the exact slots, pages and blocks it chose. A worker that
dies breaks gloo's connections, so the next collective fails at once; one that hangs fails it
after ``config.distributed_timeout`` seconds. Either way the engine gets a
:class:`TensorParallelError` naming the rank.
"""

from __future__ import annotations

import atexit
import gc
import logging
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from vmkv.commands import Stop
from vmkv.config import EngineConfig
from vmkv.distributed.collectives import (
    barrier,
    broadcast_message,
    close_tensor_parallel,
    gather_messages,
    init_tensor_parallel,
)
from vmkv.distributed.kv_checks import KVDivergedError, agree_vma_budget, kv_digest
from vmkv.distributed.messages import StepMessage
from vmkv.distributed.worker import local_worker_command, rank_device
from vmkv.executor.base import Executor
from vmkv.executor.model_runner import StepOutput
from vmkv.executor.plan import StepPlan
from vmkv.executor.worker import Worker
from vmkv.models.loader import load_model_config
from vmkv.models.sharding import check_divisible

logger = logging.getLogger("vmkv")

#: how often an idle engine makes sure every rank still answers
PING_INTERVAL = 5.0
#: how long close() waits for a worker to exit before killing it
JOIN_TIMEOUT = 10.0
#: how long the ranks may take to load and warm up their shards (compiling included)
STARTUP_TIMEOUT = 900.0



class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died, hung past the collective timeout, or diverged."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelExecutor(Executor):
    """Rank 0 of ``config.tensor_parallel_size`` ranks (see the module docstring)."""

    def __init__(self, config: EngineConfig, model_path: Path) -> None:
        size = config.tensor_parallel_size
        local = config.tp_local_ranks or size
        if local > size:
            raise ValueError(f"tp_local_ranks ({local}) exceeds tensor_parallel_size ({size})")
        check_divisible(load_model_config(model_path), size)  # before any process starts
        if dist.is_initialized():  # an engine nobody closed and nothing holds: release it now
            gc.collect()
        if dist.is_initialized():
            raise ValueError("this process already runs a tensor-parallel engine (or another "
                             "torch.distributed group): one per process; close it first")
        self.size = size
        self.check = bool(config.tp_check)
        self.closed = False
        self.failed = False  # a collective failed: the ranks are out of step for good
        self.timeout = float(config.distributed_timeout)
        self._threads_before = torch.get_num_threads()  # restored by close()
        self._last_message = time.monotonic()
        init_method = config.distributed_init_method or f"tcp://127.0.0.1:{free_port()}"
        threads = max(1, torch.get_num_threads() // local)
        self.workers: dict[int, subprocess.Popen] = {}  # rank -> process
        try:
            for rank in range(1, local):
                # its own session: a Ctrl-C or SIGTERM to the server's process group must not
                # kill the ranks under a graceful drain (close() ends them)
                self.workers[rank] = subprocess.Popen(local_worker_command(
                    rank, size, init_method, rank_device(config.device, rank),
                    config.distributed_timeout, threads), start_new_session=True)
            if config.device == "cpu":
                torch.set_num_threads(threads)
            init_tensor_parallel(0, size, init_method, rank_device(config.device, 0),
                                 config.distributed_timeout)
            broadcast_message(replace(config, model=str(model_path)), STARTUP_TIMEOUT)
            self.worker = Worker(config, model_path)  # the workers build theirs meanwhile
            self._wait_ready()
        except BaseException:
            self.close(graceful=False)
            raise
        # rank 0's manager decides; its changes reach every rank with the next step
        self.kv = self.worker.kv
        self.kv.record_changes()
        self.model_config = self.worker.model_config
        self.model_name = model_path.name
        self.max_model_len = self.worker.max_model_len
        self.dtype = self.worker.model.dtype
        atexit.register(self.close)  # an engine never closed still stops its workers
        logger.info("tensor parallel: %d ranks (%d on this machine, %d CPU threads each) at %s",
                    size, local, threads, init_method)

    def _wait_ready(self) -> None:
        """Wait until every rank has built its shard (warm-up included), at most
        STARTUP_TIMEOUT seconds, failing as soon as a local worker dies; the ranks' KV managers
        then share the smallest VMA budget (a per-process quantity that would otherwise let
        the same call succeed on one rank and fail on another)."""
        try:
            agree_vma_budget(self.worker.kv, STARTUP_TIMEOUT, self._raise_if_dead)
        except RuntimeError as exc:
            raise self._failure(exc) from exc

    def execute(self, plan: StepPlan) -> StepOutput:
        """Send the KV calls so far and ``plan``; rank 0's worker runs it meanwhile."""
        with self._step(plan):
            return self.worker.runner.execute(plan)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.worker.runner.compute_logits(hidden)

    def describe(self) -> list[str]:
        return [self.worker.describe(),
                f"tensor parallel: {self.size} ranks; each holds the KV above for "
                f"{self.worker.model.config.num_kv_heads} of the "
                f"{self.model_config.num_kv_heads} KV heads"]

    @contextmanager
    def _step(self, plan: StepPlan) -> Iterator[None]:
        """Send the KV calls so far and ``plan``; the body runs rank 0's forward."""
        self._send(self._message(step=plan))
        try:
            yield
            if self.check:
                self._compare_digests()
        except (RuntimeError, KVDivergedError) as exc:
            raise self._failure(exc) from exc
        except BaseException:  # the workers may wait in a collective that will never come
            self.failed = True
            raise

    def check_health(self) -> None:
        """Raise TensorParallelError if a local worker died; every PING_INTERVAL seconds, also
        a barrier of all ranks (a remote or hung rank fails it within the timeout)."""
        self._raise_if_dead()
        if time.monotonic() - self._last_message < PING_INTERVAL:
            return
        self._send(self._message(ping=True))
        try:
            barrier(self.timeout)
        except RuntimeError as exc:
            raise self._failure(exc) from exc

    def close(self, *, graceful: bool = True) -> None:
        """Tell the workers to stop, wait for them (kill the slow), leave the groups.
        ``graceful=False`` (a failed start-up, when workers are not in their loop): kill."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        worker = getattr(self, "worker", None)  # absent when start-up failed before it
        if worker is not None:
            worker.close()
        if not graceful or self.failed or self._dead_workers():  # nothing to finish: kill
            for worker in self.workers.values():
                worker.kill()
        elif dist.is_initialized():
            try:
                broadcast_message(Stop(), self.timeout)
            except RuntimeError as exc:
                logger.warning("tensor parallel: could not tell the workers to stop: %s", exc)
        deadline = time.monotonic() + JOIN_TIMEOUT
        for rank, worker in self.workers.items():
            try:
                worker.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("tensor parallel: rank %d did not stop; killing it", rank)
                worker.kill()
                worker.wait()
        close_tensor_parallel()
        torch.set_num_threads(self._threads_before)

    # -- inside ---------------------------------------------------------------------------------
    def _message(self, *, step: StepPlan | None = None, ping: bool = False) -> StepMessage:
        kv = getattr(self, "kv", None)  # absent while starting
        return StepMessage(kv.take_changes() if kv else [], step, ping=ping,
                           check=self.check and step is not None)

    def _send(self, message: StepMessage) -> None:
        if self.failed:
            raise TensorParallelError("the tensor-parallel ranks failed earlier; the engine "
                                      "cannot step any more")
        self._raise_if_dead()
        try:
            broadcast_message(message, self.timeout)
        except RuntimeError as exc:
            raise self._failure(exc) from exc
        self._last_message = time.monotonic()

    def _compare_digests(self) -> None:
        digests = gather_messages(kv_digest(self.kv)) or []
        bad = [rank for rank, d in enumerate(digests) if d != digests[0]]
        if bad:
            raise KVDivergedError(f"the KV managers of ranks {bad} differ from rank 0's")

    def _raise_if_dead(self) -> None:
        dead = self._dead_workers()
        if dead:
            self.failed = True
            raise TensorParallelError(dead)

    def _dead_workers(self) -> str:
        return "; ".join(f"tensor-parallel rank {rank} (pid {w.pid}) exited with code "
                         f"{w.returncode}" for rank, w in self.workers.items()
                         if w.poll() is not None)

    def _failure(self, exc: BaseException) -> TensorParallelError:
        self.failed = True
        if isinstance(exc, TensorParallelError):
            return exc
        time.sleep(0.2)  # a killed worker's exit code shows a moment after its socket closed
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        dead = self._dead_workers()
        return TensorParallelError(f"{dead}: {first}" if dead else
                                   f"a tensor-parallel rank failed: {first}")
