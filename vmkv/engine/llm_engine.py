"""The engine: requests in, one scheduled model step at a time, outputs out (single-threaded).

    add_request ──> InputProcessor ──EngineRequest──> add ──> Scheduler.waiting
    Scheduler.schedule() ──plan_step──> Executor.execute(StepPlan) ──> Sampler
                                                         │ fork n>1 after the prompt
    RequestOutput <── OutputProcessor: append token, detokenise, stop, delta ─┘

Not thread-safe: :class:`~vmkv.engine.async_engine.AsyncEngine` runs it on its own thread.
"""

from __future__ import annotations

import bisect
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from vmkv.config import EngineConfig
from vmkv.engine.input_processor import EngineRequest, InputProcessor, stop_token_ids
from vmkv.engine.output_processor import OutputProcessor
from vmkv.engine.outputs import RequestOutput
from vmkv.engine.planner import plan_step
from vmkv.engine.scheduler import Scheduler
from vmkv.engine.sequence import Request, Sequence
from vmkv.executor import Executor, create_executor
from vmkv.kernels import cpu_kernels
from vmkv.kv.base import VmmError
from vmkv.models import load_tokenizer, resolve_model
from vmkv.sampling import Sampler
from vmkv.sampling.logprobs import prompt_logprobs
from vmkv.sampling_params import SamplingParams
from vmkv.spec_decode.proposer import create_spec_decoding
from vmkv.structured.compiler import GrammarCompilerCache

logger = logging.getLogger("vmkv")

#: tokens ahead of every running request the background mapper maps (virtual mode, CUDA)
PREMAP_LOOKAHEAD_TOKENS = 16
#: upper bounds of the tokens-per-step buckets (vLLM's ``iteration_tokens_total``)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class EngineCounters:
    """Monotonic counters since start-up (the server exports them to Prometheus)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] | None = None
    steps: int = 0
    # tokens per step: counts per bucket of ITERATION_TOKEN_BUCKETS (the last: above them all)
    step_tokens: list[int] | None = None
    step_tokens_sum: int = 0

    def __post_init__(self) -> None:
        self.finished = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self.step_tokens = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)

    def count_step(self, num_tokens: int) -> None:
        """A step that ran ``num_tokens`` tokens (vLLM's ``iteration_tokens_total``)."""
        self.steps += 1
        self.step_tokens[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)] += 1
        self.step_tokens_sum += num_tokens


@dataclass
class StepStats:
    """What the last :meth:`LLMEngine.step` did, and where its time went (nanoseconds, from
    ``time.perf_counter_ns``): what profilers and traces read instead of wrapping the engine.

    ``execute_ns``: the executor's step (the forward and the logits); ``sample_ns``: the
    sampler (logits to token ids); the rest of ``total_ns`` is the engine's own work
    (scheduling, KV decisions, the step plan, fork/append/detokenise/stop and outputs)."""

    num_seqs: int = 0
    num_tokens: int = 0
    total_ns: int = 0
    execute_ns: int = 0
    sample_ns: int = 0


class LLMEngine:
    """Continuous-batching engine over one executor (the model's ranks) and its KV manager.

    ``LLMEngine(config)`` loads the tokenizer and builds the executor the config asks for
    (one rank, or tensor-parallel ranks); ``executor=`` and ``tokenizer=`` give it ready ones
    (tests drive the scheduling and outputs with a stand-in executor and no weights).
    """

    def __init__(self, config: EngineConfig, *, executor: Executor | None = None,
                 tokenizer: Any = None) -> None:
        started = time.monotonic()
        if config.data_parallel_size != 1:
            raise ValueError(f"an LLMEngine is one replica, got data_parallel_size="
                             f"{config.data_parallel_size}; replicas are served by "
                             "vmkv.engine.data_parallel.DataParallelEngine (vmkv serve, vmkv "
                             "bench throughput)")
        self.config = config
        if executor is None:
            model_path = resolve_model(config.model)
            if tokenizer is None:  # before any rank starts
                tokenizer = load_tokenizer(config.tokenizer or model_path)
            executor = create_executor(config, model_path)
        elif tokenizer is None:
            raise ValueError("an engine given an executor needs its tokenizer too")
        self.executor = executor
        self.tokenizer = tokenizer
        self.kv = executor.kv
        self.model_config, self.max_model_len = executor.model_config, executor.max_model_len
        # close() or, for an engine nobody closed, its garbage collection releases it
        self._resources = weakref.finalize(self, executor.close)
        #: speculative decoding (None: off): proposals, the adaptive policy, its counters
        self.spec = (create_spec_decoding(config, self.max_model_len)
                     if config.speculative_config is not None else None)
        self.scheduler = Scheduler(self.kv, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   preemption_mode=config.preemption_mode,
                                   propose=self.spec.propose if self.spec else None)
        generator = torch.Generator(device=config.device).manual_seed(config.seed)
        self.sampler = Sampler(generator)
        self.eos_token_ids = stop_token_ids(self.model_config, self.tokenizer)
        # structured outputs: xgrammar grammars for this tokenizer, compiled once per params
        self.grammars = GrammarCompilerCache(self.tokenizer, self.model_config.vocab_size,
                                             self.eos_token_ids)
        self.processor = InputProcessor(
            self.tokenizer, vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len, max_num_seqs=config.max_num_seqs,
            max_logprobs=config.max_logprobs, capacity_tokens=self.kv.accounting.capacity_tokens,
            grammars=self.grammars)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len,
                                       config.device)
        self.requests: dict[str, Request] = {}
        self.counters = EngineCounters()
        self.last_step = StepStats()
        self.startup_seconds = time.monotonic() - started
        for line in self.startup_report():
            logger.info(line)

    # -- reporting ----------------------------------------------------------------------------
    def startup_report(self) -> list[str]:
        """What vLLM users read at start-up: capacity, concurrency, the KV geometry, which CPU
        kernels run (on the CPU) and how the decoder layers run."""
        kv, accounting = self.kv, self.kv.accounting
        cap = accounting.capacity_tokens
        return [
            f"model {self.executor.model_name} ({self.model_config.architecture}, "
            f"{self.executor.dtype}: {self.config.dtype_choice[1]}) on {self.config.device}, "
            f"loaded in "
            f"{self.startup_seconds:.1f} s",
            f"KV cache: {kv.kv_mode} mode, {kv.spec.describe()}, "
            f"{accounting.usage.capacity_bytes / 2**20:,.0f} MiB physical "
            f"= {cap:,} tokens; maximum concurrency for {self.max_model_len:,} tokens per "
            f"request: {cap / self.max_model_len:.2f}x; prefix caching "
            f"{'on' if self.kv.prefix.enabled else 'off'}",
            accounting.describe(),
            *([cpu_kernels.report_line()] if self.config.device == "cpu" else []),
            *self.executor.describe(),
        ]

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, *, arrival_time: float | None = None,
                    cache_salt: str | None = None) -> Request:
        """Validate (:class:`InputProcessor`) and queue a request; ValueError (nothing
        queued) for bad input.

        ``cache_salt``: requests with different salts never share prefix-cached KV.
        """
        self._check_new(request_id)
        return self.add(self.processor.process(request_id, prompt, params or SamplingParams(),
                                               cache_salt=cache_salt,
                                               arrival_time=arrival_time))

    def add(self, request: EngineRequest) -> Request:
        """Queue a request :attr:`processor` made (RuntimeError when closed, ValueError when
        its id is in use; nothing queued then)."""
        self._check_new(request.request_id)
        params = request.params
        req = Request(request.request_id, request.prompt_token_ids, params, request.max_tokens,
                      prompt=request.prompt, cache_salt=request.cache_salt,
                      bad_words_token_ids=request.bad_words_token_ids)
        if request.arrival_time is not None:
            req.arrival_time = request.arrival_time
        seq = self.outputs.new_request(req, request.grammar)
        seq.pending_forks = params.n - 1
        self.requests[request.request_id] = req
        self.scheduler.add(seq)
        self.counters.prompt_tokens += len(req.prompt_token_ids)
        return req

    def _check_new(self, request_id: str) -> None:
        if not self._resources.alive:
            raise RuntimeError("this engine is closed")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")

    def abort_request(self, request_id: str, stop_reason: str | None = None
                      ) -> RequestOutput | None:
        """Stop a request and free its KV now; None if it is unknown or already finished.

        ``stop_reason`` says why in the output (the server uses "timeout" and "shutdown")."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._finish_all(req, "abort", stop_reason)
        return self._output(req)

    def _finish_all(self, req: Request, reason: str, stop_reason: str | None = None) -> None:
        """Finish every unfinished sequence of ``req`` with ``reason``, freeing its KV."""
        for seq in req.seqs:
            seq.pending_forks = 0
            if not seq.is_finished:
                seq.stop_reason = stop_reason
                self._finish(seq, reason)

    def _fail_request(self, req: Request, exc: Exception, touched: dict[str, Request]) -> None:
        """The OS/driver refused ``req``'s KV memory: it fails (every sample), others go on."""
        logger.warning("request %s failed: %s", req.request_id, exc)
        req.error = f"KV cache memory error: {exc}"
        self._finish_all(req, "error")
        touched[req.request_id] = req

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix unit; returns how many (0 when prefix caching is off).

        Running requests keep their KV (see ``PrefixCaching.reset``).
        """
        return self.kv.prefix.reset()

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; outputs of every request that changed, as their
        ``output_kind`` says (a finished request's last output has ``finished=True``, and the
        request is forgotten)."""
        started = time.perf_counter_ns()
        stats = self.last_step = StepStats()
        out = self.scheduler.schedule()
        touched: dict[str, Request] = {}
        for seq in out.out_of_capacity:
            seq.pending_forks = 0
            self.counters.finished["length"] += 1
            touched[seq.request.request_id] = seq.request
        for seq, exc in out.failed:
            self.counters.finished["error"] += 1
            self._fail_request(seq.request, exc, touched)
        if out.failed:  # a failed request's other samples may be scheduled: they must not run
            out.drop_finished()
        if out.scheduled:
            now = time.monotonic()
            for seq in out.scheduled:
                if seq.request.first_scheduled_time is None:
                    seq.request.first_scheduled_time = now
            plan, owners = plan_step(out)
            stats.num_seqs, stats.num_tokens = len(out.scheduled), plan.num_tokens
            self.counters.count_step(plan.num_tokens)
            t = time.perf_counter_ns()
            logits, prompt_hidden = self.executor.execute(plan)
            stats.execute_ns = time.perf_counter_ns() - t
            self._record_prompt_logprobs(owners.prompt_spans, prompt_hidden)
            self.scheduler.update(out)
            # the KV manager maps ahead while the GPU computes (sampling syncs with it first)
            with self.kv.mapping.ahead(PREMAP_LOOKAHEAD_TOKENS):
                if owners.sampled:
                    self._sample(logits, owners.sampled, touched)
        outputs = [self._output(req) for req in touched.values()]
        stats.total_ns = time.perf_counter_ns() - started
        return [o for o in outputs if o is not None]

    def _record_prompt_logprobs(self, prompt_seqs: list[tuple[Sequence, int]],
                                prompt_hidden: list[torch.Tensor]) -> None:
        """Score the prompt tokens this step's prefill chunks predict (in the same forward)."""
        for (seq, first), hidden in zip(prompt_seqs, prompt_hidden, strict=True):
            req = seq.request
            targets = seq.token_ids[first + 1 : first + 1 + len(hidden)]
            self.outputs.prompt_logprobs(req, prompt_logprobs(
                self.executor.compute_logits, hidden, targets, req.params.prompt_logprobs))

    def _sample(self, logits: torch.Tensor, ready: list[Sequence],
                touched: dict[str, Request]) -> None:
        if self.spec is not None and any(s.draft_token_ids for s in ready):
            t = time.perf_counter_ns()  # verify what ran proposals, roll their KV back
            verified, plain_rows, ready = self.spec.verify(
                self.sampler, logits, ready, self._append, self.scheduler.rollback)
            self.last_step.sample_ns += time.perf_counter_ns() - t
            touched.update((seq.request.request_id, seq.request) for seq in verified)
            logits = logits.index_select(0, torch.tensor(plain_rows, dtype=torch.int64,
                                                         device=logits.device))
        seqs: list[Sequence] = []
        rows: list[int] = []
        for row, seq in enumerate(ready):
            if seq.request.max_tokens == 0:  # only the prompt was wanted (its logprobs)
                self._finish(seq, "length")
                touched[seq.request.request_id] = seq.request
                continue
            try:
                children = self._fork(seq)
            except VmmError as exc:
                self._fail_request(seq.request, exc, touched)
                continue
            for s in (seq, *children):
                seqs.append(s)
                rows.append(row)
        if not seqs:
            return
        if rows != list(range(len(ready))):
            logits = logits[torch.tensor(rows, device=logits.device)]
        t = time.perf_counter_ns()
        result = self.sampler(logits, [s.sampling_state for s in seqs])
        self.last_step.sample_ns = time.perf_counter_ns() - t
        now = time.monotonic()
        for i, seq in enumerate(seqs):
            top = result.top_logprobs[i] if result.top_logprobs is not None else None
            lp = result.logprobs[i] if result.logprobs is not None else None
            self._append(seq, result.token_ids[i], lp, top)
            req = seq.request
            if req.first_token_time is None:
                req.first_token_time = now
            touched[req.request_id] = req

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """After the prompt, make the n-1 other samples share the parent's KV; VmmError when
        the memory is refused (the request must fail)."""
        children = self.outputs.fork(parent)
        parent.pending_forks = 0
        for i, child in enumerate(children):
            try:  # refused: no slot (reserved at admission) or the mapping budget is spent
                if not self.kv.fork(parent.seq_id, child.seq_id):
                    raise VmmError(f"fork of {parent.seq_id} refused: no slot or VMA budget "
                                   "left")
            except VmmError:
                for unforked in children[i:]:
                    parent.request.seqs.remove(unforked)
                raise
            child.num_computed_tokens = parent.num_computed_tokens
            self.scheduler.add(child)
        return children

    def _append(self, seq: Sequence, token: int, logprob: float | None,
                top: list[tuple[int, float]] | None) -> bool:
        """Append a sampled token; True when ``seq`` finished with it."""
        self.counters.generation_tokens += 1
        reason = self.outputs.append(seq, token, logprob, top)
        if reason is not None:
            self._finish(seq, reason)
        return reason is not None

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        self.counters.finished[reason] += 1
        if self.spec is not None:
            self.spec.finished(seq)

    # -- outputs ------------------------------------------------------------------------------
    def _output(self, req: Request) -> RequestOutput | None:
        """``req``'s output after this step (None: nothing for its kind yet); a finished
        request is forgotten."""
        if req.is_finished:
            req.finish_time = req.finish_time or time.monotonic()
            self.requests.pop(req.request_id, None)
        return self.outputs.output(req)

    def close(self) -> None:
        """Abort everything, release the KV memory and stop the tensor-parallel ranks (safe to
        call again; an engine nobody closes is released when it is garbage-collected)."""
        if not self._resources.alive:
            return
        for request_id in list(self.requests):
            self.abort_request(request_id)
        if self.spec is not None:
            self.spec.close()
        self._resources()

    def check_health(self) -> None:
        """Raise if the engine cannot step any more (a tensor-parallel rank died or hangs);
        the async engine calls it while idle."""
        self.executor.check_health()
