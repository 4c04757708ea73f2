"""`vmkv bench study`: a smoke run of every part (real engines, real servers, real page
mapping, tiny sizes) writes the report, the figures and the JSON; every number of the report
comes from the JSON; parts resume; GPU results are read where they exist."""

from __future__ import annotations

import json
import mmap
import re
from pathlib import Path

import psutil
import pytest

from vmkv.bench.study import PART_NAMES, end_to_end, gpu, report
from vmkv.bench.study.counters import _parse_perf_csv, process_counters, tlb_readable
from vmkv.bench.study.fmt import num, number_tokens, unsourced_numbers
from vmkv.bench.study.scale import SMOKE
from vmkv.cli import main
from vmkv.cpu_info import bf16_hardware

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def study(default_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("study")
    # children from before (another test's compile workers, under pytest-xdist) are not ours
    before = set(psutil.Process().children())
    with pytest.MonkeyPatch.context() as mp:  # not the repository's own GPU results
        mp.setattr(gpu, "SEARCH", ())
        assert main(["bench", "study", "--smoke", "--out", str(out), "--no-progress"]) == 0
    assert set(psutil.Process().children()) - before == set()  # every server launched is gone
    return out


def _doc(out: Path) -> dict:
    return json.loads((out / "results" / "study.json").read_text())


def test_every_part_has_numbers_and_the_json_the_environment(study: Path) -> None:
    doc = _doc(study)
    assert list(doc["parts"]) == list(PART_NAMES)
    for name, part in doc["parts"].items():
        assert "error" not in part, (name, part.get("traceback"))
        assert part["scale"] == "smoke" and part["raw"] and part["summary"], name
        assert all(c.startswith(f"vmkv bench study --smoke --out {study} --parts {name}")
                   or name == "gpu" for c in part["commands"].values())
    env = doc["environment"]
    for key in ("cpu_model", "cpu_flags", "cores", "memory_bytes", "kernel", "versions",
                "commit_full", "vm_max_map_count"):
        assert env[key], key
    assert env["bf16_hardware"] == list(bf16_hardware())  # empty on an AVX2-only CPU
    assert set(env["transparent_hugepage"]) >= {"enabled", "shmem_enabled"}
    assert env["tlb_counters"] == tlb_readable()
    e2e = doc["parts"]["end_to_end"]["raw"]
    assert set(e2e["offline"]["float32"]) == {"prompt-heavy", "balanced", "decode-heavy"}
    for mix in e2e["offline"]["float32"].values():  # exact lengths: every run did the work
        assert all(r["short_outputs"] == 0 and r["output_tokens"] ==
                   mix["workload"]["output_tokens"] for r in mix["runs"])
    assert all(r["failed"] == 0 for m in e2e["online"]["modes"].values() for r in m["runs"])
    tax = doc["parts"]["tax"]["summary"]["variants"]
    assert tax["paged"]["map_calls"] == 0 and tax["virtual"]["map_calls"] > 0
    assert all(v["minor_faults_per_step"] >= 0 for v in tax.values())
    kv = doc["parts"]["kv_dtype"]["summary"]
    assert kv["storage"] == {"auto": "float32", "int8": "int8"}  # smoke: the float32 model
    assert kv["tokens_ratio"] >= 1.9 * 2  # float32 K/V against int8 rows with their scales
    assert {n: v["map_calls_per_token"] == 0 for n, v in kv["engines"].items()
            if n.startswith("paged")} == {"paged auto": True, "paged int8": True}
    assert set(kv["decode"]) == set(kv["engines"]) and 0 < kv["accuracy"]["agreement_pct"] <= 100


def test_the_report_answers_first_and_shows_each_figure_with_question_numbers_command(
        study: Path) -> None:
    md = (study / "study.md").read_text()
    first_screen = md.split("## The machine")[0]
    assert re.search(r"\*\*Virtual is (faster than|slower than|as fast as) paged on this "
                     r"machine(, by [\d.]+ %)?\*\*", first_screen)
    assert "Why:" in first_screen and "**The virtual tax**" in first_screen
    assert "**In sum**" in first_screen and _doc(study)["answer"]["tax_pct"] >= 0
    assert "**The KV dtype**: `--kv-cache-dtype auto` keeps the model's dtype (float32" in \
        first_screen
    headings = re.findall(r"^## (\d)\. (.+)$", md, re.M)
    assert [int(n) for n, _ in headings] == list(range(1, len(PART_NAMES) + 1))
    figures = md.split("\n### ")[1:]
    assert len(figures) >= 12
    for fig in figures:
        question = fig.splitlines()[0]
        assert question.endswith("?"), question
        assert "\n| " in fig and "|---|" in fig, question  # its numbers
        assert re.search(r"^Command: `vmkv bench study --smoke --out .+ --parts \w+",
                         fig, re.M) or "check.sh" in fig, question
    images = re.findall(r"!\[[^]]*\]\((images/study/[\w-]+\.png)\)", md)
    assert len(images) >= 10 and len(set(images)) == len(images)
    for image in images:
        assert (study / image).read_bytes().startswith(PNG)
    assert "**No GPU results yet**" in md and md.count("Missing: ") == len(gpu.STEPS)
    assert "TLB misses: " in md


def test_every_number_in_the_report_comes_from_the_json(study: Path) -> None:
    md, doc = (study / "study.md").read_text(), _doc(study)
    assert len(number_tokens(md)) > 200
    assert unsourced_numbers(md, doc) == []
    # the check can fail: a number the JSON does not hold is found
    assert unsourced_numbers(md + "\nvirtual took 123.457 ms\n", doc) == ["123.457"]
    # and the report is the JSON's alone: rendered again from it, it is the same text
    assert report.render(doc, study) == md


def test_a_study_resumes_and_reruns_only_the_parts_asked_for(study: Path) -> None:
    before = _doc(study)["parts"]
    assert main(["bench", "study", "--smoke", "--out", str(study), "--no-progress"]) == 0
    again = _doc(study)["parts"]
    assert all(again[p]["finished"] == before[p]["finished"] for p in PART_NAMES
               if p != "gpu")  # measured once; the GPU part only reads files
    assert main(["bench", "study", "--smoke", "--out", str(study), "--parts", "memory",
                 "--no-progress"]) == 0
    after = _doc(study)["parts"]
    assert after["memory"]["seconds"] != before["memory"]["seconds"]
    assert all(after[p] == again[p] for p in PART_NAMES if p not in ("memory", "gpu"))


def test_an_unknown_part_is_refused(study: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "study", "--smoke", "--out", str(study), "--parts", "memroy"]) == 2
    assert "unknown part(s) ['memroy']" in capsys.readouterr().err


def test_gpu_results_are_read_into_the_study(study: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A check.sh results folder (as a GPU run writes it) fills the GPU section and leaves the
    study's machine alone; a CPU dry run's folder does not count."""
    committed = gpu.find_results()  # the H200 run in docs/results/gpu-check
    assert committed is not None and committed.name == "gpu-check"
    monkeypatch.setattr(gpu, "SEARCH", ())
    machine = _doc(study)["environment"]
    folder = tmp_path / "gpu-check"
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps({"device": "cpu", "rows": []}))
    assert gpu.find_results(str(folder)) is None or gpu.find_results(str(folder)) != folder
    (folder / "summary.json").write_text(json.dumps({"device": "NVIDIA H200", "rows": []}))
    twins = {"batch": 32, "context": 8192, "block": 16, "triton/contiguous_ms": 0.211,
             "triton/identity_ms": 0.233, "triton/shuffled_ms": 0.245,
             "triton_shuffled_over_contiguous": 1.161}
    (folder / "s7_twins.json").write_text(json.dumps({"ok": True, "data": {"rows": [twins]}}))
    ops = {op: {"n": 256, "p50_us": p50, "p99_us": 2 * p50} for op, p50 in
           (("create", 41.5), ("map", 3.25), ("unmap", 7.75), ("touch", 12.5),
            ("release", 30.5))}
    (folder / "s2_vmm_latency.json").write_text(json.dumps({"ok": True, "data": {
        "engine_thread": ops, "mapper": {"jobs": 4, "units": 64, "busy_ms": 1.5,
                                         "stall_ms": 0.375, "stall_p50_us": 80.5,
                                         "stall_p99_us": 150.5}}}))
    assert main(["bench", "study", "--smoke", "--out", str(study), "--parts", "gpu",
                 "--gpu-results", str(folder), "--no-progress"]) == 0
    md, doc = (study / "study.md").read_text(), _doc(study)
    assert doc["parts"]["gpu"]["summary"]["available"]
    gpu_section = md.split(". On a GPU")[1]  # the last part
    assert f"`{folder}`" in gpu_section and "**No GPU results yet**" not in gpu_section
    assert num(1.161) in gpu_section and num(0.375) in gpu_section
    assert gpu_section.count("Missing: ") == 1 and "s6_decode" in gpu_section
    assert "| cuda (check.sh) | 2,097,152 | 256 |" in md  # in part 4's page-operation table
    assert unsourced_numbers(md, doc) == []
    assert doc["environment"] == machine
    assert main(["bench", "study", "--smoke", "--out", str(study), "--parts", "gpu",
                 "--no-progress"]) == 0  # back to no results (the module's other tests)


@pytest.mark.parametrize(("flags", "expected"), [((), ["float32"]),
                                                 (("amx_bf16",), ["float32", "bfloat16"])])
def test_bfloat16_runs_where_the_cpu_has_bf16_hardware(monkeypatch: pytest.MonkeyPatch,
                                                       flags: tuple[str, ...],
                                                       expected: list[str]) -> None:
    from vmkv.bench.study.scale import QUICK

    monkeypatch.setattr(end_to_end, "bf16_hardware", lambda: flags)
    assert end_to_end.dtypes(QUICK)[0] == expected
    assert end_to_end.dtypes(SMOKE)[0] == ["float32"]


def test_number_format_and_tokens() -> None:
    assert [num(x) for x in (1234567, 0.000123456, 3.14159, 42.42, 1234.5, None)] == [
        "1,234,567", "0.000123", "3.14", "42.4", "1,234", "n/a"]
    assert number_tokens("fp32 16K SmolLM2-135M 1,503 tokens, -2.5 % at 0.973× (rep 3).") == [
        "1,503", "-2.5", "0.973", "3"]


def test_counters_count_faults_and_parse_perf() -> None:
    fresh = mmap.mmap(-1, 16 << 20)  # anonymous: no page is there before its first touch
    fresh.madvise(mmap.MADV_NOHUGEPAGE)  # 4 KiB pages whatever the THP setting
    with process_counters() as c:
        for offset in range(0, len(fresh), 4096):
            fresh[offset] = 1
    fresh.close()
    assert c["minor_faults"] >= 4096  # one per page touched
    assert _parse_perf_csv("<not supported>,,dTLB-load-misses,0,100.00,,\n"
                           "12345,,iTLB-load-misses,1000,100.00,,\n") == {
        "dTLB-load-misses": "not supported", "iTLB-load-misses": 12345}


def test_gpu_decode_rows_pair_each_mode_with_its_default_kernel() -> None:
    """s6 times virtual with its default kernel and with aten-flash over one fill: the study's
    ratio uses the defaults and shows FA2 beside them."""
    s6 = {"virtual_setup": {"kernel": "triton"}, "paged_setup": {"kernel": "triton"},
          "rows": [{"mode": "virtual", "kernel": "triton", "batch": 32, "context": 8192,
                    "graph_ms": 14.5},
                   {"mode": "virtual", "kernel": "aten-flash", "batch": 32, "context": 8192,
                    "graph_ms": 19.9},
                   {"mode": "paged", "kernel": "triton", "batch": 32, "context": 8192,
                    "graph_ms": 15.0}],
          "paged_over_virtual": [{"batch": 32, "context": 8192, "timing": "graph_ms",
                                  "paged_over_virtual": 15.0 / 14.5}]}
    (row,) = gpu._decode_rows(s6)
    assert (row["virtual_ms"], row["paged_ms"], row["virtual_aten_flash_ms"]) == (14.5, 15.0, 19.9)
    old = {**s6, "virtual_setup": {"kernel": "aten-flash"},  # before rows named their kernel
           "rows": [{k: v for k, v in r.items() if k != "kernel"} for r in s6["rows"][1:]]}
    (row,) = gpu._decode_rows(old)
    assert (row["virtual_ms"], row["paged_ms"]) == (19.9, 15.0)
    assert "virtual_aten_flash_ms" not in row
