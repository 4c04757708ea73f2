"""Convert a GGUF checkpoint once into an HF safetensors folder, cached by the file's hash.

    $VMKV_CACHE (default ~/.cache/vmkv)/models/
        <stem>-<sha256[:16]>/            a finished conversion (config, safetensors, tokenizer,
            vmkv-cache.json              ... and this marker, written last: the source's name,
                                         sha256 and path, so a native load finds the file)
        .tmp-<stem>-<sha>-<pid>-<rand>/  a conversion in progress (or killed mid-way)

Invariant: a folder without the ``.tmp-`` prefix appears only by ``rename`` of a finished
temp folder, so a killed conversion never leaves something that looks like a cache entry.
Leftover temp folders whose process is gone are deleted by the next conversion.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

from vmkv import envs

logger = logging.getLogger(__name__)

MARKER = "vmkv-cache.json"
TMP_PREFIX = ".tmp-"


def cache_root() -> Path:
    """``$VMKV_CACHE``, default ``~/.cache/vmkv``."""
    return envs.cache_dir()


def models_dir() -> Path:
    return cache_root() / "models"


@lru_cache(maxsize=16)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    """Hex sha256 of ``path``, remembered per (path, size, mtime) for this process."""
    st = path.stat()
    return _sha256(str(path.resolve()), st.st_size, st.st_mtime_ns)


def cache_key(gguf: Path) -> str:
    """Folder name of ``gguf``'s conversion: ``<stem>-<first 16 hex digits of sha256>``."""
    return f"{gguf.stem}-{file_sha256(gguf)[:16]}"


def is_complete(folder: Path) -> bool:
    """Whether ``folder`` is a finished conversion (a cache folder with its marker)."""
    return not folder.name.startswith(TMP_PREFIX) and (folder / MARKER).is_file()


def gguf_source(folder: Path) -> Path | None:
    """The GGUF file a cache folder was converted from, when it is still where it was and
    unchanged (same sha256); None for any other folder."""
    try:
        info = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    path = Path(info.get("path") or "")
    if not info.get("path") or not path.is_file() or path.suffix != ".gguf":
        return None
    return path if file_sha256(path) == info.get("sha256") else None


def _remember_source(folder: Path, gguf: Path) -> None:
    """Record ``gguf``'s path in the marker of its conversion ``folder`` (conversions made
    before the marker held one), replacing the marker atomically."""
    marker = folder / MARKER
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return
    if info.get("path") == str(gguf.resolve()):
        return
    info["path"] = str(gguf.resolve())
    tmp = marker.with_name(f"{TMP_PREFIX}{MARKER}-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(info, indent=1))
        os.replace(tmp, marker)
    except OSError:  # a read-only cache: the native load falls back to the conversion
        tmp.unlink(missing_ok=True)


def cached_conversion(gguf: Path) -> Path | None:
    """The finished conversion of ``gguf`` if one is cached, else None."""
    folder = models_dir() / cache_key(gguf)
    return folder if is_complete(folder) else None


def find_cached_by_source(source_name: str) -> Path | None:
    """The newest finished conversion of a GGUF file named ``source_name`` (any hash)."""
    root = models_dir()
    if not root.is_dir():
        return None
    found: list[tuple[float, Path]] = []
    for folder in root.iterdir():
        if is_complete(folder):
            try:
                info = json.loads((folder / MARKER).read_text())
            except (OSError, ValueError):
                continue
            if info.get("source") == source_name:
                found.append((float(info.get("created", 0)), folder))
    return max(found)[1] if found else None


def convert_gguf(gguf: str | Path, *, progress: bool = True) -> Path:
    """The HF folder converted from ``gguf``, converting on first use (tens of seconds).

    Needs transformers with the ``gguf`` and ``accelerate`` packages. Raises ValueError if
    ``gguf`` is not a readable .gguf file.
    """
    gguf = Path(gguf).expanduser()
    if not gguf.is_file() or gguf.suffix != ".gguf":
        raise ValueError(f"{str(gguf)!r} is not a .gguf file")
    final = models_dir() / cache_key(gguf)
    if is_complete(final):
        _remember_source(final, gguf)
        return final
    from tqdm.auto import tqdm

    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphans(final.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{final.name}-{os.getpid()}-",
                                dir=final.parent))
    bar = tqdm(total=4, desc=f"vmkv: converting {gguf.name}", unit="step", disable=not progress)
    try:
        _convert_into(gguf, tmp, bar)
        bar.set_postfix_str("finish")
        marker = {"source": gguf.name, "sha256": file_sha256(gguf), "created": time.time(),
                  "path": str(gguf.resolve())}
        (tmp / MARKER).write_text(json.dumps(marker, indent=1))
        _publish(tmp, final)
        bar.update()
    finally:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)  # already gone once published
    logger.info("converted %s into %s", gguf, final)
    return final


def _convert_into(gguf: Path, out: Path, bar: Any) -> None:
    """Load ``gguf`` with transformers (dequantized to float32) and save it into ``out``."""
    try:
        import accelerate  # noqa: F401  (transformers refuses GGUF without it)
        import gguf as _gguf  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise ValueError(f"converting a GGUF file needs transformers, gguf and accelerate "
                         f"({e}); run `pip install gguf accelerate`") from e
    import torch

    bar.set_postfix_str("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    bar.update()
    bar.set_postfix_str("model")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    bar.update()
    bar.set_postfix_str("save")
    # NOTE: save_pretrained refuses "quantized with gguf" models; the weights are plain fp32
    # tensors by now, so drop the quantizer before saving.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    bar.update()


def _publish(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final`` atomically; a concurrent winner's result is kept."""
    if final.exists() and not is_complete(final):
        stale = final.with_name(f"{TMP_PREFIX}{final.name}-stale-{os.getpid()}")
        final.rename(stale)  # an incomplete non-temp folder (made by hand): move it aside
        shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp.rename(final)
    except OSError:
        if not is_complete(final):  # lost a race only if the winner's folder is complete
            raise


def _remove_orphans(root: Path) -> None:
    """Delete temp folders left by conversions whose process no longer runs."""
    for folder in root.glob(f"{TMP_PREFIX}*"):
        parts = folder.name.rsplit("-", 2)
        pid = int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None
        if pid is not None and not _alive(pid):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
