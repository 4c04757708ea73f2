"""Load an HF model folder (config.json + safetensors) into :class:`LlamaModel`, no HF model.

    config.json (+ generation_config.json)    -> ModelConfig
    model.safetensors | model-0000N-of-0000M.safetensors + model.safetensors.index.json
        model.layers.N.self_attn.{q,k,v}_proj.* -> layers.N.self_attn.qkv_proj.*   (cat dim 0)
        model.layers.N.mlp.{gate,up}_proj.*     -> layers.N.mlp.gate_up_proj.*     (cat dim 0)
        model.* -> *, lm_head.weight (absent when tied)

Tensors are read with ``safetensors.torch.load_file`` and each is cast and moved once; the
model is built on the meta device and adopts them (no randomly initialised second copy).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from vmkv.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, parse_dtype
from vmkv.models.gemma3 import Gemma3Model
from vmkv.models.gguf_cache import gguf_source
from vmkv.models.linear import pack_linears
from vmkv.models.llama import LlamaModel
from vmkv.models.quant.gguf_weights import GGUFWeights, load_gguf_model, native_unavailable
from vmkv.models.quant.int8 import INT8_MODES, quantize_linears
from vmkv.models.quant.int8_head import quantize_head
from vmkv.models.quant.smooth import smooth_for_w8a8
from vmkv.models.sharding import shard_config, shard_state

logger = logging.getLogger(__name__)

_FUSED = {  # vmkv fused name -> the HF names it concatenates, in order
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
_PART_OF = {part: (fused, i) for fused, parts in _FUSED.items() for i, part in enumerate(parts)}
_LAYER_KEY = re.compile(r"layers\.(\d+)\.(\w+\.\w+)\.(weight|bias)")
_IGNORED = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved


def check_model_dir(path: str | Path) -> Path:
    """``path`` as a Path if it is an HF model folder (has config.json), else ValueError."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ValueError(f"model path {str(path)!r} is not a folder")
    if not (path / "config.json").is_file():
        raise ValueError(f"{str(path)!r} is not a model folder: it has no config.json")
    return path


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of ``path``: the shards the index names, or the single file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise ValueError(f"{str(path)!r} has no *.safetensors weights (pytorch_model.bin and "
                         "GGUF folders are not read directly; pass the .gguf file instead)")
    return found


def load_model_config(path: str | Path) -> ModelConfig:
    """ModelConfig of a model folder; eos ids of generation_config.json are added."""
    from transformers import AutoConfig

    path = check_model_dir(path)
    try:
        raw = json.loads((path / "config.json").read_text())
    except ValueError as e:
        raise ValueError(f"{str(path / 'config.json')!r} is not valid JSON: {e}") from e
    archs = raw.get("architectures") or []
    if archs and not set(archs) & set(SUPPORTED_ARCHITECTURES):
        raise ValueError(f"unsupported architecture ({', '.join(archs)}); supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    try:
        hf_config = AutoConfig.from_pretrained(path)
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"transformers cannot read {str(path / 'config.json')!r} ({e}); "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}") from e
    cfg = ModelConfig.from_hf(hf_config)
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        eos = json.loads(gen_file.read_text()).get("eos_token_id")
        extra = [eos] if isinstance(eos, int) else list(eos or [])
        ids = tuple(dict.fromkeys([*cfg.eos_token_ids, *extra]))
        if ids != cfg.eos_token_ids:
            from dataclasses import replace

            cfg = replace(cfg, eos_token_ids=ids)
    return cfg


def hf_to_vmkv(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename HF weights to vmkv names and fuse q/k/v and gate/up (see the module docstring)."""
    state: dict[str, torch.Tensor] = {}
    parts: dict[tuple[str, str, str], dict[int, torch.Tensor]] = {}  # (layer, fused, kind)
    for name, tensor in tensors.items():
        if name.endswith(_IGNORED):
            continue
        name = name.removeprefix("model.")
        m = _LAYER_KEY.fullmatch(name)
        if m and m.group(2) in _PART_OF:
            fused, i = _PART_OF[m.group(2)]
            parts.setdefault((m.group(1), fused, m.group(3)), {})[i] = tensor
        else:
            state[name] = tensor
    for (layer, fused, kind), pieces in parts.items():
        name, want = f"layers.{layer}.{fused}.{kind}", len(_FUSED[fused])
        if sorted(pieces) != list(range(want)):
            raise ValueError(f"checkpoint lacks part of {name}: has {sorted(pieces)} of {want}")
        state[name] = torch.cat([pieces[i] for i in range(want)], dim=0)
    return state


def load_model(path: str | Path, dtype: str | torch.dtype | None = None,
               device: str | torch.device = "cpu", *, linear_backend: str = "auto",
               tensor_parallel: tuple[int, int] = (0, 1), quantization: str = "none",
               lm_head_dtype: str = "auto") -> tuple[LlamaModel, ModelConfig]:
    """Load the model in folder ``path`` in ``dtype`` (None: the checkpoint's, else float32).

    ``linear_backend`` (float32 on CPU): "mkl"/"onednn" pack the linear layers' weights once
    for that library, "auto" picks one (:func:`vmkv.models.linear.resolve_backend`), "torch"
    keeps ``F.linear``. ``tensor_parallel = (rank, size)``: only that rank's shard
    (:mod:`vmkv.models.sharding`). ``quantization``: "none" (the checkpoint's weights in
    ``dtype``), "gguf" (a GGUF model's linears in the file's own block formats,
    :mod:`vmkv.models.quant.gguf_weights`; ValueError where that cannot run), "auto" (gguf
    where it can run, else none), "int8" or "w8a8" (the decoder linears quantized at load,
    :mod:`vmkv.models.quant.int8`; w8a8 after SmoothQuant, :mod:`vmkv.models.quant.smooth`).
    ``lm_head_dtype``: "auto" (the head in ``dtype``) or "int8"
    (:mod:`vmkv.models.quant.int8_head`). Returns the model and the whole model's config
    (``model.config`` is the shard's).

    Raises ValueError for a path that is not a model folder, an unsupported architecture or
    weights that do not fit the config.
    """
    cfg = load_model_config(path)
    path = Path(path).expanduser()
    dtype = parse_dtype(dtype) if dtype is not None else cfg.torch_dtype or torch.float32
    device = torch.device(device)
    if quantization in ("auto", "gguf"):
        model = _gguf_native(path, cfg, dtype, device, tensor_parallel, quantization)
        if model is not None:
            _quantize_head(model, lm_head_dtype, device)
            pack_linears(model, linear_backend)  # any linear the file holds in another format
            return model, cfg
    elif quantization not in ("none", *INT8_MODES):
        raise ValueError(f"quantization must be one of auto, none, gguf, {', '.join(INT8_MODES)}"
                         f", got {quantization!r}")
    elif quantization != "none" and (device.type != "cpu"
                                     or dtype not in (torch.float32, torch.bfloat16)):
        raise ValueError(f"--quantization {quantization} runs on the CPU in float32 or bfloat16, "
                         f"not {dtype} on {device.type}")
    tensors: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        tensors.update((name, t.to(device=device, dtype=dtype))
                       for name, t in load_file(file).items())
    rank, size = tensor_parallel
    model_class = Gemma3Model if cfg.architecture == "Gemma3ForCausalLM" else LlamaModel
    model = model_class(shard_config(cfg, rank, size), dtype=dtype, device="meta",
                        rope_device=device)
    model.load_weights(shard_state(hf_to_vmkv(tensors), cfg, rank, size))
    model.eval()
    logger.info("loaded %s (%s, %d layers) from %s as %s on %s", cfg.architecture,
                _num_params(model), cfg.num_layers, path, dtype, device)
    if quantization == "w8a8" and smooth_for_w8a8(model, path):
        logger.info("w8a8: activation outliers folded into the weights (SmoothQuant)")
    if quantization in INT8_MODES:
        logger.info("quantized %d decoder linears to %s", quantize_linears(model, quantization),
                    quantization)
    _quantize_head(model, lm_head_dtype, device)
    pack_linears(model, linear_backend)
    return model, cfg


def _quantize_head(model: LlamaModel, lm_head_dtype: str, device: torch.device) -> None:
    """The LM head as ``lm_head_dtype`` asks (ValueError where it cannot run)."""
    if lm_head_dtype == "auto":
        return
    if lm_head_dtype != "int8":
        raise ValueError(f"lm_head_dtype must be auto or int8, got {lm_head_dtype!r}")
    if device.type != "cpu":
        raise ValueError(f"--lm-head-dtype int8 runs on the CPU (u8 x s8 products), not on "
                         f"{device.type}")
    head = quantize_head(model)
    logger.info("LM head in int8 (%d x %d, %.1f MB beside the dense rows it rescores from)",
                head.out_features, head.in_features, head.nbytes / 1e6)


def _gguf_native(path: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 tensor_parallel: tuple[int, int], quantization: str) -> LlamaModel | None:
    """The model on its GGUF file's own block formats, or None (``auto``, with a log line) where
    that cannot run; ``gguf`` raises ValueError there instead."""
    source = gguf_source(path)
    if source is None:
        reason = f"{str(path)!r} was not converted from a GGUF file vmkv can still find"
    elif device.type != "cpu":
        reason = "GGUF block formats are served on the CPU only"
    elif tensor_parallel[1] > 1:
        reason = "GGUF block formats are served on one rank (no tensor parallelism)"
    elif dtype not in (torch.float32, torch.bfloat16):
        reason = f"GGUF block formats take float32 or bfloat16 activations, not {dtype}"
    else:
        weights = GGUFWeights(source)
        try:
            reason = native_unavailable(weights, cfg)
            if reason is None:
                model = load_gguf_model(weights, cfg, dtype)
                logger.info("loaded %s (%d layers) from %s in its GGUF block formats, %s "
                            "activations", cfg.architecture, cfg.num_layers, source, dtype)
                return model
        finally:
            weights.close()
    if quantization == "gguf":
        raise ValueError(f"--quantization gguf: {reason}")
    logger.info("quantization auto: %s; weights dequantized to %s", reason, dtype)
    return None


def load_tokenizer(path: str | Path) -> Any:
    """The HF tokenizer saved in model folder ``path``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(check_model_dir(path))


def _num_params(model: torch.nn.Module) -> str:
    n = sum(p.numel() for p in model.parameters())
    return f"{n / 1e6:.1f}M params"
