"""Model execution: the Llama family over vmkv's attention backends, loading and resolution.

    path = resolve_model(None)                  # default model, converted once from GGUF
    model, cfg = load_model(path, torch.float32, "cpu")
    hidden = model.forward(input_ids, positions, attn, meta)     # [T, hidden]
    logits = model.compute_logits(hidden[last_token_rows])       # [N, vocab] float32
"""

from __future__ import annotations

from vmkv.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeConfig, parse_dtype
from vmkv.models.default_model import (
    DEFAULT_MODEL,
    default_gguf_path,
    fetch_default_model,
    resolve_model,
)
from vmkv.models.gguf_cache import cache_root, convert_gguf
from vmkv.models.llama import LlamaModel
from vmkv.models.loader import load_model, load_model_config, load_tokenizer

__all__ = [
    "DEFAULT_MODEL",
    "SUPPORTED_ARCHITECTURES",
    "LlamaModel",
    "ModelConfig",
    "RopeConfig",
    "cache_root",
    "convert_gguf",
    "default_gguf_path",
    "fetch_default_model",
    "load_model",
    "load_model_config",
    "load_tokenizer",
    "parse_dtype",
    "resolve_model",
]
