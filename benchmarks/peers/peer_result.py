"""What every peer runner shares: reading the workload file and the one result line it prints.

Imported by the runners inside the peers' own venvs (no vmkv import there): standard library only.
"""

from __future__ import annotations

import json
from typing import Any

#: a runner's last stdout line that starts with this carries its result as JSON
RESULT_PREFIX = "PEER_RESULT "


def read_workload(path: str) -> list[dict[str, Any]]:
    """``{"prompt": [token ids], "output_len": n}`` rows of a jsonl file (vmkv.bench.workloads)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def exactness(rows: list[dict[str, Any]], lengths: list[int]) -> dict[str, int]:
    """Token counts of a run whose request ``i`` produced ``lengths[i]`` tokens, and how many
    requests did not produce exactly their ``output_len``."""
    return {
        "num_requests": len(rows),
        "prompt_tokens": sum(len(r["prompt"]) for r in rows),
        "output_tokens": sum(lengths),
        "requested_output_tokens": sum(r["output_len"] for r in rows),
        "wrong_length_requests": sum(n != r["output_len"] for r, n in zip(rows, lengths,
                                                                          strict=True)),
    }


def print_result(result: dict[str, Any]) -> None:
    """Print ``result`` as the runner's ``PEER_RESULT`` line."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)
