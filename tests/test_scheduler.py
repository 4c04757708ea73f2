"""Scheduler on real KV managers with a marker-writing stand-in for the model.

The stand-in writes, for every computed token, a marker derived from the token's id and position
into layer 0's K cache, and before every step checks that each scheduled sequence's cached rows
still hold exactly those markers. A preemption that lost or corrupted KV (swap) or failed to
recompute it fails the check; the token stream is a deterministic function of the history, so any
scheduling mistake shows up as a different output.
"""

from __future__ import annotations

import pytest
import torch

from vmkv.attention import create_attention_backend
from vmkv.config import CacheConfig
from vmkv.engine.scheduler import Scheduler
from vmkv.engine.sequence import Request, Sequence
from vmkv.kv import KVSpec, create_kv_cache
from vmkv.sampling_params import SamplingParams

SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=4)  # 32 B per token


def marker(token: int, pos: int) -> float:
    return float(token * 1000 + pos)


def next_token(history: list[int]) -> int:
    return (sum(history) * 31 + len(history)) % 97


class MarkerRunner:
    """Writes markers as the model would write K; checks what attention would read."""

    def __init__(self, kv) -> None:
        self.kv = kv
        self.attn = create_attention_backend(kv)

    def rows(self, seq_id: str, n: int) -> torch.Tensor:
        """Flat cache rows of a sequence's first ``n`` tokens, from the KV manager itself."""
        pos = torch.arange(n)
        if self.kv.kv_mode == "virtual":
            return self.kv.slot(seq_id) * self.kv.layout.slot_tokens + pos
        table = torch.tensor(self.kv.block_table(seq_id), dtype=torch.int64)
        return table[pos // self.kv.block_size] * self.kv.block_size + pos % self.kv.block_size

    def run(self, out) -> None:
        seqs = out.scheduled
        if not seqs:
            return
        ctx = [s.num_computed_tokens for s in seqs]
        qlen = [out.num_scheduled_tokens[s.seq_id] for s in seqs]
        meta = self.attn.prepare([s.seq_id for s in seqs], ctx, qlen)
        k_flat = self.attn._flat[0][0]
        for s, c in zip(seqs, ctx, strict=True):
            rows = self.rows(s.seq_id, c)
            want = torch.tensor([marker(t, p) for p, t in enumerate(s.token_ids[:c])])
            assert torch.equal(k_flat[rows, 0, 0], want), f"{s.seq_id}: cached KV corrupted"
        new = torch.tensor([marker(t, p) for s, c, n in zip(seqs, ctx, qlen, strict=True)
                            for p, t in enumerate(s.token_ids[c : c + n], start=c)])
        spec = self.kv.spec
        k_flat[meta.write_rows] = new.view(-1, 1, 1).expand(-1, spec.num_kv_heads, spec.head_dim)


def run_all(kv_mode: str, kv_bytes: int, preemption: str, prompts: list[list[int]],
            max_tokens: int, budget: int = 64, max_num_seqs: int = 8):
    kv = create_kv_cache(CacheConfig(kv_mode=kv_mode, kv_cache_memory=kv_bytes,
                                     page_size=4096, kv_layout="all-layers"), SPEC,
                         num_slots=max_num_seqs,
                         max_model_len=512)
    sched = Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                      preemption_mode=preemption)
    runner = MarkerRunner(kv)
    seqs = []
    for i, prompt in enumerate(prompts):
        req = Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), max_tokens)
        seq = Sequence(f"r{i}", req, 0, list(prompt), len(prompt), None)
        seqs.append(seq)
        sched.add(seq)
    steps = 0
    while sched.has_work():
        out = sched.schedule()
        assert out.total_tokens <= budget and len(sched.running) <= max_num_seqs
        runner.run(out)
        sched.update(out)
        for seq in out.out_of_capacity:
            raise AssertionError(f"{seq.seq_id} ran out of capacity")
        for seq in list(out.scheduled):
            if seq.num_computed_tokens == seq.num_tokens:  # prompt done or decode: sample
                seq.token_ids.append(next_token(seq.token_ids))
                if seq.num_output_tokens == max_tokens:
                    sched.remove(seq)
        kv.accounting.check()
        steps += 1
        assert steps < 10_000
    assert kv.accounting.usage.num_requests == 0 and kv.accounting.usage.bytes_in_use == 0
    return {s.seq_id: s.output_token_ids for s in seqs}, sched.stats


PROMPTS = [[(7 * i + j) % 50 + 1 for j in range(20 + 13 * i)] for i in range(12)]


@pytest.mark.parametrize("kv_mode", ["virtual", "paged"])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preemption_keeps_outputs_identical(kv_mode: str, preemption: str) -> None:
    ample, stats = run_all(kv_mode, 1 << 20, preemption, PROMPTS, max_tokens=40)
    assert stats.num_preemptions == 0
    tight, stats = run_all(kv_mode, 400 * SPEC.bytes_per_token, preemption, PROMPTS,
                           max_tokens=40)
    assert stats.num_preemptions > 0
    if preemption == "swap":
        assert stats.num_swapped_out_tokens > 0 and stats.num_recomputed_tokens == 0
        assert stats.num_swapped_in_tokens == stats.num_swapped_out_tokens
    else:
        assert stats.num_recomputed_tokens > 0
    assert tight == ample


def test_chunked_prefill_fills_the_budget_and_decodes_first() -> None:
    kv = create_kv_cache(CacheConfig(kv_mode="paged", kv_cache_memory=1 << 20), SPEC,
                         num_slots=4, max_model_len=512)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=16)
    req = Request("a", [1] * 40, SamplingParams(), 16)
    a = Sequence("a", req, 0, [1] * 40, 40, None)
    b = Sequence("b", Request("b", [2] * 5, SamplingParams(), 16), 0, [2] * 5, 5, None)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 16}  # a's first chunk takes the whole budget
    sched.update(out)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 16}
    sched.update(out)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 8, "b": 5}  # a finishes, b is admitted
    sched.update(out)
    a.token_ids.append(3)
    b.token_ids.append(3)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}  # one decode token each


def test_a_prompt_that_can_never_fit_finishes_instead_of_looping() -> None:
    kv = create_kv_cache(CacheConfig(kv_mode="paged", kv_cache_memory=64 * 32), SPEC,
                         num_slots=2, max_model_len=512)  # 64 tokens of room
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=256)
    seq = Sequence("big", Request("big", [1] * 100, SamplingParams(), 4), 0, [1] * 100, 100,
                   None)
    sched.add(seq)
    out = sched.schedule()
    assert out.out_of_capacity == [seq] and seq.finish_reason == "length"
    assert not sched.has_work() and kv.accounting.usage.num_requests == 0


def test_bad_scheduler_settings_name_the_value() -> None:
    kv = create_kv_cache(CacheConfig(kv_mode="paged"), SPEC, num_slots=2, max_model_len=64)
    with pytest.raises(ValueError, match="preemption_mode must be one of .* got 'drop'"):
        Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=8, preemption_mode="drop")
    with pytest.raises(ValueError, match="max_num_seqs must be positive, got 0"):
        Scheduler(kv, max_num_seqs=0, max_num_batched_tokens=8)
