"""`vmkv bench memory` and `vmkv bench vmm`: run through the CLI, results well-formed and right."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vmkv.bench import memory
from vmkv.cli import main


def test_bench_memory_reproduces_the_seed_example(tmp_path: Path) -> None:
    out = tmp_path / "mem.json"
    assert main(["bench", "memory", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {(r["strategy"], r["setting"]): r["useful_fraction"] for r in result["rows"]}
    # 3257 tokens used of 8 x 2048 reserved; of 3296 tokens in 16-token blocks
    assert rows[("naive", "max_len 2048")] == pytest.approx(3257 / 16384)
    assert rows[("paged", "block 16")] == pytest.approx(3257 / 3296)
    # virtual, all-layers, 64 KiB pages: SmolLM2 fp32 rows are 46,080 B; slack < 1 page each
    pages = sum(-(-n * 46080 // 65536) for n in memory.SEED_LENGTHS)
    assert rows[("virtual", "all-layers, page 64 KiB")] == pytest.approx(
        3257 * 46080 / (pages * 65536))
    assert result["environment"]["torch"]
    assert len(result["rows"]) == 6


def test_bench_memory_rejects_bad_lengths(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "memory", "--lengths", "10,4096"]) == 2
    assert "exceeds max_len (2048)" in capsys.readouterr().err


def test_bench_vmm_measures_the_host_backend(tmp_path: Path) -> None:
    out = tmp_path / "vmm.json"
    assert main(["bench", "vmm", "--page-sizes", "4K,64K", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    cpu = [r for r in result["rows"] if r["device"] == "cpu"]
    assert [r["page_size"] for r in cpu] == [4096, 65536]
    assert all(r["map_p50_us"] > 0 and r["unmap_p50_us"] > 0 for r in cpu)
