"""``--generation-config``: the model's default sampling, for requests that leave it unset.

    auto   the model folder's generation_config.json (vLLM's default)
    vmkv   none: vmkv's defaults (temperature 1, top_p 1, ..., max_tokens 16 for completions)
    DIR    DIR/generation_config.json

As vLLM reads it: ``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty``
become the defaults of the request fields of the same names, and ``max_new_tokens`` the default
``max_tokens``. A request that sets a field keeps its value (vLLM also caps an explicit
``max_tokens`` at ``max_new_tokens``; vmkv does not: what a request asks for it gets). Other
keys (``do_sample``, ...) are not read, as vLLM does not read them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger("vmkv.server")

#: generation_config.json keys -> request fields
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(spec: str, model_dir: Path | None) -> dict[str, Any]:
    """The default request fields ``spec`` gives (``model_dir``: the model folder, for auto;
    None for a single-file model, which has none); ValueError for a missing DIR or a file
    that is not a JSON object."""
    if spec == "vmkv":
        return {}
    folder = model_dir if spec == "auto" else Path(spec).expanduser()
    if spec != "auto" and not (folder / "generation_config.json").is_file():
        raise ValueError(f"generation_config {spec!r}: no generation_config.json there")
    if folder is None or not (folder / "generation_config.json").is_file():
        return {}
    config = json.loads((folder / "generation_config.json").read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{folder / 'generation_config.json'} is not a JSON object")
    defaults = {field: config[key] for key, field in KEYS.items()
                if config.get(key) is not None}
    if defaults:
        logger.info("default sampling from %s: %s (requests that set a field keep theirs; "
                    "--generation-config vmkv ignores it)",
                    folder / "generation_config.json", defaults)
    return defaults
