"""benchmarks/spec_decode.py's workload settings: grounded tasks stop at EOS, the loop-free
caps cut an output where it starts repeating itself, the random mix that makes guesses fail
samples with a seed."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import spec_decode  # noqa: E402


def test_loop_onset_cuts_at_the_first_self_repeat_not_in_the_prompt() -> None:
    prompt = [1, 2, 3, 4, 9, 1, 2, 3, 4]
    # copying the prompt's own repeated 4-gram (1 2 3 4) is no loop
    assert spec_decode.loop_onset(prompt, [1, 2, 3, 4, 7, 1, 2, 3, 4]) == 9
    # 5 6 7 8 repeats and is not in the prompt: the loop starts at its second occurrence
    out = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    onset = spec_decode.loop_onset(prompt, out)
    assert onset == 4
    assert spec_decode.loop_onset(prompt, out[:onset]) == onset
    assert spec_decode.loop_onset(prompt, [5, 6]) == 2


def test_workload_rows_stop_at_eos_and_sample_with_a_seed() -> None:
    rows = spec_decode.workloads(3, 64)
    assert all(not r["ignore_eos"] and r["temperature"] == 0.0 for r in rows["grounded"])
    assert all(r["output_len"] <= 64 for r in rows["grounded"])
    sampled = rows["random-sampled"]
    assert [r["seed"] for r in sampled] == [0, 1, 2]
    assert all(r["ignore_eos"] and r["temperature"] == 0.9 for r in sampled)
    assert [r["prompt"] for r in sampled] == [r["prompt"] for r in rows["random"]]
    assert all(r["temperature"] == 0.0 for r in rows["random"])
    fixed = spec_decode.workloads(3, 64, grounded_stop="length")["grounded"]
    assert all(r["ignore_eos"] for r in fixed)


def test_openvino_at_several_settings_is_compared_at_its_fastest() -> None:
    import argparse

    def run(variant: str, tpot: float) -> dict:
        return {"workload": "grounded", "variant": variant, "repeat": 0, "tpot_median_ms": tpot,
                "outputs": [[1, 2, 3]]}

    names = [spec_decode.openvino_variant(k, [5, 8]) for k in (5, 8)]
    assert names == ["openvino-prompt-lookup-k5", "openvino-prompt-lookup-k8"]
    assert spec_decode.openvino_variant(5, [5]) == "openvino-prompt-lookup"
    args = argparse.Namespace(spec="{}", kv_mode="virtual", grounded_stop="eos", temperature=0.9,
                              num_prompts=1, repeats=1, max_output=8, openvino=True,
                              openvino_num_assistant_tokens=[5, 8], openvino_max_ngram_size=3,
                              openvino_model="m")
    rows = {"grounded": [{"output_len": 3}]}
    summary = spec_decode.summarise([run("off", 10.0), run("spec", 4.0), run(names[0], 6.0),
                                     run(names[1], 5.0)], ["grounded"], args, rows)
    grounded = summary["summary"]["grounded"]
    assert grounded["openvino_best"] == names[1]
    assert grounded["spec_over_openvino"] == 4.0 / 5.0
    assert summary["settings"]["openvino"]["num_assistant_tokens"] == [5, 8]
