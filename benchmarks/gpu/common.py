"""Helpers shared by the GPU check steps (each step is its own process; see check.py).

A step calls :func:`run_step` with its ``main(res)``; ``res.check(name, ok, **data)`` records a
pass/fail item and ``res.data[...]`` free-form numbers. The JSON is rewritten after every record,
so a step killed by its timeout or by a sticky CUDA error (700, illegal address) still leaves
what it had measured. Exit code: 0 all checks passed, 1 a check failed, 2 an exception.

``VMKV_CHECK_DEVICE=cpu`` is the dry run: the same steps on the host memory backend, CPU
kernels and the Triton interpreter, at tiny shapes; facts only a GPU has are recorded as
:data:`NA_CPU`. ``VMKV_STEP_BUDGET`` (set by check.py from the step's timeout) is the seconds a
step with a time budget may spend before it stops starting new work.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
WORK = Path(os.environ.get("VMKV_CHECK_WORK", "/tmp/vmkv-gpu-check"))  # models, builds
DEVICE = os.environ.get("VMKV_CHECK_DEVICE", "cuda")
ON_CPU = DEVICE == "cpu"
NA_CPU = "n/a on cpu"


class Result:
    """One step's record, flushed to ``path`` on every change."""

    def __init__(self, name: str, path: Path) -> None:
        self.name = name
        self.path = path
        self.started = time.monotonic()
        self.checks: list[dict[str, Any]] = []
        self.data: dict[str, Any] = {}
        self.headline = ""
        self.error: str | None = None
        self.flush()

    def check(self, name: str, ok: bool, **data: Any) -> bool:
        self.checks.append({"name": name, "ok": bool(ok), **data})
        status = "ok  " if ok else "FAIL"
        detail = " ".join(f"{k}={_short(v)}" for k, v in data.items())
        print(f"[{self.name}] {status} {name} {detail}", flush=True)
        self.flush()
        return bool(ok)

    def record(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.flush()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    @property
    def ok(self) -> bool:
        return self.error is None and all(c["ok"] for c in self.checks)

    def flush(self) -> None:
        doc = {"step": self.name, "ok": self.ok, "seconds": round(self.elapsed(), 2),
               "headline": self.headline, "checks": self.checks, "data": self.data,
               "error": self.error}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=_jsonable))
        tmp.replace(self.path)


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    text = str(v)
    return text if len(text) < 80 else text[:77] + "..."


def _jsonable(v: Any) -> Any:
    try:
        import numpy as np

        if isinstance(v, np.generic):
            return v.item()
    except ImportError:
        pass
    return str(v)


def run_step(name: str, main: Callable[[Result], None]) -> None:
    """Run ``main`` with a fresh :class:`Result`; exit with the step's status."""
    out = Path(os.environ.get("VMKV_CHECK_OUT", ROOT / "benchmarks" / "results"))
    out.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    res = Result(name, out / f"{name}.json")
    try:
        main(res)
    except BaseException as exc:  # noqa: BLE001 - recorded, then the exit code says it
        res.error = f"{type(exc).__name__}: {exc}"
        res.record("traceback", traceback.format_exc())
        print(f"[{name}] ERROR {res.error}", flush=True)
        traceback.print_exc()
        res.flush()
        sys.exit(2)
    res.flush()
    sys.exit(0 if res.ok else 1)


def guard(res: Result, name: str, fn: Callable[[], Any]) -> Any:
    """Run one sub-check; an exception becomes a failed check (the step goes on), unless it
    is a CUDA error that poisons the context (then the step stops: later work would lie)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        msg = f"{type(exc).__name__}: {exc}"
        res.check(name, False, error=msg[:500], traceback=traceback.format_exc()[-3000:])
        if "illegal" in msg.lower() or "CUDA_ERROR_ILLEGAL" in msg or "error 700" in msg:
            raise
        return None


def time_ms(fn: Callable[[], Any], *, warmup: int = 3, iters: int = 10, inner: int = 1
            ) -> dict[str, float]:
    """Median / min milliseconds per call of ``fn`` on the check's device
    (:func:`vmkv.bench.timing.time_ms`)."""
    from vmkv.bench.timing import time_ms as timed

    return timed(fn, DEVICE, warmup=warmup, iters=iters, inner=inner)


def sync() -> None:
    """Wait for the device (nothing to wait for on a CPU dry run)."""
    from vmkv.bench.timing import sync as sync_device

    sync_device(DEVICE)


def step_budget(default: float) -> float:
    """This step's time budget in seconds (``VMKV_STEP_BUDGET``, else ``default``)."""
    return float(os.environ.get("VMKV_STEP_BUDGET", default))


def tests_on_path() -> None:
    """Make ``tests/``'s pytest-free helpers importable (attention_scenarios, model_helpers...)."""
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)


def memory_backend(max_pages: int, host_page_size: int = 64 << 10) -> Any:
    """The check's memory backend: CUDA VMM (2 MiB pages), or on a CPU dry run the host
    backend (mmap + memfd) with ``host_page_size`` pages."""
    if ON_CPU:
        from vmkv.memory.host import HostMemoryBackend

        return HostMemoryBackend(host_page_size, max_pages)
    from vmkv.memory.cuda import CudaMemoryBackend

    return CudaMemoryBackend(None, max_pages)


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    import torch

    def copy_ms() -> float:
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        return time_ms(lambda: dst.copy_(src), warmup=2, iters=5)["min_ms"]

    t = copy_ms()
    torch.cuda.empty_cache()
    return 2 * nbytes / (t / 1e3)


def percentiles_us(samples_ns: list[int]) -> dict[str, float]:
    import numpy as np

    if not samples_ns:
        return {}
    a = np.asarray(samples_ns, dtype=np.float64) / 1e3
    return {"n": len(a), "p50_us": float(np.percentile(a, 50)),
            "p99_us": float(np.percentile(a, 99)), "max_us": float(a.max())}


def tiny_llama_config(**overrides: Any) -> Any:
    """A small Llama (GQA, head_dim 32) for token-equality checks."""
    import transformers

    kw = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
              rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              architectures=["LlamaForCausalLM"])
    kw.update(overrides)
    return transformers.LlamaConfig(**kw)


LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                 bos_token_id=128000, eos_token_id=128001, architectures=["LlamaForCausalLM"])
#: Llama-3.2-1B's shapes (head_dim 64), untied lm_head: 1.5 G parameters, a 3 GB bf16 checkpoint
LLAMA32_1B = {**LLAMA3_8B, "hidden_size": 2048, "intermediate_size": 8192,
              "num_hidden_layers": 16, "head_dim": 64, "tie_word_embeddings": False}


def save_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A whitespace word-level tokenizer with ``vocab_size`` tokens ("t0", "t1", ...), saved
    as an HF fast tokenizer (no network: built from the tokenizers library)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t3", bos_token="t1",
                                   eos_token="t2", pad_token="t0")
    fast.save_pretrained(path)


def random_vmkv_model(cfg: Any, dtype: Any, device: str = "cuda", seed: int = 0) -> Any:
    """A vmkv :class:`LlamaModel` with random weights made on the device (no disk, fast even
    for 8B shapes): norms ~1, everything else N(0, 0.02)."""
    import torch

    from vmkv.models import LlamaModel, ModelConfig

    mcfg = ModelConfig.from_hf(cfg)
    model = LlamaModel(mcfg, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.eval()
    return model, mcfg


def llama_param_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes of a LlamaForCausalLM with config ``cfg``."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    d = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (v, h)
    return shapes


def fast_scratch(min_free_bytes: int) -> Path:
    """``/dev/shm`` (RAM) when it has room, else the work folder (disk)."""
    import shutil

    shm = Path("/dev/shm")
    try:
        if shm.is_dir() and shutil.disk_usage(shm).free > min_free_bytes:
            return shm / "vmkv-gpu-check"
    except OSError:
        pass
    return WORK


def save_random_checkpoint(cfg: Any, path: Path, *, device: str = "cuda",
                           shard_bytes: int = 4 << 30, seed: int = 0,
                           deadline: float | None = None) -> float:
    """Write a random-weight bf16 safetensors checkpoint of ``cfg`` (sharded, with an index)
    to ``path``, generating weights on ``device``; returns the seconds it took. Raises
    TimeoutError after a shard once ``deadline`` (``time.monotonic()``) has passed."""
    import torch
    from safetensors.torch import save_file

    start = time.monotonic()
    path.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(path)
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, Any] = {}
    size = total = 0
    files: list[str] = []

    def flush() -> None:
        nonlocal shard, size
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(path / name), metadata={"format": "pt"})
            files.append(name)
            weight_map.update({k: name for k in shard})
            shard, size = {}, 0

    for name, shape in llama_param_shapes(cfg).items():
        t = torch.empty(shape, dtype=torch.bfloat16, device=device)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        else:
            t.normal_(0.0, 0.02, generator=gen)
        shard[name] = t.cpu()
        size += t.numel() * 2
        total += t.numel() * 2
        if size >= shard_bytes:
            flush()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"checkpoint writing to {path} passed its deadline")
    flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return time.monotonic() - start
