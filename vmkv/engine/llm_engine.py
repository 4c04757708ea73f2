"""The engine: requests in, one scheduled model step at a time, outputs out (single-threaded).

    add_request ──> Scheduler.waiting ──schedule()──> ModelRunner.execute ──> Sampler
                                                         │ fork n>1 after the prompt
    RequestOutput <── stop checks, detokenise <── append token ─┘

Not thread-safe: :class:`~vmkv.engine.async_engine.AsyncEngine` runs it on its own thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from vmkv import envs
from vmkv.config import EngineConfig
from vmkv.distributed.executor import TensorParallelExecutor
from vmkv.engine.cuda_graphs import maybe_create_graph_runner
from vmkv.engine.detokenizer import IncrementalDetokenizer
from vmkv.engine.front import stop_token_ids
from vmkv.engine.model_runner import ModelRunner, PromptHidden
from vmkv.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from vmkv.engine.scheduler import Scheduler
from vmkv.engine.sequence import Request, Sequence, truncate_prompt
from vmkv.engine.shard import build_shard
from vmkv.engine.stopping import check_stop, stream_safe_len
from vmkv.kv.base import VmmError
from vmkv.memory.mapper import BackgroundMapper
from vmkv.models import load_tokenizer, resolve_model
from vmkv.sampling import Sampler, SamplingState
from vmkv.sampling.logprobs import prompt_logprobs
from vmkv.sampling.token_constraints import bad_words_token_ids
from vmkv.sampling_params import SamplingParams
from vmkv.structured.compiler import GrammarCompilerCache
from vmkv.structured.matcher import GrammarState

logger = logging.getLogger("vmkv")

#: tokens ahead of every running request the background mapper maps (virtual mode, CUDA)
PREMAP_LOOKAHEAD_TOKENS = 16


@dataclass
class EngineCounters:
    """Monotonic counters since start-up (the server exports them to Prometheus)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] | None = None
    steps: int = 0

    def __post_init__(self) -> None:
        self.finished = {"stop": 0, "length": 0, "abort": 0, "error": 0}


class LLMEngine:
    """Continuous-batching engine over one model and one KV cache manager."""

    def __init__(self, config: EngineConfig) -> None:
        started = time.monotonic()
        if config.data_parallel_size != 1:
            raise ValueError(f"an LLMEngine is one replica, got data_parallel_size="
                             f"{config.data_parallel_size}; replicas are served by "
                             "vmkv.engine.data_parallel.DataParallelEngine (vmkv serve, vmkv "
                             "bench throughput)")
        self.config = config
        self.model_path = resolve_model(config.model)
        self.tokenizer = load_tokenizer(config.tokenizer or self.model_path)  # before any rank
        # tensor parallelism: workers for ranks 1..N-1 (they build their shards meanwhile)
        self.tp: TensorParallelExecutor | None = None
        if config.tensor_parallel_size > 1:
            self.tp = TensorParallelExecutor(config, self.model_path)
        try:
            shard = build_shard(config, self.model_path)
            if self.tp is not None:
                self.tp.wait_ready(shard.kv)
        except BaseException:
            if self.tp is not None:
                self.tp.close(graceful=False)
            raise
        self.model, self.model_config = shard.model, shard.model_config
        self.max_model_len, self.attn, self.compiled, self.fused = (
            shard.max_model_len, shard.attn, shard.compiled, shard.fused)
        # the scheduler's and the engine's KV calls reach every rank through the recorder
        self.kv = shard.kv if self.tp is None else self.tp.record(shard.kv)
        self.dtype = self.model.dtype
        # virtual mode on CUDA: map the next steps' pages while the GPU computes (off with
        # VMKV_BACKGROUND_MAPPER=0, and under tensor parallelism); the KV manager waits for it
        self.mapper: BackgroundMapper | None = None
        if envs.background_mapper() and self.tp is None:
            self.mapper = self.kv.start_background_mapper()
        # decode steps as CUDA graphs (off with --enforce-eager or VMKV_CUDA_GRAPHS=0, and under
        # tensor parallelism); None on the CPU
        self.graphs = None if config.enforce_eager or self.tp is not None else (
            maybe_create_graph_runner(self.model, self.attn, max_batch_size=config.max_num_seqs,
                                      mapper=self.mapper))
        self.scheduler = Scheduler(self.kv, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   preemption_mode=config.preemption_mode)
        self.runner = ModelRunner(self.model, self.attn, self.graphs, self.tp)
        generator = torch.Generator(device=config.device).manual_seed(config.seed)
        self.sampler = Sampler(generator)
        self.eos_token_ids = stop_token_ids(self.model_config, self.tokenizer)
        # structured outputs: xgrammar grammars for this tokenizer, compiled once per params
        self.grammars = GrammarCompilerCache(self.tokenizer, self.model_config.vocab_size,
                                             self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.counters = EngineCounters()
        self.startup_seconds = time.monotonic() - started
        for line in self.startup_report():
            logger.info(line)

    # -- reporting ----------------------------------------------------------------------------
    def startup_report(self) -> list[str]:
        """What vLLM users read at start-up: capacity, concurrency, and the KV geometry."""
        kv, cap = self.kv, self.kv.capacity_tokens
        lines = [
            f"model {self.model_path.name} ({self.model_config.architecture}, {self.dtype}) "
            f"on {self.config.device}, loaded in {self.startup_seconds:.1f} s",
            f"KV cache: {kv.kv_mode} mode, {kv.usage.capacity_bytes / 2**20:,.0f} MiB physical "
            f"= {cap:,} tokens; maximum concurrency for {self.max_model_len:,} tokens per "
            f"request: {cap / self.max_model_len:.2f}x; prefix caching "
            f"{'on' if self.kv.prefix is not None else 'off'}",
            kv.describe(),
            ("decoder layers fused (C++ calls around the attention)" if self.fused is not None
             else "decoder layers compiled (TorchInductor)" if self.compiled
             else "model runs eagerly"),
        ]
        if self.tp is not None:
            lines.append(f"tensor parallel: {self.tp.size} ranks; each holds the KV above for "
                         f"{self.model.config.num_kv_heads} of the "
                         f"{self.model_config.num_kv_heads} KV heads")
        return lines

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, *, arrival_time: float | None = None,
                    cache_salt: str | None = None) -> Request:
        """Validate and queue a request; ValueError (nothing queued) for bad input.

        ``cache_salt``: requests with different salts never share prefix-cached KV.
        """
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        ids = truncate_prompt(ids, params.truncate_prompt_tokens, self.max_model_len)
        self._check_token_params(params)
        max_tokens = self._resolve_max_tokens(len(ids), params)
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n ({params.n}) exceeds max_num_seqs "
                             f"({self.config.max_num_seqs})")
        if len(ids) > self.kv.capacity_tokens:
            raise ValueError(f"the prompt ({len(ids)} tokens) can never fit in the KV cache "
                             f"({self.kv.capacity_tokens} tokens)")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string (or None to share the "
                             f"unsalted cache), got {cache_salt!r}")
        if max_tokens == 0 and params.n != 1:
            raise ValueError(f"max_tokens=0 (score the prompt only) needs n=1, got n={params.n}")
        grammar = None
        if params.structured_outputs is not None:  # ValueError for a grammar xgrammar refuses
            grammar = self.grammars.new_state(params.structured_outputs)
        req = Request(request_id, ids, params, max_tokens, prompt=text, cache_salt=cache_salt,
                      bad_words_token_ids=bad_words_token_ids(self.tokenizer,
                                                              params.bad_words or ()))
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        if arrival_time is not None:
            req.arrival_time = arrival_time
        seq = self._new_sequence(req, 0, list(ids), grammar)
        seq.pending_forks = params.n - 1
        self.requests[request_id] = req
        self.scheduler.add(seq)
        self.counters.prompt_tokens += len(ids)
        return req

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt).input_ids
            text: str | None = prompt
        else:
            ids, text = list(prompt), None
            vocab = self.model_config.vocab_size
            bad = [t for t in ids
                   if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be ints in [0, {vocab}), got {bad[:5]}")
        if not ids:
            raise ValueError("the prompt is empty")
        return text, ids

    def _check_token_params(self, params: SamplingParams) -> None:
        """ValueError for logprobs past ``max_logprobs`` or token ids past the vocabulary."""
        vocab = self.model_config.vocab_size
        most = vocab if self.config.max_logprobs == -1 else self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > most:
                raise ValueError(f"{name} must be at most {most} (max_logprobs), got {value}")
        for name, ids in (("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"{name} must hold token ids in [0, {vocab}), got {bad[:5]}")

    def _resolve_max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ValueError(f"this model's maximum context length is {self.max_model_len} "
                             f"tokens; the prompt has {prompt_len}, leaving no room for output")
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{prompt_len + params.max_tokens} were requested ({prompt_len} in the prompt, "
                f"{params.max_tokens} in max_tokens)")
        return params.max_tokens

    def _new_sequence(self, req: Request, index: int, token_ids: list[int],
                      grammar: GrammarState | None = None) -> Sequence:
        params = req.params
        if index and params.seed is not None:  # each sample its own reproducible stream
            params = replace(params, seed=(params.seed + index) % 2**63)
        state = SamplingState(params, req.prompt_token_ids, [], self.eos_token_ids,
                              grammar=grammar, bad_words_token_ids=req.bad_words_token_ids,
                              device=self.config.device)
        seq = Sequence(f"{req.request_id}:{index}", req, index, token_ids,
                       len(req.prompt_token_ids), state)
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.num_prompt_tokens,
                                                 req.params.skip_special_tokens)
        req.seqs.append(seq)
        return seq

    def abort_request(self, request_id: str, stop_reason: str | None = None
                      ) -> RequestOutput | None:
        """Stop a request and free its KV now; None if it is unknown or already finished.

        ``stop_reason`` says why in the output (the server uses "timeout" and "shutdown")."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._finish_all(req, "abort", stop_reason)
        return self._finish_request(req)

    def _finish_all(self, req: Request, reason: str, stop_reason: str | None = None) -> None:
        """Finish every unfinished sequence of ``req`` with ``reason``, freeing its KV."""
        for seq in req.seqs:
            seq.pending_forks = 0
            if not seq.is_finished:
                seq.finish_reason, seq.stop_reason = reason, stop_reason
                self.scheduler.remove(seq)
                self.counters.finished[reason] += 1

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
        return self.kv.reset_prefix_cache()

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; outputs of every request that changed (finished ones last
        appear with ``finished=True`` and are forgotten)."""
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
            self.counters.steps += 1
            now = time.monotonic()
            for seq in out.scheduled:
                if seq.request.first_scheduled_time is None:
                    seq.request.first_scheduled_time = now
            logits, ready, prompt_hidden = self.runner.execute(out)
            self._record_prompt_logprobs(prompt_hidden)
            self.scheduler.update(out)
            if self.mapper is not None:  # map ahead while the GPU computes; any KV call
                # waits for it (sampling below syncs with the GPU first)
                self.mapper.submit(self.kv.premap_ahead(PREMAP_LOOKAHEAD_TOKENS))
            if ready:
                self._sample(logits, ready, touched)
            if self.mapper is not None:
                self.mapper.wait()  # idle between steps (abort/add never race with it)
        return [self._output(req) for req in touched.values()]

    def _record_prompt_logprobs(self, prompt_hidden: list[PromptHidden]) -> None:
        """Score the prompt tokens this step's prefill chunks predict (in the same forward)."""
        for seq, first, hidden in prompt_hidden:
            req = seq.request
            targets = seq.token_ids[first + 1 : first + 1 + len(hidden)]
            req.prompt_logprobs.extend(prompt_logprobs(self.model.compute_logits, hidden,
                                                       targets, req.params.prompt_logprobs))

    def _sample(self, logits: torch.Tensor, ready: list[Sequence],
                touched: dict[str, Request]) -> None:
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
        result = self.sampler(logits, [s.sampling_state for s in seqs])
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
        req, children = parent.request, []
        grammar = parent.sampling_state.grammar
        for index in range(1, parent.pending_forks + 1):
            child = self._new_sequence(req, index, list(parent.token_ids),
                                       grammar.fork() if grammar is not None else None)
            try:
                forked = self.kv.fork(parent.seq_id, child.seq_id)
            except VmmError:
                req.seqs.remove(child)
                raise
            if not forked:  # no slot (reserved at admission) or the mapping budget is spent
                req.seqs.remove(child)
                raise VmmError(f"fork of {parent.seq_id} refused: no slot or VMA budget left")
            child.num_computed_tokens = parent.num_computed_tokens
            self.scheduler.add(child)
            children.append(child)
        parent.pending_forks = 0
        return children

    def _append(self, seq: Sequence, token: int, logprob: float | None,
                top: list[tuple[int, float]] | None) -> None:
        seq.token_ids.append(token)
        seq.sampling_state.output_token_ids.append(token)
        self.counters.generation_tokens += 1
        if seq.request.params.logprobs is not None:
            entry = {token: float(logprob)} if logprob is not None else {}
            entry.update({t: float(v) for t, v in (top or [])})
            seq.logprobs.append(entry)
        grammar = seq.sampling_state.grammar
        if grammar is not None and not grammar.accept(token):  # the mask makes this unreachable
            logger.error("%s: the grammar rejected token %d; aborting", seq.seq_id, token)
            self._finish(seq, "abort")
            return
        start = len(seq.output_text)
        seq.output_text += seq.detokenizer.step(seq.token_ids)
        check_stop(seq, start, self.eos_token_ids, self.max_model_len)
        if seq.finish_reason is None and grammar is not None and grammar.is_terminated:
            seq.finish_reason = "stop"  # the grammar took EOS although ignore_eos was set
        if seq.finish_reason is not None:
            self._finish(seq, seq.finish_reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        self.counters.finished[reason] += 1

    # -- outputs ------------------------------------------------------------------------------
    def _output(self, req: Request) -> RequestOutput:
        if req.is_finished:
            return self._finish_request(req)
        return self._make_output(req, finished=False)

    def _finish_request(self, req: Request) -> RequestOutput:
        req.finish_time = req.finish_time or time.monotonic()
        self.requests.pop(req.request_id, None)
        return self._make_output(req, finished=True)

    def _make_output(self, req: Request, *, finished: bool) -> RequestOutput:
        outputs = [
            CompletionOutput(
                index=s.index,
                text=s.output_text[: stream_safe_len(s)],
                token_ids=s.output_token_ids,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                logprobs=list(s.logprobs) if req.params.logprobs is not None else None,
            )
            for s in sorted(req.seqs, key=lambda s: s.index)
        ]
        metrics = RequestMetrics(req.arrival_time, req.first_scheduled_time,
                                 req.first_token_time, req.finish_time)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outputs,
                             finished, metrics, req.num_cached_tokens, req.error,
                             prompt_logprobs=None if req.prompt_logprobs is None
                             else list(req.prompt_logprobs))

    def close(self) -> None:
        """Abort everything and release the KV memory."""
        for request_id in list(self.requests):
            self.abort_request(request_id)
        self.kv.close()
        if self.mapper is not None:
            self.mapper.close()
        if self.tp is not None:
            self.tp.close()

    def check_health(self) -> None:
        """Raise if the engine cannot step any more (a tensor-parallel rank died or hangs);
        the async engine calls it while idle."""
        if self.tp is not None:
            self.tp.check_health()
