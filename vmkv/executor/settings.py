"""What one rank needs to build its part of the engine: the values the executor takes from the
:class:`~vmkv.config.EngineConfig` once, so the rooms below the engine receive those values and
not the config (docs/ARCHITECTURE.md, "Imports and configuration")."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vmkv.config import CacheConfig, EngineConfig


@dataclass(frozen=True)
class WorkerSettings:
    """How every rank builds its :class:`~vmkv.executor.worker.Worker` (the same on each:
    tensor-parallel workers receive rank 0's at start-up, so their geometry and warm-up agree).

    Attributes:
        model_path: the model folder or ``.gguf`` file (resolved).
        device: rank 0's device (``cpu`` or ``cuda[:N]``; other ranks take the next GPUs).
        dtype: the weights' (and activations') dtype, resolved (never ``auto``).
        kv_cache_dtype: the KV cache's dtype, resolved (the model's, or ``int8``).
        linear_backend: the CPU linears (``vmkv.models.linear``).
        quantization: the weights' format (``vmkv.models.quant``; ``auto`` resolved at load).
        lm_head_dtype: the LM head's products (``auto`` or ``int8``,
            ``vmkv.models.quant.int8_head``).
        tensor_parallel_size: ranks the model is sharded over.
        max_model_len: longest prompt + output asked for (None: the model's limit).
        max_num_seqs: most sequences at once (virtual slots, the largest graph bucket).
        cache: the KV managers' view of the config.
        attention_backend: the CUDA attention kernel asked for.
        fused_layers: CPU layers as C++ calls where the linears allow.
        compile_layers: CPU layers compiled with TorchInductor where not fused.
        background_mapper: the KV manager maps the next steps' pages on a thread (CUDA).
        cuda_graphs: decode steps captured as CUDA graphs (CUDA).
    """

    model_path: Path
    device: str
    dtype: str
    kv_cache_dtype: str
    linear_backend: str
    quantization: str
    lm_head_dtype: str
    tensor_parallel_size: int
    max_model_len: int | None
    max_num_seqs: int
    cache: CacheConfig
    attention_backend: str
    fused_layers: bool
    compile_layers: bool
    background_mapper: bool
    cuda_graphs: bool

    @classmethod
    def from_config(cls, config: EngineConfig, model_path: Path) -> WorkerSettings:
        """The settings ``config`` describes for the model at ``model_path``.

        ``enforce_eager`` turns compiling and CUDA graphs off. With tensor parallelism every
        rank runs eagerly and maps inline: only rank 0's KV manager decides, so a mapper
        thread or a captured graph would act on rank 0 alone."""
        eager = config.enforce_eager
        one_rank = config.tensor_parallel_size == 1
        return cls(
            model_path=model_path, device=config.device, dtype=config.torch_dtype_name,
            kv_cache_dtype=config.kv_cache_dtype_name,
            linear_backend=config.linear_backend, quantization=str(config.quantization),
            lm_head_dtype=config.lm_head_dtype,
            tensor_parallel_size=config.tensor_parallel_size,
            max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
            cache=config.cache, attention_backend=str(config.attention_backend),
            fused_layers=bool(config.fused_layers),
            compile_layers=bool(config.compile_layers) and not eager,
            background_mapper=bool(config.background_mapper) and one_rank,
            cuda_graphs=bool(config.cuda_graphs) and not eager and one_rank)
