"""The peer comparison harness (benchmarks/peers): engine names, rotation, medians and ratios
with invalid runs left out, failures reported, resume checks. No engine runs here: the peers
need their own venvs (docs/benchmarks.md); what is measured is the harness's bookkeeping."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

PEERS = Path(__file__).resolve().parents[1] / "benchmarks" / "peers"
sys.path.insert(0, str(PEERS))

import best_peers  # noqa: E402
import compare  # noqa: E402
from peer_result import RESULT_PREFIX, exactness  # noqa: E402


def test_engine_names() -> None:
    assert len(compare.COLORS) >= len(compare.PRECISIONS)  # a colour per precision (draw)
    assert compare.parse_engine("vllm") == compare.Engine("vllm", "fp32")
    assert compare.parse_engine("paged-bf16").name == "paged-bf16"
    assert compare.parse_engine("openvino-bf16").is_peer
    assert not compare.parse_engine("virtual").is_peer
    for bad in ("sglang", "vllm-fp16", "paged-"):
        with pytest.raises(ValueError, match="FAMILY"):
            compare.parse_engine(bad)
    assert [e.name for e in compare.parse_engines("vllm,vllm-fp32,paged")] == [
        "vllm-fp32", "paged-fp32"]
    # weight formats: OpenVINO's int8/int4 exports, vmkv on a GGUF model's own blocks
    assert compare.parse_engine("openvino-int4").is_peer
    assert compare.parse_engine("paged-gguf").precision == "gguf"
    for bad in ("vllm-int8", "virtual-int4", "openvino-gguf"):
        with pytest.raises(ValueError, match="FAMILY"):
            compare.parse_engine(bad)
    setup = compare.Setup(model="m", openvino_python="py", openvino_model="fp32",
                          openvino_int8_model="int8")
    assert setup.openvino_weights("int8") == "int8" and setup.openvino_weights("bf16") == "fp32"
    setup.check(compare.parse_engines("openvino-int8"))
    with pytest.raises(ValueError, match="--openvino-int4-model"):
        setup.check(compare.parse_engines("openvino-int4"))
    with pytest.raises(ValueError, match="openvino-int4kv8 needs --openvino-int4-model"):
        setup.check(compare.parse_engines("openvino-int4kv8"))


def test_rotation_starts_each_repeat_one_later() -> None:
    engines = compare.parse_engines("vllm,virtual,paged")
    orders = [[e.family for e in compare.rotation(engines, r)] for r in range(4)]
    assert orders == [["vllm", "virtual", "paged"], ["virtual", "paged", "vllm"],
                      ["paged", "vllm", "virtual"], ["vllm", "virtual", "paged"]]


def test_exactness_counts_wrong_lengths() -> None:
    rows = [{"prompt": [1, 2], "output_len": 3}, {"prompt": [4], "output_len": 2}]
    assert exactness(rows, [3, 1]) == {
        "num_requests": 2, "prompt_tokens": 3, "output_tokens": 4,
        "requested_output_tokens": 5, "wrong_length_requests": 1}


def _row(engine: str, repeat: int, tps: float, valid: bool = True) -> dict:
    e = compare.parse_engine(engine)
    return {"engine": e.name, "family": e.family, "precision": e.precision, "repeat": repeat,
            "valid": valid, "output_tokens_per_s": tps, "startup_s": 1.0}


def test_summary_medians_ratios_and_invalid_runs() -> None:
    runs = [_row("vllm-fp32", 0, 100), _row("vllm-fp32", 1, 120), _row("vllm-fp32", 2, 110),
            _row("openvino-fp32", 0, 130), _row("vllm-bf16", 0, 300),
            _row("openvino-bf16", 0, 250), _row("paged-fp32", 0, 260),
            _row("paged-fp32", 1, 9999, valid=False),  # wrong lengths: not in the median
            _row("virtual-bf16", 0, 150),
            {"engine": "paged-bf16", "family": "paged", "precision": "bf16", "repeat": 0,
             "valid": False, "error": "exit status 1"}]
    s = compare.summarise(runs)
    assert s["median"]["vllm-fp32"] == 110
    assert s["median"]["paged-fp32"] == 260
    assert "paged-bf16" not in s["median"]
    assert s["best_peer"] == {"fp32": "openvino-fp32", "bf16": "vllm-bf16"}
    assert s["vmkv_over_best_peer"] == {"fp32": {"paged": 2.0}, "bf16": {"virtual": 0.5}}
    assert s["vmkv_best_over_best_peer"]["paged"] == {
        "vmkv": "paged-fp32", "peer": "vllm-bf16", "ratio": 260 / 300}
    assert s["invalid_runs"] == ["paged-fp32-1"]
    assert s["failed_runs"] == ["paged-bf16-0"]
    assert not s["all_outputs_exact_length"]
    assert "INVALID" in compare.describe({**_row("paged-fp32", 1, 1.0, valid=False),
                                          "output_tokens": 1, "requested_output_tokens": 2,
                                          "process_s": 1.0, "wrong_length_requests": 1})
    assert "FAILED" in compare.describe(runs[-1])
    assert "vmkv_int8_kv_over_best_peer" in s and not s["vmkv_int8_kv_over_best_peer"]


def test_int8_kv_engines_are_compared_with_the_best_peer_at_any_setting() -> None:
    kvhead8 = compare.parse_engine("virtual-kvhead8")
    assert not kvhead8.is_peer and kvhead8.precision in compare.INT8_KV
    with pytest.raises(ValueError, match="FAMILY"):
        compare.parse_engine("openvino-kvhead8")
    runs = [_row("openvino-int4", 0, 200), _row("openvino-kv8", 0, 150),
            _row("virtual-head8", 0, 300), _row("virtual-kvhead8", 0, 260),
            _row("paged-kv8", 0, 210)]
    s = compare.summarise(runs)
    assert s["vmkv_int8_kv_over_best_peer"] == {
        "virtual": {"vmkv": "virtual-kvhead8", "peer": "openvino-int4", "ratio": 1.3},
        "paged": {"vmkv": "paged-kv8", "peer": "openvino-int4", "ratio": 1.05}}
    assert s["vmkv_best_over_best_peer"]["virtual"]["vmkv"] == "virtual-head8"
    state = {"mixes": {"balanced": {"summary": s}}}
    assert "| virtual with int8 KV / best peer at its best | **1.30x**" in best_peers.table(state)
    assert "| virtual-kvhead8 | 260.0 |" in best_peers.table(state)


def test_precisions_as_each_engine_spells_them_on_this_cpu(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """With bf16 hardware vmkv's weight and KV precisions run bfloat16; without it float32
    (``--dtype auto``'s choice), as OpenVINO's int8/int4 exports run f32; fp32/bf16 as named."""
    from vmkv import cpu_info

    for hardware, want in ((True, ("bfloat16", "bf16")), (False, ("float32", "f32"))):
        monkeypatch.setattr(cpu_info, "bf16_hardware", lambda hardware=hardware: hardware)
        for name in ("virtual-gguf", "paged-ggufkv8", "virtual-kv8", "paged-kvhead8"):
            assert compare.peer_flag(compare.parse_engine(name)) == want[0], name
        assert compare.peer_flag(compare.parse_engine("openvino-int8")) == want[1]
        assert compare.peer_flag(compare.parse_engine("virtual-bf16")) == "bfloat16"
        assert compare.peer_flag(compare.parse_engine("paged")) == "float32"
        assert compare.peer_flag(compare.parse_engine("openvino-kv8")) == "u8kv"
    assert compare.parse_engine("virtual-ggufkv8").precision in compare.INT8_KV


def test_a_failing_process_and_a_missing_result_are_reported(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    code = "import sys; print('boom'); sys.exit(3)"
    with pytest.raises(compare.EngineFailed, match="exit status 3(.|\n)*boom"):
        compare.run_process([sys.executable, "-c", code], {}, log, None)
    compare.run_process([sys.executable, "-c", "print('no result')"], {}, log, None)
    with pytest.raises(compare.EngineFailed, match="no PEER_RESULT"):
        compare.peer_result(log)
    log.write_text("noise\n" + RESULT_PREFIX + json.dumps({"generate_s": 2.0}) + "\n")
    assert compare.peer_result(log) == {"generate_s": 2.0}


def test_vllm_env_preloads_the_venvs_openmp_without_vmkvs_tuning(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "20000")
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "lib").mkdir()
    (tmp_path / "venv" / "lib" / "libiomp5.so").touch()
    python = tmp_path / "venv" / "bin" / "python"
    python.symlink_to(sys.executable)  # as in a venv: a link to the base interpreter
    setup = compare.Setup(model="m", vllm_python=str(python), threads=2, kv_cache_gib=3)
    env = compare.peer_env(compare.parse_engine("vllm-bf16"), setup)
    assert "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["LD_PRELOAD"].endswith(str(tmp_path / "venv" / "lib" / "libiomp5.so"))
    assert "OMP_WAIT_POLICY" not in compare.peer_env(compare.parse_engine("openvino"), setup)
    with pytest.raises(ValueError, match="--openvino-python"):
        setup.check(compare.parse_engines("openvino"))


def test_mixes_scale_and_resume_refuses_another_configuration(tmp_path: Path) -> None:
    assert best_peers.scaled((256, 1024), 0.125) == (32, 128)
    assert best_peers.scaled((1, 3), 0.1) == (1, 1)
    config = {"num_prompts": 64, "seed": 0}
    state = best_peers.load_state(tmp_path / "s.json", config, fresh=False)
    assert state == {"config": config, "mixes": {}, "sittings": []}
    state["mixes"]["balanced"] = {"runs": [_row("vllm-fp32", 0, 100), _row("paged-fp32", 0, 90)]}
    best_peers.save(state, tmp_path)
    saved = tmp_path / best_peers.STATE
    assert best_peers.load_state(saved, config, fresh=False)["mixes"]["balanced"]["summary"][
        "vmkv_over_best_peer"] == {"fp32": {"paged": 0.9}}
    assert "**0.90x**" in best_peers.table(state)
    with pytest.raises(SystemExit, match="another configuration"):
        best_peers.load_state(saved, {**config, "seed": 1}, fresh=False)
    assert best_peers.load_state(saved, {**config, "seed": 1}, fresh=True)["mixes"] == {}
