"""Print the scheduler's step-by-step trace used in docs/engine.md (no model: tokens are fake).

    python benchmarks/scheduler_trace.py

Three requests (A=20, B=12, C=30 prompt tokens, 12 output tokens each) on a paged cache of 6
blocks of 16 tokens, a 24-token step budget: chunked prefill, admission and preemption show.
"""

from vmkv.config import CacheConfig
from vmkv.engine.scheduler import Scheduler
from vmkv.engine.sequence import Request, Sequence
from vmkv.kv import KVSpec, create_kv_cache
from vmkv.sampling_params import SamplingParams

OUTPUT_TOKENS = 12
PROMPT_LENS = {"A": 20, "B": 12, "C": 30}


def main() -> None:
    spec = KVSpec(1, 1, 4)
    kv = create_kv_cache(CacheConfig(kv_mode="paged", kv_cache_memory=6 * 16 * 32, block_size=16),
                         spec, num_slots=4, max_model_len=512)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=24)
    for rid, n in PROMPT_LENS.items():
        request = Request(rid, [1] * n, SamplingParams(max_tokens=40), OUTPUT_TOKENS)
        sched.add(Sequence(rid, request, 0, [1] * n, n, None))
    for step in range(40):
        if not sched.has_work():
            break
        out = sched.schedule()
        sched.update(out)
        for seq in out.scheduled:
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(2)
                if seq.num_output_tokens == OUTPUT_TOKENS:
                    sched.remove(seq)
        state = " ".join(f"{r}:{kv.room.num_tokens(r)}/{len(kv.block_table(r))}"
                         for r in PROMPT_LENS if kv.room.holds(r))
        preempted = [p.seq_id for p in out.preempted] or ""
        waiting = [w.seq_id for w in sched.waiting] or ""
        print(f"| {step} | {out.num_scheduled_tokens} | {preempted} | {kv.pool.num_free} "
              f"| {state} | {waiting} |")
    print(sched.stats)


if __name__ == "__main__":
    main()
