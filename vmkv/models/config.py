"""What vmkv needs to know about a checkpoint, read once from its HF config.

One frozen :class:`ModelConfig` covers every supported architecture; within the Llama family
the differences are flags (q/k/v bias, q/k RMSNorm, tied head), and Gemma 3 has its own model
class (:mod:`vmkv.models.gemma3`) over the same config:

    LlamaForCausalLM    attention_bias -> bias on q, k, v and o; mlp_bias; rope default|llama3
    MistralForCausalLM  Llama without biases (sliding window recorded, see ``max_model_len``)
    Qwen2ForCausalLM    bias on q, k, v only
    Qwen3ForCausalLM    RMSNorm per head on q and k; explicit head_dim
    Gemma3ForCausalLM   (1 + w) RMSNorms around attention and MLP, q/k norms, GeGLU (tanh),
                        embedding x sqrt(hidden), query_pre_attn_scalar; sliding-window layers
                        (``layer_windows``) with their own RoPE base (``local_rope``)

Both RoPE spellings are read: transformers 5's ``rope_parameters`` and the older
``rope_theta`` + ``rope_scaling`` attributes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vmkv.kv.spec import KVSpec, LayerGroup, kv_storage_dtype

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
)
_ARCH_OF_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                       "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                       "gemma3_text": "Gemma3ForCausalLM"}
#: the MLP activations: SiLU (the Llama family), tanh-approximated GELU (Gemma's GeGLU)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
ROPE_TYPES = ("default", "llama3")
_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``torch.float32`` / ``"bf16"`` / ``"bfloat16"`` ... -> a supported torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[name]


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; the ``llama3`` fields matter only for that type."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        if self.theta <= 0:
            raise ValueError(f"rope theta must be positive, got {self.theta}")
        if self.rope_type == "llama3" and self.high_freq_factor == self.low_freq_factor:
            raise ValueError("llama3 rope needs high_freq_factor != low_freq_factor")

    @classmethod
    def from_hf(cls, cfg: Any, layer_type: str | None = None) -> RopeConfig:
        """Read ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling`` (4.x);
        ``layer_type`` picks one entry of per-layer-type parameters (Gemma 3's
        ``sliding_attention`` / ``full_attention``; 4.x: ``rope_local_base_freq``)."""
        params = dict(getattr(cfg, "rope_parameters", None) or {})
        if layer_type is not None and isinstance(params.get(layer_type), dict):
            params = dict(params[layer_type])
        elif layer_type == "sliding_attention":  # transformers 4.x Gemma 3: no scaling locally
            return cls(theta=float(getattr(cfg, "rope_local_base_freq", None) or 10000.0))
        if not params:
            params = dict(getattr(cfg, "rope_scaling", None) or {})
        if any(isinstance(v, dict) for v in params.values()):
            raise ValueError("per-layer-type rope parameters are not supported")
        theta = params.get("rope_theta", getattr(cfg, "rope_theta", None) or 10000.0)
        rope_type = params.get("rope_type", params.get("type", "default"))
        partial = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
        if partial not in (None, 1.0):
            raise ValueError(f"partial_rotary_factor={partial} is not supported")
        if rope_type != "llama3":
            return cls(theta=float(theta), rope_type=rope_type)
        return cls(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params.get(
                "original_max_position_embeddings", cfg.max_position_embeddings)),
        )


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of one Llama-family model (see the module docstring)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: torch.dtype | None = None
    sliding_window: int | None = None
    #: the MLP's activation (:data:`ACTIVATIONS`)
    hidden_act: str = "silu"
    #: attention scale ``query_pre_attn_scalar ** -0.5`` (Gemma); None: ``head_dim ** -0.5``
    query_pre_attn_scalar: float | None = None
    #: each layer's sliding window in tokens, 0 for full attention (empty: every layer full,
    #: or one window for all, ``sliding_window``); the attention kernels apply them
    layer_windows: tuple[int, ...] = ()
    #: RoPE of the sliding-window layers where it differs from ``rope`` (Gemma 3's local base)
    local_rope: RopeConfig | None = None
    #: ranks the decoder layers are split over; >1 makes this one rank's shard (its heads and
    #: MLP columns, see :mod:`vmkv.models.sharding`), whose O and down projections are
    #: summed over the ranks
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"{self.architecture}: activation must be one of {ACTIVATIONS}, "
                             f"got {self.hidden_act!r}")
        if self.layer_windows and (len(self.layer_windows) != self.num_layers
                                   or min(self.layer_windows) < 0):
            raise ValueError(f"layer_windows must give each of the {self.num_layers} layers a "
                             f"window >= 0, got {self.layer_windows}")

    @classmethod
    def from_hf(cls, cfg: Any) -> ModelConfig:
        """Build from a transformers ``PretrainedConfig`` (any 4.x/5.x spelling).

        Raises ValueError for an architecture outside :data:`SUPPORTED_ARCHITECTURES` or a
        feature vmkv does not implement (activation other than SiLU, other RoPE types).
        """
        arch = _architecture(cfg)
        if arch == "Gemma3ForCausalLM":
            return _gemma3(cfg)
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{arch}: only the SiLU activation is supported, got {act!r}")
        heads = cfg.num_attention_heads
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        return cls(
            architecture=arch,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            rms_norm_eps=float(cfg.rms_norm_eps),
            rope=RopeConfig.from_hf(cfg),
            max_position_embeddings=cfg.max_position_embeddings,
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=not is_qwen2 and attention_bias,
            mlp_bias=arch == "LlamaForCausalLM" and bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            eos_token_ids=_token_ids(getattr(cfg, "eos_token_id", None)),
            bos_token_id=getattr(cfg, "bos_token_id", None),
            torch_dtype=_config_dtype(cfg),
            sliding_window=_sliding_window(cfg),
        )

    # -- derived ------------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def scale(self) -> float:
        """Attention softmax scale ``head_dim ** -0.5`` (``query_pre_attn_scalar ** -0.5``
        where the checkpoint sets it)."""
        return (self.query_pre_attn_scalar or self.head_dim)**-0.5

    @property
    def max_model_len(self) -> int:
        """Longest sequence vmkv computes exactly: the model's own where its layers say their
        windows (the kernels apply them); otherwise full attention equals a sliding window only
        while the sequence fits in it."""
        if self.layer_windows:
            return self.max_position_embeddings
        window = self.sliding_window or self.max_position_embeddings
        return min(self.max_position_embeddings, window)

    def kv_spec(self, dtype: torch.dtype | str = torch.float32) -> KVSpec:
        """Per-token KV shape for the cache managers in the KV ``dtype`` (the model's, or
        ``int8``), in layer groups where the layers' windows differ (full-attention layers
        first, then one group per window)."""
        groups: tuple[LayerGroup, ...] = ()
        if any(self.layer_windows):
            by_window: dict[int, list[int]] = {}
            for layer, window in enumerate(self.layer_windows):
                by_window.setdefault(window, []).append(layer)
            groups = tuple(LayerGroup(tuple(layers), window or None)
                           for window, layers in sorted(by_window.items()))
        # int8 and fp8 are KV storages only; the float dtypes keep their aliases ("bf16")
        storage = (kv_storage_dtype(dtype) if str(dtype).removeprefix("torch.") in
                   ("int8", "fp8_e4m3", "fp8_e5m2") else parse_dtype(dtype))
        return KVSpec(self.num_layers, self.num_kv_heads, self.head_dim, storage, groups)


def _architecture(cfg: Any) -> str:
    archs = list(getattr(cfg, "architectures", None) or [])
    if not archs and getattr(cfg, "model_type", None) in _ARCH_OF_MODEL_TYPE:
        archs = [_ARCH_OF_MODEL_TYPE[cfg.model_type]]
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    found = ", ".join(archs) or f"model_type {getattr(cfg, 'model_type', None)!r}"
    raise ValueError(f"unsupported architecture ({found}); supported: "
                     f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


def _config_dtype(cfg: Any) -> torch.dtype | None:
    dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    if dtype is None:
        return None
    try:
        return parse_dtype(dtype)
    except ValueError:
        return None  # e.g. a float8 checkpoint: the caller must choose a dtype


def _sliding_window(cfg: Any) -> int | None:
    window = getattr(cfg, "sliding_window", None)
    if window is None or getattr(cfg, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def _gemma3(cfg: Any) -> ModelConfig:
    """Gemma 3 (text): sliding-window and full-attention layers by ``layer_types``, a local
    RoPE base for the sliding ones; softcapping (Gemma 2) and other activations refused."""
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, name, None) is not None:
            raise ValueError(f"Gemma3ForCausalLM: {name} is not supported")
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"Gemma3ForCausalLM: only the tanh GELU is supported, got {act!r}")
    layer_types = list(getattr(cfg, "layer_types", None) or [])
    if len(layer_types) != cfg.num_hidden_layers:
        raise ValueError(f"Gemma3ForCausalLM: layer_types must name {cfg.num_hidden_layers} "
                         f"layers, got {layer_types}")
    window = int(cfg.sliding_window)
    heads = cfg.num_attention_heads
    return ModelConfig(
        architecture="Gemma3ForCausalLM",
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        rms_norm_eps=float(cfg.rms_norm_eps),
        rope=RopeConfig.from_hf(cfg, "full_attention"),
        max_position_embeddings=cfg.max_position_embeddings,
        qk_norm=True,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", True)),
        eos_token_ids=_token_ids(getattr(cfg, "eos_token_id", None)),
        bos_token_id=getattr(cfg, "bos_token_id", None),
        torch_dtype=_config_dtype(cfg),
        sliding_window=window,
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=float(cfg.query_pre_attn_scalar),
        layer_windows=tuple(window if t == "sliding_attention" else 0 for t in layer_types),
        local_rope=RopeConfig.from_hf(cfg, "sliding_attention"),
    )
