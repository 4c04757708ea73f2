"""Engine configuration: what a user sets (frozen); derived sizes are computed at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field

from vmkv.config import LINEAR_BACKENDS, CacheConfig
from vmkv.engine.scheduler import PREEMPTION_MODES

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    """Everything :class:`~vmkv.engine.llm_engine.LLMEngine` needs to start.

    Attributes:
        model: HF model folder, a ``.gguf`` file, or None for the default model.
        device: "cpu" or "cuda[:N]".
        dtype: weights and KV dtype; "auto" is float32 on CPU (these CPUs have no fast bf16)
            and bfloat16 on CUDA.
        max_model_len: longest prompt + output; None takes the model's limit.
        max_num_seqs: most sequences running at once (also the number of virtual slots).
        max_num_batched_tokens: token budget of one step (chunked prefill fills it).
        preemption_mode: "recompute" or "swap".
        cache: KV memory settings (mode, budget, page size, layout, block size).
        seed: seed of the shared generator for unseeded sampling.
        tokenizer: tokenizer folder when it differs from the model's.
        linear_backend: "auto" (oneDNN-packed linears for float32 on CPU), "onednn" or
            "torch" (plain ``F.linear``, bit-for-bit what transformers computes).
    """

    model: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    preemption_mode: str = "recompute"
    cache: CacheConfig = field(default_factory=CacheConfig)
    seed: int = 0
    tokenizer: str | None = None
    linear_backend: str = "auto"

    def __post_init__(self) -> None:
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.linear_backend not in LINEAR_BACKENDS:
            raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, "
                             f"got {self.linear_backend!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, "
                             f"got {self.preemption_mode!r}")

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"
