"""`vmkv bench throughput` end to end on the default model (tiny workload) and its pieces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vmkv.bench.throughput import BENCH_STRUCTURE, summarise_runs
from vmkv.cli import main

pytestmark = pytest.mark.usefixtures("default_model")

ENGINE = ["--max-model-len", "128", "--max-num-seqs", "8", "--kv-cache-memory", "64M"]
TINY = ["--num-prompts", "4", "--input-len", "8:16", "--output-len", "4:12", "--seed", "3"]


def test_both_modes_with_hf_baseline(tmp_path: Path) -> None:
    out, png = tmp_path / "tp.json", tmp_path / "tp.png"
    assert main(["bench", "throughput", "--kv-mode", "both", *TINY, *ENGINE, "--repeats", "1",
                 "--warmup-prompts", "2", "--baseline", "hf", "--hf-batch-size", "2",
                 "--no-progress", "--json", str(out), "--plot", str(png)]) == 0
    result = json.loads(out.read_text())
    assert png.stat().st_size > 1000
    assert result["bench"] == "throughput" and result["environment"]["torch"]
    wanted = result["workload"]["output_tokens"]
    assert result["workload"]["num_requests"] == 4
    runs = {r["mode"]: r for r in result["runs"]}
    assert set(runs) == {"virtual", "paged"}
    for mode, run in runs.items():
        assert run["output_tokens"] == run["requested_output_tokens"] == wanted, mode
        assert run["short_outputs"] == 0
        for key in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s",
                    "peak_kv_bytes_in_use", "elapsed_s"):
            assert run[key] > 0, (mode, key)
        assert 0 < run["kv_useful_fraction"] <= 1
        assert run["preemptions"] == 0
        assert len(run["trace"]["t"]) == run["steps"] > 0
        assert run["trace"]["bytes_in_use"][-1] == 0  # everything freed at the end
        assert result["startup"][mode]["startup_to_first_token_s"] > 0
    # the virtual slots were mapped and populated at start-up: these short requests map nothing
    assert runs["virtual"]["map_ops"]["map"]["calls"] == 0
    assert runs["paged"]["map_stall_s"] == 0
    assert len(result["ratios"]) == 1 and result["ratio_median"] > 0
    hf = result["hf"]
    assert hf["output_tokens"] == wanted and hf["generated_tokens"] >= wanted
    assert hf["output_tokens_per_s"] > 0
    assert set(result["ratio_vs_hf"]) == {"virtual", "paged"}
    assert any(row["mode"] == "virtual/paged" for row in result["rows"])


def test_virtual_map_time_is_measured_when_pages_come_on_demand(tmp_path: Path) -> None:
    """Without a pre-created pool (so no slot is warmed) every request maps its pages while it
    runs, and the report counts those calls and their time."""
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--kv-mode", "virtual", "--no-precreate-pages", *TINY,
                 *ENGINE, "--repeats", "1", "--warmup-prompts", "0", "--no-progress",
                 "--json", str(out)]) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["map_stall_s"] > 0 and run["map_ops"]["map"]["calls"] > 0
    assert run["map_ops"]["create"]["calls"] > 0


def test_single_mode_repeats_and_preemption_under_tight_memory(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    # short prompts are all admitted, then grow to 20-32 tokens each in KV memory for 64 (4 blocks
    # of 16): preemption must happen
    assert main(["bench", "throughput", "--kv-mode", "paged", "--num-prompts", "3",
                 "--input-len", "4:8", "--output-len", "16:24", "--max-model-len", "64",
                 "--kv-cache-memory", str(46080 * 64), "--block-size", "16", "--repeats", "2",
                 "--warmup-prompts",
                 "0", "--no-progress", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["repeat"] for r in result["runs"]] == [0, 1]
    assert "ratios" not in result
    run = result["runs"][0]
    assert run["preemptions"] > 0 and run["recomputed_tokens"] > 0
    assert run["short_outputs"] == 0
    assert run["output_tokens"] == run["requested_output_tokens"]
    assert run["peak_kv_bytes_in_use"] <= 46080 * 64


def test_prefix_caching_compared_side_by_side_and_repetitions_start_cold(tmp_path: Path
                                                                         ) -> None:
    """--compare-prefix-caching runs a caching twin of each mode in the same alternation. The
    twins hit only within a repetition, not on what the warm-up or the previous repetition left
    in the cache (one request at a time, so each can hit on the one before it)."""
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--kv-mode", "both", "--workload", "shared-prefix",
                 "--prefix-len", "48", "--num-prompts", "3", "--input-len", "4:8",
                 "--output-len", "2:3", "--seed", "1", *ENGINE, "--max-num-seqs", "1",
                 "--compare-prefix-caching", "--block-size", "16",  # the 48-token prefix: 3
                 "--repeats", "2", "--warmup-prompts", "3",
                 "--no-progress", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    hits: dict[str, list[int]] = {}
    for run in result["runs"]:
        hits.setdefault(run["mode"], []).append(run["cached_prompt_tokens"])
    assert hits["virtual"] == hits["paged"] == [0, 0]
    for mode in ("virtual+prefix", "paged+prefix"):
        assert hits[mode][0] == hits[mode][1] > 0, (mode, hits)
        assert hits[mode][0] <= 2 * 48, (mode, hits)  # the first request finds nothing
    assert set(result["prefix_ratios"]) == {"virtual", "paged"}
    assert all(len(r) == 2 and min(r) > 0 for r in result["prefix_ratios"].values())
    assert len(result["ratios"]) == 2  # virtual/paged, caching off


def test_structured_outputs_compared_at_the_same_lengths(tmp_path: Path) -> None:
    """--compare-structured-outputs runs each engine plain and JSON-schema constrained in one
    alternation; the constrained requests write exactly as many tokens, all of them valid
    prefixes of BENCH_SCHEMA documents."""
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--kv-mode", "paged", *TINY, *ENGINE, "--repeats", "2",
                 "--warmup-prompts", "1", "--compare-structured-outputs", "--no-progress",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["mode"], r["repeat"]) for r in result["runs"]] == [
        ("paged", 0), ("paged+json", 0), ("paged+json", 1), ("paged", 1)]
    for run in result["runs"]:
        assert run["output_tokens"] == run["requested_output_tokens"] and not run["short_outputs"]
    assert len(result["structured_ratios"]["paged"]) == 2
    assert result["structured_ratio_median"]["paged"] > 0
    assert len(result["structured_cpu_ratios"]["paged"]) == 2
    assert all(r["cpu_s"] > 0 and r["output_tokens_per_cpu_s"] > 0 for r in result["runs"])
    assert any(row["mode"] == "paged+json/paged" for row in result["rows"])


def test_sampling_compared_at_the_same_lengths(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """--compare-sampling T runs each engine greedy and sampled at T in one alternation: the
    sampled requests write exactly as many tokens as the greedy ones."""
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--kv-mode", "virtual", *TINY, *ENGINE, "--repeats", "2",
                 "--warmup-prompts", "1", "--compare-sampling", "1.0", "--no-progress",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["mode"], r["repeat"]) for r in result["runs"]] == [
        ("virtual", 0), ("virtual+sampled", 0), ("virtual+sampled", 1), ("virtual", 1)]
    for run in result["runs"]:
        assert run["output_tokens"] == run["requested_output_tokens"] and not run["short_outputs"]
    assert len(result["sampled_ratios"]["virtual"]) == 2
    assert any(row["mode"] == "virtual+sampled/virtual" for row in result["rows"])
    assert main(["bench", "throughput", *TINY, *ENGINE, "--compare-sampling", "0"]) != 0
    assert "--compare-sampling takes a temperature > 0, got 0.0" in capsys.readouterr().err


def test_the_bench_schema_constrains_what_is_generated() -> None:
    from vmkv import LLM
    from vmkv.bench.throughput import STRUCTURED, params_for

    llm = LLM(max_model_len=128)
    text = llm.generate([1, 2, 3], params_for(40, STRUCTURED),
                        use_tqdm=False)[0].outputs[0].text
    assert text.lstrip().startswith("[") and '"id"' in text
    matcher = llm.engine.grammars.new_state(BENCH_STRUCTURE).matcher
    assert matcher.accept_string(text) and not matcher.is_terminated()


def test_ratios_are_per_repetition() -> None:
    runs = [{"mode": m, "repeat": i, "output_tokens_per_s": v, "requests_per_s": 1.0,
             "total_tokens_per_s": 1.0, "peak_kv_bytes_in_use": 1, "kv_useful_fraction": 1.0,
             "preemptions": 0, "map_stall_s": 0.0}
            for m, i, v in [("virtual", 0, 30.0), ("paged", 0, 20.0), ("paged", 1, 40.0),
                            ("virtual", 1, 40.0), ("virtual", 2, 10.0), ("paged", 2, 10.0)]]
    out = summarise_runs(runs)
    assert out["ratios"] == [1.5, 1.0, 1.0]
    assert out["ratio_median"] == 1.0
    assert out["summary"]["virtual"]["output_tokens_per_s"] == 30.0


def test_bad_options_are_reported(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "throughput", *TINY, "--repeats", "0", "--no-progress"]) == 2
    assert "repeats must be positive" in capsys.readouterr().err
    assert main(["bench", "throughput", *TINY, "--baseline", "hf", "--dtype", "bfloat16",
                 "--no-progress"]) == 2
    assert "--baseline hf runs transformers in float32 on the CPU" in capsys.readouterr().err


def test_data_parallel_replicas_run_the_same_workload(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    out = tmp_path / "dp.json"
    assert main(["bench", "throughput", "--data-parallel-size", "2", *TINY, *ENGINE,
                 "--enforce-eager", "--repeats", "1", "--warmup-prompts", "2", "--no-progress",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    assert run["mode"] == "virtual dp=2"
    assert run["output_tokens"] == run["requested_output_tokens"] > 0
    assert run["output_tokens_per_s"] > 0 and run["peak_kv_bytes_in_use"] is None
    assert result["startup"]["virtual dp=2"]["startup_to_first_token_s"] > 0
    assert "virtual dp=2" in capsys.readouterr().out
    assert main(["bench", "throughput", "--data-parallel-size", "2", "--kv-mode", "both",
                 *TINY, "--no-progress"]) == 2
    assert "runs one engine kind" in capsys.readouterr().err
