"""A long soak against a real ``vmkv serve`` (not run in CI): many requests, clients that give up
at random, and an offered load of about four times the KV capacity; RSS and KV bytes over time.

    python benchmarks/soak.py --json docs/results/soak.json --plot docs/images/soak.png

Defaults: 10,000 requests; prompts of 8-64 words and 2-24 new tokens (streamed half the time);
30 % of the clients leave early (a stream after 1-4 chunks, a non-streaming client after a
0.2-2 s timeout); a 64 MiB KV budget (~1,450 tokens of SmolLM2-135M fp32) with concurrency
chosen so the requests in flight need ~4x that, so the scheduler preempts and the bounded queue
(``--max-waiting-requests``) answers 503 + Retry-After, which the client honours before
retrying (a refused request counts once per refusal). ``--max-idle-memory 8M`` returns memory.
Sampled every ``--interval`` s from outside (benchmarks/probe.py). At the end the server must
hold no KV bytes in use, and its memfd must be back within the idle budget.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from typing import Any

import httpx
from probe import Sampler, save

from vmkv.bench.launch import LaunchedServer
from vmkv.config_args import parse_size

MiB = 1 << 20
BYTES_PER_TOKEN = 46_080  # SmolLM2-135M fp32: 30 layers x 2 x 3 heads x 64 x 4 B
AVG_TOKENS = 50  # ~36 prompt tokens (with the chat-free prefix) + ~13 new tokens
WORDS = ["the", "a", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as",
         "by", "at", "from", "his", "her", "it"]


async def one(client: httpx.AsyncClient, url: str, rng: random.Random, i: int,
              abort_fraction: float, outcomes: Counter) -> None:
    body = {"prompt": f"Item {i}: " + " ".join(rng.choice(WORDS) for _ in
                                               range(rng.randrange(8, 64))),
            "max_tokens": rng.randrange(2, 24), "ignore_eos": True, "temperature": 0.8,
            "seed": i, "stream": rng.random() < 0.5}
    leave = rng.random() < abort_fraction
    while True:
        try:
            if body["stream"]:
                status = await stream(client, url, body, rng.randrange(1, 5) if leave else None)
            else:
                timeout = rng.uniform(0.2, 2.0) if leave else 300
                r = await client.post(f"{url}/v1/completions", json=body, timeout=timeout)
                status = r.status_code
        except httpx.TimeoutException:
            status = "client_timeout"
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        outcomes[status] += 1
        if status != 503:
            return
        await asyncio.sleep(1.0)  # the server's Retry-After


async def stream(client: httpx.AsyncClient, url: str, body: dict, leave_after: int | None
                 ) -> int | str:
    chunks = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            return r.status_code
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                return 200
            if line.startswith("data: "):
                chunks += 1
                if '"error"' in line:
                    return "stream_error"
                if leave_after is not None and chunks >= leave_after:
                    return "client_left"
    return "stream_cut"


async def drive(url: str, args: argparse.Namespace, concurrency: int) -> Counter:
    rng = random.Random(args.seed)
    outcomes: Counter = Counter()
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 8)) as client:
        async def bounded(i: int) -> None:
            async with gate:
                await one(client, url, rng, i, args.abort_fraction, outcomes)

        await asyncio.gather(*(bounded(i) for i in range(args.requests)))
    return outcomes


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    t = [r["t"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    ax1.plot(t, [r["rss"] / MiB for r in rows], label="server RSS")
    ax1.set_ylabel("MiB (RSS)")
    ax1b = ax1.twinx()
    ax1b.plot(t, [r["memfd"] / MiB for r in rows], color="tab:green",
              label="KV pool memfd (the OS holds)")
    ax1b.plot(t, [r.get("in_use", 0) / MiB for r in rows], ":", color="tab:red",
              label="KV bytes in use")
    ax1b.set_ylabel("MiB (KV)")
    ax1.legend(loc="upper left", fontsize=7)
    ax1b.legend(loc="upper right", fontsize=7)
    ax2.plot(t, [r.get("running", 0) for r in rows], label="running")
    ax2.plot(t, [r.get("waiting", 0) for r in rows], label="waiting")
    ax2.plot(t, [r.get("preemptions", 0) for r in rows], label="preemptions (total)")
    ax2.set_xlabel("time (s)")
    ax2.legend(fontsize=7)
    ax1.set_title(f"soak: {result['options']['requests']:,} requests, "
                  f"{result['concurrency']} clients, {result['options']['kv_cache_memory']} KV")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--abort-fraction", type=float, default=0.3)
    parser.add_argument("--overload", type=float, default=4.0,
                        help="KV demand of the requests in flight / KV capacity")
    parser.add_argument("--kv-cache-memory", default="64M")
    parser.add_argument("--max-idle-memory", default="8M")
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--idle", type=float, default=10.0, help="seconds sampled after")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args()
    capacity_tokens = parse_size(args.kv_cache_memory) // BYTES_PER_TOKEN
    concurrency = max(1, round(args.overload * capacity_tokens / AVG_TOKENS))
    serve_args = ["--kv-cache-memory", args.kv_cache_memory, "--max-idle-memory",
                  args.max_idle_memory, "--max-model-len", "256", "--max-num-seqs", "64",
                  "--max-waiting-requests", str(concurrency // 2)]
    with LaunchedServer(serve_args) as srv:
        started = time.monotonic()
        sampler = Sampler(srv.proc.pid, srv.base_url, args.interval, started)
        sampler.start()
        outcomes = asyncio.run(drive(srv.base_url, args, concurrency))
        elapsed = time.monotonic() - started
        time.sleep(args.idle)
        rows = sampler.stop()
    final = rows[-1]
    result = {"bench": "soak", "options": {k: v for k, v in vars(args).items()
                                           if k not in ("json", "plot")},
              "concurrency": concurrency, "capacity_tokens": capacity_tokens,
              "elapsed_s": round(elapsed, 1), "requests_per_s": round(args.requests / elapsed, 2),
              "outcomes": {str(k): v for k, v in outcomes.items()},
              "final": final, "peak_rss": max(r["rss"] for r in rows),
              "first_rss": rows[0]["rss"], "peak_memfd": max(r["memfd"] for r in rows),
              "rows": rows}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    assert final.get("in_use", 0) == 0, "KV bytes still in use after the soak"
    assert final["memfd"] <= parse_size(args.max_idle_memory) + (64 << 10)
    save(result, args.json, args.plot, plot)


if __name__ == "__main__":
    main()
