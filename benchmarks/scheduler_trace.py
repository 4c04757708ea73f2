"""Print the scheduler's step-by-step trace used in docs/engine.md (no model: tokens are fake).

    python benchmarks/scheduler_trace.py
"""

from vmkv.config import CacheConfig
from vmkv.engine.scheduler import Scheduler
from vmkv.engine.sequence import Request, Sequence
from vmkv.kv import KVSpec, create_kv_cache
from vmkv.sampling_params import SamplingParams
spec = KVSpec(1, 1, 4)
kv = create_kv_cache(CacheConfig(kv_mode="paged", kv_cache_bytes=6*16*32, block_size=16), spec, num_slots=4, max_model_len=512)
s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=24)
lens = {"A": 20, "B": 12, "C": 30}
for rid, n in lens.items():
    q = Sequence(rid, Request(rid, [1]*n, SamplingParams(max_tokens=40), 12), 0, [1]*n, n, None)
    s.add(q)
step = 0
while s.has_work() and step < 40:
    out = s.schedule(); s.update(out)
    for q in out.scheduled:
        if q.num_computed_tokens == q.num_tokens:
            q.token_ids.append(2)
            if q.num_output_tokens == 12: s.remove(q)
    state = " ".join(f"{r}:{kv.num_tokens(r)}/{len(kv.block_tables.get(r, []))}" for r in lens if kv.has_request(r))
    print(f"| {step} | {out.num_scheduled_tokens} | {[p.seq_id for p in out.preempted] or ''} | {kv.pool.num_free} | {state} | {[w.seq_id for w in s.waiting] or ''} |")
    step += 1
print(s.stats)
