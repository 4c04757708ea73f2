"""Data-parallel replicas: N independent engines, one process each, behind one router.

    server (event loop)                 replica processes (spawned; vmkv/engine/replica.py)
    DataParallelEngine.add ──Router──>  ReplicaClient 0 ══pipe══ LLMEngine (cores // N threads)
        least loaded, sticky by prefix  ReplicaClient 1 ══pipe══ LLMEngine
    front = EngineFront.load(config)    ...
      (tokenizer, limits, grammars: no weights in this process)

Each replica is built from the config with ``data_parallel_size=1`` and its own KV cache and
prefix cache; on a GPU, replica i uses device ``cuda:<k+i>`` for ``--device cuda:k``. The
interface is :class:`~vmkv.engine.front.ServingEngine`, the one the server drives for a single
in-process :class:`~vmkv.engine.async_engine.AsyncEngine`, so the server has one path.

Routing (vmkv/engine/router.py): a request goes to the least-loaded replica, or to the replica
that last had its prefix key unless that one is far more loaded; an ``n > 1`` request is one
request of one replica. Aborts go to the replica that owns the request.

Failure: when one replica dies (its pipe closes), the whole engine fails fast, as vLLM does
when a data-parallel rank dies: every in-flight stream ends with :class:`EngineDeadError` (the
surviving replicas abort theirs, freeing their KV), ``is_alive`` turns False and ``dead`` names
the replica; the server then answers 503 and ``/health`` says which replica died.

Lifetime: replicas die with their parent (``PR_SET_PDEATHSIG``, Linux: tied to the *thread*
that started them, so build the engine on a thread that outlives it, e.g. the main thread);
:meth:`shutdown` (also run at interpreter exit) stops them, then terminates or kills what is
left: no process outlives the engine.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import os
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from vmkv.commands import Abort, AbortAll, Call
from vmkv.config import EngineConfig
from vmkv.distributed.worker import rank_device
from vmkv.engine.errors import EngineDeadError
from vmkv.engine.front import EngineFront
from vmkv.engine.llm_engine import LLMEngine
from vmkv.engine.replica import run_replica
from vmkv.engine.replica_client import ReplicaClient
from vmkv.engine.request_stream import RequestStream
from vmkv.engine.router import Router, prefix_key
from vmkv.process_tuning import replica_threads
from vmkv.sampling_params import SamplingParams

logger = logging.getLogger("vmkv")

#: seconds a replica may take to load its model (and compile) before start-up fails
START_TIMEOUT = 900.0


class DataParallelEngine:
    """``config.data_parallel_size`` engine processes behind one router (see the module)."""

    def __init__(self, config: EngineConfig, *, start_timeout: float = START_TIMEOUT) -> None:
        if config.tensor_parallel_size > 1 and (config.distributed_init_method
                                                 or config.tp_local_ranks):
            raise ValueError("data-parallel replicas start their tensor-parallel ranks on this "
                             "machine, each at its own free port: distributed_init_method and "
                             "tp_local_ranks apply to one engine only")
        self.front = EngineFront.load(config)  # bad models and lengths fail here, before forks
        self.num_replicas = config.data_parallel_size
        self.router = Router(self.num_replicas)
        self.dead: EngineDeadError | None = None
        self.replicas: list[ReplicaClient] = []
        self._lock = threading.Lock()
        self._closed = False
        context = multiprocessing.get_context("spawn")
        threads = replica_threads(self.num_replicas)
        level = logging.getLogger("vmkv").getEffectiveLevel()
        atexit.register(self.shutdown)
        try:
            for i in range(self.num_replicas):
                # a tensor-parallel replica's ranks take the next GPUs: replica i starts at
                # GPU i * tensor_parallel_size (from the one --device names)
                replica_config = replace(config, data_parallel_size=1, device=rank_device(
                    config.device, i * config.tensor_parallel_size))
                parent_end, child_end = context.Pipe()
                process = context.Process(
                    target=run_replica, name=f"vmkv-replica-{i}",
                    args=(i, replica_config, child_end, os.getpid(), threads, level))
                process.start()
                child_end.close()  # else the parent never sees the pipe close when it dies
                self.replicas.append(ReplicaClient(i, process, parent_end, self._replica_died))
            for replica in self.replicas:
                replica.wait_ready(start_timeout)
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d data-parallel replicas ready (pids %s), %d threads each",
                    self.num_replicas, [r.process.pid for r in self.replicas], threads)

    # -- the ServingEngine interface ----------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self.dead is None and not self._closed and all(r.is_alive for r in self.replicas)

    async def add(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                  cache_salt: str | None = None, *, max_waiting: int | None = None
                  ) -> RequestStream:
        """Route and submit a request; returns once its replica accepted it.

        Raises ValueError (bad request, or an id already in use), EngineOverloadedError (its
        replica already has ``max_waiting`` sequences waiting) or EngineDeadError."""
        self._check_alive()
        if any(r.owns(request_id) for r in self.replicas):
            raise ValueError(f"request id {request_id!r} is already in use")
        index = self.router.choose(prefix_key(prompt, cache_salt),
                                   [r.load for r in self.replicas])
        return await self.replicas[index].add(request_id, prompt, params, cache_salt,
                                              max_waiting)

    async def abort(self, request_id: str, reason: str | None = None) -> None:
        """Abort a request on the replica that runs it (no-op if none does); its stream still
        gets the final output (``finish_reason="abort"``, ``stop_reason=reason``)."""
        self._check_alive()
        for replica in self.replicas:
            if replica.owns(request_id):
                replica.submit(Abort(request_id, reason))
                return

    async def abort_all(self, reason: str | None = None) -> int:
        """Abort every request of every replica; returns how many there were."""
        self._check_alive()
        counts = await asyncio.gather(*(r.call(AbortAll(reason)) for r in self.replicas))
        return sum(counts)

    async def call_all(self, fn: Callable[[LLMEngine], Any]) -> list[Any]:
        """``fn(engine)`` in every replica between its steps; one result per replica, in
        replica order. ``fn`` must be picklable (a module-level function)."""
        self._check_alive()
        return list(await asyncio.gather(*(r.call(Call(fn)) for r in self.replicas)))

    async def call(self, fn: Callable[[LLMEngine], Any], replica: int = 0) -> Any:
        """``fn(engine)`` in one replica (:meth:`call_all` for every replica)."""
        self._check_alive()
        return await self.replicas[replica].call(Call(fn))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every replica (their engines close), then terminate or kill any left; open
        streams end with EngineDeadError. Safe to call more than once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.shutdown)
        for replica in self.replicas:
            replica.request_stop()
        for replica in self.replicas:
            replica.join(timeout)

    # -- failure ------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        if self._closed:
            raise EngineDeadError("the data-parallel engine was shut down")

    def _replica_died(self, dead: ReplicaClient, error: EngineDeadError) -> None:
        """(A reader thread.) One replica died: the whole engine fails (see the module)."""
        with self._lock:
            if self.dead is None:
                self.dead = error
        for replica in self.replicas:
            if replica is not dead:
                replica.fail(error)
