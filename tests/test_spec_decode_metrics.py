"""Speculative decoding's counters under vLLM's names on /metrics, summed over replicas."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from vmkv.engine.snapshot import Snapshot, combine
from vmkv.server.engine_metrics import EngineCollector
from vmkv.spec_decode.metrics import SpecDecodeCounters


def test_vllm_names_and_labels() -> None:
    counters = SpecDecodeCounters(3)
    counters.count(3, 2)
    counters.count(2, 0)
    assert (counters.acceptance_rate, counters.mean_accepted_length) == (0.4, 2.0)
    snaps = [Snapshot(spec_decode=counters.as_dict()), Snapshot(spec_decode=counters.as_dict())]
    registry = CollectorRegistry()
    registry.register(EngineCollector(lambda: ("m", snaps)))
    text = generate_latest(registry).decode()
    assert 'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 2.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 5.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 2.0' in text
    assert ('vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",'
            'position="1"} 1.0') in text
    total = combine(snaps).spec_decode
    assert total is not None and total["spec_decode_num_accepted_tokens_per_pos"] == [2, 2, 0]
    off = CollectorRegistry()
    off.register(EngineCollector(lambda: ("m", [Snapshot()])))
    assert "spec_decode" not in generate_latest(off).decode()
