"""`vmkv bench kernels`: CPU backends over real KV managers; the Triton half interpreted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton_required import needs_triton

from vmkv.bench import kernels
from vmkv.bench.memory import SMOLLM2_135M
from vmkv.cli import main
from vmkv.kv import KVSpec


def test_cpu_kernels_smoke(tmp_path: Path) -> None:
    out, png = tmp_path / "k.json", tmp_path / "k.png"
    assert main(["bench", "kernels", "--batch-sizes", "1,3", "--context-lens", "40,100",
                 "--prefill-len", "32", "--repeats", "2", "--warmup", "1", "--max-tokens", "200",
                 "--no-cuda", "--no-progress", "--json", str(out), "--plot", str(png)]) == 0
    result = json.loads(out.read_text())
    points = {(r["phase"], r["batch"], r["context"]) for r in result["rows"]}
    assert points == {(p, b, c) for p in kernels.PHASES for b in (1, 3) for c in (40, 100)
                      if b * c <= 200}
    assert result["skipped"] == ["batch 3 x context 100"]
    for row in result["rows"]:
        assert row["query_len"] == (32 if row["phase"] == "prefill" else 1)
        assert not row["decode_kernel"] or row["phase"] == "decode"
        assert row["virtual_ms"] > 0 and row["paged_ms"] > 0
        assert row["ratio"] == pytest.approx(row["paged_ms"] / row["virtual_ms"])
    assert result["kv_shape"]["layers"] == 30
    assert png.stat().st_size > 1000


def test_the_pools_fit_an_int8_cache_in_part_filled_pages() -> None:
    """64 x 512 tokens of int8 rows (198 bytes a layer: 82 to a 16 KiB page) fit the pools the
    bench sizes (it refused: "the pool was sized to fit")."""
    spec = KVSpec(*SMOLLM2_135M, dtype=torch.int8)
    kvs = kernels._managers(spec, 64, 512, "per-layer", 16)
    try:
        assert all(kv.accounting.usage.num_requests == 64 for kv in kvs.values())
    finally:
        for kv in kvs.values():
            kv.close()


def test_every_point_over_the_limit_still_reports(capsys: pytest.CaptureFixture[str]) -> None:
    """A run whose every point is skipped prints an empty table and what it skipped (it
    crashed formatting a table of no rows)."""
    assert main(["bench", "kernels", "--batch-sizes", "64", "--context-lens", "680",
                 "--phases", "decode", "--no-cuda", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "virtual_ms" in out and "skipped batch 64 x context 680" in out


@pytest.mark.parametrize(("query", "kernel"), [(8, True), (1, True), (1, False)])
def test_both_backends_compute_the_same_attention(query: int, kernel: bool) -> None:
    """The timed calls are real attention over the same data: outputs agree across modes."""
    import torch

    from vmkv.attention import create_attention_backend
    from vmkv.kv import KVSpec

    spec = KVSpec(2, 3, 64)
    kvs = kernels._managers(spec, batch=2, context=40, layout="all-layers", block_size=16)
    try:
        outs = []
        for kv in kvs.values():
            backend = create_attention_backend(kv)
            backend.batched_decode = backend.batched_decode and kernel
            kernels._fill(kv, backend, 2, 40, seed=0)
            meta = backend.prepare(["r0", "r1"], [40 - query] * 2, [query] * 2)
            gen = torch.Generator().manual_seed(1)
            q, k, v = (torch.randn(2 * query, h, 64, generator=gen) for h in (9, 3, 3))
            outs.append(backend.forward(0, q, k, v, meta, 0.125))
        torch.testing.assert_close(outs[0], outs[1])
    finally:
        for kv in kvs.values():
            kv.close()


@needs_triton
def test_triton_twins_bench_under_the_interpreter() -> None:
    """The CUDA half, run on CPU tensors under TRITON_INTERPRET (tiny shapes)."""
    code = ("import json, torch; from vmkv.bench import kernels_cuda as kc; "
            "print(json.dumps(kc.run([2], [48], device='cpu', dtype=torch.float32, repeats=1, "
            "warmup=0, inner=1, prefill_len=16, shape=(2, 3, 64))))")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["phase"] for r in rows] == ["decode", "prefill"]
    for row in rows:
        assert row["max_abs_diff"] < 1e-4  # contiguous, identity and shuffled tables agree
        assert row["virtual_ms"] > 0 and row["shuffled_ms"] > 0 and row["identity_ms"] > 0
