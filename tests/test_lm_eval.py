"""lm-evaluation-harness, the real peer: its ``local-completions`` model pointed at ``vmkv serve``
runs a multiple-choice task from a local JSON file, and scores it exactly as its ``hf`` model
(transformers, the same weights) does: the same accuracy, the same log-likelihoods."""

from __future__ import annotations

from pathlib import Path

import pytest

from vmkv.bench.launch import LaunchedServer

pytestmark = pytest.mark.slow

ITEMS = Path(__file__).parent / "data" / "mc_items.json"
TASK = """
task: vmkv_local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""


def evaluate(tmp_path: Path, model: str, model_args: dict) -> tuple[float, list[list[float]]]:
    """Accuracy and, per item, each choice's log-likelihood."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = tmp_path / "tasks"
    tasks.mkdir(exist_ok=True)
    (tasks / "vmkv_local_mc.yaml").write_text(TASK.format(items=ITEMS))
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["vmkv_local_mc"],
                                  task_manager=TaskManager(include_path=str(tasks)),
                                  log_samples=True, limit=None)
    samples = sorted(out["samples"]["vmkv_local_mc"], key=lambda s: s["doc_id"])
    loglikelihoods = [[float(r[0][0]) for r in s["resps"]] for s in samples]
    return out["results"]["vmkv_local_mc"]["acc,none"], loglikelihoods


def test_lm_eval_local_completions_matches_the_hf_model(tmp_path: Path, default_model: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    hf_acc, hf_ll = evaluate(tmp_path, "hf", {"pretrained": str(default_model),
                                              "dtype": "float32", "device": "cpu"})
    with LaunchedServer(["--max-model-len", "512", "--served-model-name", "smol"]) as srv:
        acc, ll = evaluate(tmp_path, "local-completions", {
            "base_url": f"{srv.base_url}/v1/completions", "model": "smol",
            "tokenizer": str(default_model), "tokenizer_backend": "huggingface",
            "num_concurrent": 4, "max_retries": 1})
    assert acc == hf_acc
    assert 0 < acc < 1  # a task the model neither aces nor fails: the choices matter
    for got, want in zip(ll, hf_ll, strict=True):
        assert got == pytest.approx(want, abs=1e-3)
