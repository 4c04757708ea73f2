"""``vmkv bench profile``: where one engine step goes, part by part, against each part's roofline.

Two steps are profiled on the real engine (the model, the KV cache, the scheduler, the sampler):

    decode    ``batch`` requests, each ``context`` tokens in, one new token each
    prefill   ``prefill_batch`` fresh requests of ``prefill_len`` tokens, prefilled at once

and each step's wall time is split into parts that add up to it exactly:

    gemm           the decoder layers' linears (qkv, o, gate_up, down)
    lm_head        the vocabulary projection (compute_logits)
    attention      the attention backend's kernels (decode kernel, SDPA)
    kv_write       the backend's separate K/V write (on the CPU a step where every request
                   decodes has none: the decode kernel stores the new rows, inside attention)
    glue           the rest of the forward: embedding, norms, RoPE, activation, residual adds
    sampler        logits -> token ids (and logprobs): the engine's own ``last_step.sample_ns``
    engine_python  the rest of the step: scheduler, KV manager, step plan, fork, append,
                   detokenise, stop checks and outputs

Timing wraps the model's and the attention backend's public entry points for the measurement
only (wall clock, ``perf_counter_ns``; the wrappers cost ~1 us per call); the engine's parts
come from its step stats (:class:`~vmkv.engine.llm_engine.StepStats`), never from wrapping it.
Compiled layers are measured too: their linears and their
attention are opaque calls the wrappers still see, and glue is what the fused code spends
around them. Fused C++ layers (:mod:`vmkv.models.fused_layers`) count their GEMMs' time
themselves while profiled (``clock_gettime`` around each GEMM); the rest of them is glue.
``cores_idle`` is the share of the step's core-time no thread of this process spent running
(1 - process CPU time / (wall x threads)): waiting, not working.

Rooflines, measured on this machine in the same run: FLOPs / the linear backend's rate on a
2048^3 product in the engine's dtype; bytes read / the read bandwidth of a 256 MiB tensor (a
sum over it); bytes read and written / its copy bandwidth (both directions counted). Attention
takes the larger of its FLOPs (QK and PV over every causal pair) and its reads (each request's
K/V once); the K/V write writes the new rows; glue reads and writes the activations about
``GLUE_PASSES`` times per layer; the sampler reads the logits.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from vmkv.bench.timing import call_ms
from vmkv.kernels import cpu_bf16
from vmkv.kernels.cpu_decoder_layer import GEMM_NS
from vmkv.kernels.cpu_quant import ATTENTION_NS
from vmkv.models import linear as linear_module
from vmkv.models.linear import PackedLinear

PARTS = ("gemm", "lm_head", "attention", "kv_write", "glue", "sampler", "engine_python")
COLUMNS = ("phase", "part", "ms", "share_%", "roofline_ms", "x_roofline")
#: activation passes of the glue per layer: 2 norms (read + write), 2 residual adds (2 reads +
#: 1 write), RoPE on q and k (read + write), SiLU-and-multiply over the MLP (2 reads + 1 write)
GLUE_PASSES = "2*2*hidden + 2*3*hidden + 2*(q_size + kv_size) + 3*intermediate"


class StepTimer:
    """Times the parts of every engine step while installed (:meth:`close` removes it)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.ns: dict[str, int] = {}
        self.flops: dict[str, int] = {"gemm": 0, "lm_head": 0}
        self._undo: list[Callable[[], None]] = []
        self._in_lm_head = False
        parts = engine.executor.model_parts()  # rank 0's model and attention backend
        model = parts.model
        #: fused C++ layers (vmkv.models.fused_layers) time their own GEMMs
        self.fused = parts.fused
        if self.fused is not None:
            fused = self.fused
            fused.profile(True)
            self._undo.append(lambda: fused.profile(False))
        if any(isinstance(m, PackedLinear) for m in model.modules()):
            # every packed linear, eager or called from compiled layers, goes through one
            # of these (mkl/onednn; brgemm)
            self._wrap(linear_module, "packed_gemm", "gemm", gemm=True)
            self._wrap(cpu_bf16, "linear", "gemm", gemm=True)
        else:  # plain nn.Linear layers (eager only: compiled ones are fused out of reach)
            for layer in model.layers:
                for module in layer.modules():
                    if isinstance(module, torch.nn.Linear):
                        self._wrap(module, "forward", "gemm", gemm=True)
        self._wrap(model, "compute_logits", "lm_head", gemm=True)
        self._wrap(model, "forward", "forward")
        self._wrap(parts.attention, "write_kv", "kv_write")
        self._wrap(parts.attention, "forward", "attention_forward")  # the write and the attention

    def _wrap(self, obj: Any, method: str, part: str, *, gemm: bool = False) -> None:
        """Time ``obj.method`` into ``part`` (a GEMM's FLOPs from its input and output
        shapes); the LM head's own linear is the LM head's, not a layer GEMM."""
        inner = getattr(obj, method)

        @functools.wraps(inner)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if part == "gemm" and self._in_lm_head:
                return inner(*args, **kwargs)
            self._in_lm_head = part == "lm_head"
            start = time.perf_counter_ns()
            try:
                out = inner(*args, **kwargs)
            finally:
                self._in_lm_head = False
            self.ns[part] = self.ns.get(part, 0) + time.perf_counter_ns() - start
            if gemm:  # x [M, K] -> out [M, N]: 2 M K N
                self.flops[part] += 2 * args[0].shape[0] * args[0].shape[1] * out.shape[1]
            elif part == "forward" and self.fused is not None:  # input_ids [T], keep [N]
                keep = args[4] if len(args) > 4 else kwargs.get("keep")
                self.flops["gemm"] += self.fused.step_flops(
                    args[0].shape[0], None if keep is None else keep.shape[0])
            return out

        had_own = method in vars(obj)
        setattr(obj, method, timed)
        self._undo.append(lambda: setattr(obj, method, inner) if had_own
                          else delattr(obj, method))

    def step(self) -> dict[str, float]:
        """Run one engine step; its parts in ms, plus ``step_ms``, FLOPs and idle share."""
        self.ns = {}
        self.flops = {"gemm": 0, "lm_head": 0}
        if self.fused is not None:
            self.fused.ns.zero_()
        cpu0, t0 = time.process_time(), time.perf_counter_ns()
        self.engine.step()
        wall = time.perf_counter_ns() - t0
        cpu = time.process_time() - cpu0
        if self.fused is not None:  # the fused calls' GEMMs (their elementwise time is glue)
            self.ns["gemm"] = self.ns.get("gemm", 0) + int(self.fused.ns[GEMM_NS])
            # the decode loop's attention calls from C (quantized weights, pure decode)
            if self.fused.ns.numel() > ATTENTION_NS:
                self.ns["attention_forward"] = (self.ns.get("attention_forward", 0)
                                                + int(self.fused.ns[ATTENTION_NS]))
        ms = {k: v / 1e6 for k, v in self.ns.items()}
        ms["attention"] = ms.get("attention_forward", 0.0) - ms.get("kv_write", 0.0)
        inner = sum(ms.get(p, 0.0) for p in ("gemm", "attention", "kv_write"))
        parts = {p: ms.get(p, 0.0) for p in ("gemm", "lm_head", "attention", "kv_write")}
        parts["glue"] = ms.get("forward", 0.0) - inner
        parts["sampler"] = self.engine.last_step.sample_ns / 1e6
        parts["engine_python"] = wall / 1e6 - ms.get("forward", 0.0) - parts["lm_head"] \
            - parts["sampler"]
        threads = torch.get_num_threads()
        return {**parts, "step_ms": wall / 1e6, "gemm_flops": self.flops["gemm"],
                "lm_head_flops": self.flops["lm_head"],
                "cores_idle": max(0.0, 1 - cpu / (wall / 1e9 * threads))}

    def close(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def machine_rates(linear_backend: str, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """GEMM rate (FLOP/s) of the linear backend in ``dtype`` at 2048^3; copy bandwidth (bytes
    read plus bytes written per second) and read bandwidth (bytes/s) over 256 MiB."""
    from vmkv.models.linear import pack_linears

    n = 2048
    lin = torch.nn.Sequential(torch.nn.Linear(n, n, bias=False, dtype=dtype))
    pack_linears(lin, linear_backend)
    x = torch.randn(n, n, dtype=dtype)
    with torch.inference_mode():
        gemm_ms = min(call_ms(lambda: lin(x)) for _ in range(5))
    # written first: an untouched allocation maps the one shared zero page, read from cache
    src = torch.ones(64 << 20, dtype=torch.float32)  # 256 MiB
    dst = torch.zeros_like(src)
    copy_ms = min(call_ms(lambda: dst.copy_(src)) for _ in range(5))
    # attention and the sampler only read: their rooflines use a read-only stream's rate
    read_ms = min(call_ms(lambda: src.sum()) for _ in range(5))
    return {"gemm_flops_per_s": 2 * n**3 / (gemm_ms / 1e3),
            "bandwidth_bytes_per_s": 2 * src.numel() * 4 / (copy_ms / 1e3),
            "read_bytes_per_s": src.numel() * 4 / (read_ms / 1e3)}


def rooflines(engine: Any, phase: dict[str, Any], rates: dict[str, float]) -> dict[str, float]:
    """The time each part would take at this machine's rates (ms); engine Python has none."""
    cfg = engine.model_config
    itemsize = torch.empty((), dtype=engine.executor.dtype).element_size()
    tokens, sampled = phase["new_tokens"], phase["sampled"]
    per_token_kv = engine.kv.spec.bytes_per_token  # the KV dtype's bytes, scales included
    attn_flops = 4 * cfg.q_size * cfg.num_layers * phase["attended_pairs"]
    glue_elems = (2 * 2 * cfg.hidden_size + 2 * 3 * cfg.hidden_size
                  + 2 * (cfg.q_size + cfg.kv_size) + 3 * cfg.intermediate_size)
    bw, flops = rates["bandwidth_bytes_per_s"], rates["gemm_flops_per_s"]
    read = rates["read_bytes_per_s"]
    return {
        "gemm": phase["gemm_flops"] / flops * 1e3,
        "lm_head": phase["lm_head_flops"] / flops * 1e3,
        "attention": max(attn_flops / flops, phase["kv_tokens_read"] * per_token_kv / read) * 1e3,
        "kv_write": tokens * per_token_kv / bw * 1e3,
        "glue": tokens * cfg.num_layers * glue_elems * itemsize / bw * 1e3,
        "sampler": sampled * cfg.vocab_size * 4 / read * 1e3,
        "engine_python": 0.0,
    }


def _median_parts(samples: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


def _prompt(rng: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=rng).tolist()


def profile_decode(engine: Any, timer: StepTimer, *, batch: int, context: int, repeats: int,
                   warmup: int, rng: torch.Generator) -> dict[str, Any]:
    """Decode steps of ``batch`` requests at ``context`` tokens (prefilled first, untimed)."""
    from vmkv.sampling_params import SamplingParams

    vocab = engine.model_config.vocab_size
    # requests prefilled first decode while the rest prefill: room for all of it
    max_tokens = warmup + repeats + prefill_steps(engine, batch * context) + 2
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"decode-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, _prompt(rng, context, vocab), params)
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                               for s in sched.running):
        engine.step()
    for _ in range(warmup):
        engine.step()
    samples = []
    for _ in range(repeats):
        if len(sched.running) != batch:
            raise RuntimeError(f"{len(sched.running)} requests decode, not {batch}: raise "
                               "max_model_len or the KV budget")
        samples.append(timer.step())
    held = [engine.scheduler.running[i].num_tokens for i in range(batch)]
    for rid in ids:
        engine.abort_request(rid)
    mid = sum(held) // batch - repeats // 2  # tokens each request holds mid-measurement
    return {"phase": "decode", "new_tokens": batch, "kv_tokens_read": batch * mid,
            "attended_pairs": batch * mid, "sampled": batch, **_median_parts(samples)}


def prefill_steps(engine: Any, tokens: int) -> int:
    """Steps the scheduler needs to prefill ``tokens`` prompt tokens."""
    return -(-tokens // engine.config.max_num_batched_tokens)


def profile_prefill(engine: Any, timer: StepTimer, *, batch: int, length: int, repeats: int,
                    warmup: int, rng: torch.Generator) -> dict[str, Any]:
    """Steps that prefill ``batch`` fresh requests of ``length`` tokens at once."""
    from vmkv.sampling_params import SamplingParams

    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    samples = []
    for rep in range(warmup + repeats):
        for i in range(batch):
            engine.add_request(f"prefill-{rep}-{i}", _prompt(rng, length, vocab), params)
        sample = timer.step()  # every prompt prefilled and its one token sampled
        if rep >= warmup:
            samples.append(sample)
        while engine.has_unfinished_requests():
            engine.step()
    # causal: token j of a prompt attends to j + 1 rows; each prompt's K/V is read once
    return {"phase": "prefill", "new_tokens": batch * length, "kv_tokens_read": batch * length,
            "attended_pairs": batch * length * (length + 1) // 2, "sampled": batch,
            **_median_parts(samples)}


def run(config: Any, *, batch: int = 64, context: int = 256, prefill_batch: int = 8,
        prefill_len: int = 256, repeats: int = 5, warmup: int = 2,
        prefill_kernel: bool = True) -> dict[str, Any]:
    """Profile a decode step and a prefill step of an engine built from ``config`` (an
    :class:`~vmkv.config.EngineConfig`; its ``max_num_seqs``/``max_num_batched_tokens``/
    ``max_model_len`` are raised to fit the scenario, prefix caching is turned off).
    ``prefill_kernel=False`` sends CPU prefill chunks to per-request SDPA instead of the
    batched kernel (to see what the kernel is worth)."""
    from dataclasses import replace

    from vmkv.engine.llm_engine import LLMEngine

    config = replace(config, enable_prefix_caching=False,
                     max_num_seqs=max(config.max_num_seqs, batch, prefill_batch),
                     max_num_batched_tokens=max(config.max_num_batched_tokens,
                                                prefill_batch * prefill_len),
                     max_model_len=max(config.max_model_len or 0, prefill_len + 8,
                                       2 * context + warmup + repeats + 8))
    engine = LLMEngine(config)
    needed = batch * (context + warmup + repeats)  # decode's requests, held at once
    if needed > engine.kv.accounting.capacity_tokens:
        engine.close()
        raise ValueError(f"--batch-size {batch} x --context-len {context} needs about "
                         f"{needed} KV tokens, the KV budget holds "
                         f"{engine.kv.accounting.capacity_tokens}: raise --kv-cache-memory")
    attn = engine.executor.model_parts().attention
    if not prefill_kernel and hasattr(attn, "batched_prefill"):
        attn.batched_prefill = False
    rates = machine_rates(config.linear_backend, engine.executor.dtype)
    rng = torch.Generator().manual_seed(0)
    timer = StepTimer(engine)
    try:
        phases = [
            profile_decode(engine, timer, batch=batch, context=context, repeats=repeats,
                           warmup=warmup, rng=rng),
            profile_prefill(engine, timer, batch=prefill_batch, length=prefill_len,
                            repeats=repeats, warmup=warmup, rng=rng),
        ]
    finally:
        timer.close()
    rows = []
    for phase in phases:
        roof = rooflines(engine, phase, rates)
        phase["roofline_ms"] = roof
        phase["output_tokens_per_s"] = phase["sampled"] / (phase["step_ms"] / 1e3)
        for part in PARTS:
            rows.append({"phase": phase["phase"], "part": part, "ms": phase[part],
                         "share_%": 100 * phase[part] / phase["step_ms"],
                         "roofline_ms": roof[part],
                         "x_roofline": phase[part] / roof[part] if roof[part] else None})
        rows.append({"phase": phase["phase"], "part": "step", "ms": phase["step_ms"],
                     "share_%": 100.0, "roofline_ms": sum(roof.values()),
                     "x_roofline": phase["step_ms"] / sum(roof.values())})
    engine.close()
    return {"bench": "profile", "rates": rates, "kv_mode": config.kv_mode,
            "compiled": engine.executor.layers == "compiled",
            "fused_layers": engine.executor.layers == "fused",
            "prefill_kernel": prefill_kernel, "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "scenario": {"batch": batch, "context": context, "prefill_batch": prefill_batch,
                         "prefill_len": prefill_len, "repeats": repeats, "warmup": warmup},
            "glue_passes": GLUE_PASSES, "phases": phases, "rows": rows}
