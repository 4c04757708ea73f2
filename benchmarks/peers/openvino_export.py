"""Export vmkv's converted HF folder of a model to OpenVINO IR with optimum-intel.

Usage (inside the OpenVINO venv): python openvino_export.py HF_DIR OUT_DIR [fp32|int8|int4]

The weight format (default fp32) is optimum-cli's ``--weight-format``: int8 and int4 compress
the linears' weights through nncf (int8 per output channel; int4 in groups of 128, nncf's
default, or the largest of 64 and 32 that divides every linear's inputs: SmolLM2-135M's 576 is
no multiple of 128, and nncf refuses such layers), what OpenVINO GenAI's users run on CPUs.

optimum-intel needs transformers < 5, while vmkv writes its converted folder with transformers 5;
two of its files need the older spelling, so the export reads a staging folder: links to the
weights and tokenizer, ``config.json`` with ``rope_theta`` next to 5's ``rope_parameters`` (4.x
would silently fall back to a RoPE base of 10,000), and ``tokenizer_config.json`` naming
``PreTrainedTokenizerFast`` (4.x knows no ``TokenizersBackend``, and optimum then skips the
OpenVINO tokenizer that ``ContinuousBatchingPipeline`` loads). Then
``optimum-cli export openvino --task text-generation-with-past --weight-format FORMAT``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

REQUIRED = ("openvino_model.xml", "openvino_model.bin", "openvino_tokenizer.xml",
            "openvino_detokenizer.xml")


def stage(hf_dir: Path, staging: Path) -> None:
    """Fill ``staging`` with ``hf_dir``'s files, the two configs in transformers 4.x form."""
    for src in hf_dir.iterdir():
        if src.name not in ("config.json", "tokenizer_config.json"):
            (staging / src.name).symlink_to(src.resolve())
    config = json.loads((hf_dir / "config.json").read_text())
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
    if "dtype" in config:
        config.setdefault("torch_dtype", config["dtype"])
    (staging / "config.json").write_text(json.dumps(config, indent=1))
    tok_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    if tok_config.get("tokenizer_class") == "TokenizersBackend":
        tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("backend", "is_local", "local_files_only"):
        tok_config.pop(key, None)
    (staging / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))


def int4_group_size(hf_dir: Path) -> int:
    """nncf's default int4 group (128), or the largest of 64 and 32 dividing the hidden and
    intermediate sizes (every linear's inputs)."""
    config = json.loads((hf_dir / "config.json").read_text())
    sizes = [config.get("hidden_size", 0), config.get("intermediate_size", 0)]
    return next((g for g in (128, 64, 32) if all(n % g == 0 for n in sizes)), 128)


def main() -> int:
    hf_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    weight_format = sys.argv[3] if len(sys.argv) > 3 else "fp32"
    if weight_format not in ("fp32", "int8", "int4"):
        print(f"weight format must be fp32, int8 or int4, got {weight_format!r}", file=sys.stderr)
        return 2
    cli = Path(sys.executable).parent / "optimum-cli"
    with tempfile.TemporaryDirectory() as tmp:
        stage(hf_dir, Path(tmp))
        group = (["--group-size", str(int4_group_size(hf_dir))] if weight_format == "int4"
                 else [])
        subprocess.run([str(cli), "export", "openvino", "-m", tmp, "--task",
                        "text-generation-with-past", "--weight-format", weight_format, *group,
                        str(out)],
                       check=True)
    missing = [name for name in REQUIRED if not (out / name).exists()]
    if missing:
        print(f"export to {out} is missing {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
