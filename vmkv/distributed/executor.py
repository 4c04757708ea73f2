"""Rank 0's side of tensor parallelism: start the workers, send every step, notice failures.

    TensorParallelExecutor(settings, ...)          spawn ranks 1..local-1, join the groups,
                                                   send them the worker settings; build rank
                                                   0's Worker (they build theirs), wait for all
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
after ``timeout`` seconds (``--distributed-timeout``). Either way the engine gets a
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

import torch
import torch.distributed as dist

from vmkv.commands import Stop
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
from vmkv.executor.base import StepOutput
from vmkv.executor.plan import StepPlan
from vmkv.executor.rank_zero import RankZeroExecutor
from vmkv.executor.settings import WorkerSettings
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


class TensorParallelExecutor(RankZeroExecutor):
    """Rank 0 of ``settings.tensor_parallel_size`` ranks (see the module docstring).

    Args:
        settings: how every rank builds its worker (sent to the other ranks at start-up).
        local_ranks: ranks this machine starts (0 .. local_ranks-1); the others join with
            ``vmkv tp-worker``.
        init_method: the torch.distributed rendezvous (None: a free port on 127.0.0.1).
        timeout: seconds a collective waits for a rank before the engine fails.
        check: compare every rank's KV manager with rank 0's after every step (``--tp-check``).
    """

    def __init__(self, settings: WorkerSettings, *, local_ranks: int, timeout: float,
                 init_method: str | None = None, check: bool = False) -> None:
        size, local = settings.tensor_parallel_size, local_ranks
        if local > size:
            raise ValueError(f"tp_local_ranks ({local}) exceeds tensor_parallel_size ({size})")
        check_divisible(load_model_config(settings.model_path), size)  # before any process
        if dist.is_initialized():  # an engine nobody closed and nothing holds: release it now
            gc.collect()
        if dist.is_initialized():
            raise ValueError("this process already runs a tensor-parallel engine (or another "
                             "torch.distributed group): one per process; close it first")
        self.size = size
        self.check = check
        self.closed = False
        self.failed = False  # a collective failed: the ranks are out of step for good
        self.timeout = float(timeout)
        self._threads_before = torch.get_num_threads()  # restored by close()
        self._last_message = time.monotonic()
        init_method = init_method or f"tcp://127.0.0.1:{free_port()}"
        threads = max(1, torch.get_num_threads() // local)
        self.workers: dict[int, subprocess.Popen] = {}  # rank -> process
        try:
            for rank in range(1, local):
                # its own session: a Ctrl-C or SIGTERM to the server's process group must not
                # kill the ranks under a graceful drain (close() ends them)
                self.workers[rank] = subprocess.Popen(local_worker_command(
                    rank, size, init_method, rank_device(settings.device, rank),
                    timeout, threads), start_new_session=True)
            if settings.device == "cpu":
                torch.set_num_threads(threads)
            init_tensor_parallel(0, size, init_method, rank_device(settings.device, 0),
                                 timeout)
            broadcast_message(settings, STARTUP_TIMEOUT)
            self._worker = Worker(settings)  # the workers build theirs meanwhile
            self._wait_ready(self._worker)
        except BaseException:
            self.close(graceful=False)
            raise
        # rank 0's manager decides; its changes reach every rank with the next step
        self._adopt(self._worker, settings.model_path.name)
        self.kv.changes.record()
        atexit.register(self.close)  # an engine never closed still stops its workers
        logger.info("tensor parallel: %d ranks (%d on this machine, %d CPU threads each) at %s",
                    size, local, threads, init_method)

    def _wait_ready(self, worker: Worker) -> None:
        """Wait until every rank has built its shard (warm-up included), at most
        STARTUP_TIMEOUT seconds, failing as soon as a local worker dies; the ranks' KV managers
        then share the smallest VMA budget (a per-process quantity that would otherwise let
        the same call succeed on one rank and fail on another)."""
        try:
            agree_vma_budget(worker.kv, STARTUP_TIMEOUT, self._raise_if_dead)
        except RuntimeError as exc:
            raise self._failure(exc) from exc

    def execute(self, plan: StepPlan) -> StepOutput:
        """Send the KV calls so far and ``plan``; rank 0's worker runs it meanwhile."""
        with self._step(plan):
            return super().execute(plan)

    def describe(self) -> list[str]:
        return [*super().describe(),
                f"tensor parallel: {self.size} ranks; each holds the KV above for "
                f"{self._rank_zero().model.config.num_kv_heads} of the "
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
        if self._worker is not None:  # None when start-up failed before it
            self._worker.close()
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
        return StepMessage(kv.changes.take() if kv else [], step, ping=ping,
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
