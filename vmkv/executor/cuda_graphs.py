"""CUDA graphs for decode-only steps: capture once per batch-size bucket, replay with new inputs.

    buckets:  1, 2, 4, 8, 16, 32, ... up to max_num_seqs (always included)
    a decode batch of B requests runs the graph of the smallest bucket b >= B; entries
    B .. b-1 are padding: K/V write row -1 (nothing written), length 0 (nothing read)

    static, per bucket: one device byte buffer = | input_ids [b] | positions [b] | attention
                        fields (write rows, cu_seqlens, seq lens, slot ids / block table) |
    a step:             host arrays -> one pinned copy into that buffer -> graph.replay()
                        -> hidden [b, hidden_size] (rows < B are the batch's)

Why this is valid for the virtual cache: the captured kernels hold the *virtual* addresses of
the KV slots, which never move; pages mapped under them later are seen by the next replay. No
VMM call may happen while a graph is captured (global capture mode forbids it from any thread),
so a background mapper is paused for the capture. All graphs share one memory pool and are
captured largest first, so the pool is sized by the largest bucket.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from vmkv.attention.base import AttentionBackend
from vmkv.attention.cuda import CudaAttentionBackend
from vmkv.attention.staging import Field, layout
from vmkv.models.llama import LlamaModel

logger = logging.getLogger(__name__)


class Graph(Protocol):
    """What the runner needs from a graph (a ``torch.cuda.CUDAGraph`` or a test double)."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor: ...

    def replay(self) -> None: ...


class TorchCudaGraph:
    """``torch.cuda.CUDAGraph`` captured into a shared memory pool."""

    def __init__(self, pool: Any) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        with torch.cuda.graph(self.graph, pool=self.pool):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


def default_batch_sizes(max_batch_size: int) -> list[int]:
    """Powers of two below ``max_batch_size``, then ``max_batch_size`` itself."""
    if max_batch_size <= 0:
        raise ValueError(f"max_batch_size must be positive, got {max_batch_size}")
    sizes, b = [], 1
    while b < max_batch_size:
        sizes.append(b)
        b *= 2
    return [*sizes, max_batch_size]


@dataclass
class _Captured:
    graph: Graph
    buffer: torch.Tensor  # static inputs (bytes)
    fields: tuple[Field, ...]  # their layout, checked before every replay
    hidden: torch.Tensor  # [b, hidden_size] static output


class DecodeGraphRunner:
    """Captured decode steps of ``model`` over ``attn``'s KV cache.

    Args:
        model: the model (its weights and the KV views must not move after capture).
        attn: a CUDA attention backend with ``supports_cuda_graphs``.
        max_batch_size: the largest decode batch (``max_num_seqs``).
        batch_sizes: buckets to capture (default :func:`default_batch_sizes`).
        pause_mapping: the KV manager's ``mapping.paused``: no map call while capturing.
        graph_factory: makes one graph per bucket (tests pass a CPU double; the default is
            :class:`TorchCudaGraph` on a shared pool).
    """

    def __init__(self, model: LlamaModel, attn: CudaAttentionBackend, *, max_batch_size: int,
                 batch_sizes: list[int] | None = None,
                 pause_mapping: Callable[[], AbstractContextManager[None]] | None = None,
                 graph_factory: Callable[[], Graph] | None = None) -> None:
        if not attn.supports_cuda_graphs:
            raise ValueError(f"attention backend {getattr(attn, 'name', attn)!r} cannot be "
                             "captured in a CUDA graph (needs a batched kernel and the Triton "
                             "K/V write)")
        sizes = sorted(set(batch_sizes or default_batch_sizes(max_batch_size)))
        if sizes[0] <= 0 or sizes[-1] < max_batch_size:
            raise ValueError(f"batch_sizes must be positive and reach {max_batch_size}, "
                             f"got {sizes}")
        self.model = model
        self.attn = attn
        self.batch_sizes = sizes
        self.pause_mapping = pause_mapping
        if graph_factory is None:
            pool = torch.cuda.graph_pool_handle()
            graph_factory = lambda: TorchCudaGraph(pool)  # noqa: E731
        self._factory = graph_factory
        self._graphs: dict[int, _Captured] = {}
        self.num_replays = 0

    # -- buckets ------------------------------------------------------------------------------
    def bucket_for(self, batch_size: int) -> int | None:
        """The smallest captured size >= ``batch_size`` (None if it is too large)."""
        for b in self.batch_sizes:
            if b >= batch_size:
                return b
        return None

    def can_run(self, query_lens: list[int]) -> bool:
        """Whether a step with these query lengths runs as a graph (decode-only, fits)."""
        return (bool(query_lens) and all(n == 1 for n in query_lens)
                and self.bucket_for(len(query_lens)) is not None)

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    # -- capture ------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, with the mapping paused."""
        with self.pause_mapping() if self.pause_mapping is not None else nullcontext():
            for b in sorted(self.batch_sizes, reverse=True):
                self._capture(b)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.batch_sizes)

    def _capture(self, b: int) -> None:
        attn, model = self.attn, self.model
        step = attn.graph_step(b)  # b padding entries: nothing written, nothing read
        ids = {"input_ids": np.zeros(b, np.int64), "positions": np.zeros(b, np.int64)}
        buffer, views = attn.graph_buffer(step, ids)
        meta = attn.metadata(step, {name: views[name] for name in step.arrays})
        input_ids, positions = views["input_ids"], views["positions"]

        def forward() -> torch.Tensor:
            return model.forward(input_ids, positions, attn, meta)  # [b, hidden]

        forward()  # warm-up: compiles Triton kernels, lets cuBLAS pick its algorithms
        if attn.device.type == "cuda":
            torch.cuda.synchronize(attn.device)
        graph = self._factory()
        hidden = graph.capture(forward)
        self._graphs[b] = _Captured(graph, buffer, layout({**step.arrays, **ids})[0], hidden)

    # -- replay -------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, request_ids: list[str], context_lens: list[int], input_ids: list[int],
            positions: list[int]) -> torch.Tensor:
        """One decode step of ``len(request_ids)`` requests (the KV manager already holds
        room for each new token); returns ``hidden [B, hidden_size]`` (a view of the graph's
        static output: consume it before the next replay)."""
        batch = len(request_ids)
        b = self.bucket_for(batch)
        if b is None or b not in self._graphs:
            raise ValueError(f"no captured graph for a decode batch of {batch} "
                             f"(captured: {self.captured})")
        cap = self._graphs[b]
        step = self.attn.build_step(request_ids, context_lens, [1] * batch, pad_to=b)
        pad = np.zeros(b - batch, np.int64)
        arrays = {**step.arrays,
                  "input_ids": np.concatenate([np.asarray(input_ids, np.int64), pad]),
                  "positions": np.concatenate([np.asarray(positions, np.int64), pad])}
        fields = layout(arrays)[0]
        if fields != cap.fields:
            raise RuntimeError(f"step layout {fields} differs from the captured one "
                               f"{cap.fields} (bucket {b})")
        self.attn.staging.pack(arrays, dst=cap.buffer)  # one host->device copy
        cap.graph.replay()
        self.num_replays += 1
        return cap.hidden[:batch]


def maybe_create_graph_runner(model: LlamaModel, attn: AttentionBackend, *,
                              max_batch_size: int,
                              pause_mapping: Callable[[], AbstractContextManager[None]]
                              | None = None,
                              graph_factory: Callable[[], Graph] | None = None
                              ) -> DecodeGraphRunner | None:
    """A captured :class:`DecodeGraphRunner` for CUDA engines whose backend allows it; None on
    CPU, when the backend cannot be captured, or when capturing fails (logged with its root
    cause: every step then runs eagerly). Whether to try at all is the caller's
    (``EngineConfig.cuda_graphs``, ``enforce_eager``). ``graph_factory`` as in
    :class:`DecodeGraphRunner` (tests)."""
    if model.device.type != "cuda":
        return None
    if not attn.supports_cuda_graphs:
        logger.warning("CUDA graphs off: attention backend %s cannot be captured",
                       getattr(attn, "name", attn))
        return None
    try:
        runner = DecodeGraphRunner(model, attn, max_batch_size=max_batch_size,
                                   pause_mapping=pause_mapping, graph_factory=graph_factory)
        runner.capture()
    except Exception as exc:  # noqa: BLE001 - degrade to eager steps, with the reason
        _check_device_usable(attn.device, exc)
        logger.warning("CUDA graphs off: capturing the decode steps failed: %s; every step "
                       "runs eagerly", describe_chain(exc))
        return None
    return runner


def describe_chain(exc: BaseException) -> str:
    """``root cause (surfaced as: outer error)``: torch's ``graph.__exit__`` always ends the
    capture, so an error raised inside it arrives chained under a stream-capture error."""
    chain = [exc]
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and (
            nxt not in chain):
        chain.append(nxt)
    text = [f"{type(e).__name__}: {e}" for e in reversed(chain)]
    return text[0] + (f" (surfaced as: {'; '.join(text[1:])})" if len(text) > 1 else "")


def _check_device_usable(device: torch.device, cause: BaseException) -> None:
    """Re-raise ``cause`` if the device is unusable after it (a sticky CUDA error such as an
    illegal address poisons the context: eager steps could not run either)."""
    if device.type != "cuda":
        return
    try:
        torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001
        raise RuntimeError(f"the CUDA context is unusable after a failed graph capture "
                           f"({describe_chain(cause)})") from exc
