"""Hostile inputs and a SIGTERM against a real ``vmkv serve`` (not run in CI): each case's
answer, how long it took, and how late ``/health`` answered meanwhile; then 16 streams and a
SIGTERM, and how long the process took to exit. Run against this checkout and another one to
compare (docs/reliability.md):

    python benchmarks/abuse.py --json docs/results/abuse-after.json
    python benchmarks/abuse.py --cwd /path/to/main --sigterm-args --json abuse-before.json

``/health`` is polled every 10 ms over one kept-alive connection while a case runs (a blocked
event loop shows as one late answer as long as the block).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import threading
import time
from typing import Any

import httpx
from probe import save

from vmkv.bench.launch import LaunchedServer

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
LIMIT = 4 << 20
LARGEST = "Ab, " * (8192 * 81 // 4 - 1)  # the largest prompt the character limit lets through


def cases() -> dict[str, tuple[str, bytes, dict[str, str]]]:
    """name -> (path, body, headers)."""
    text = json.dumps({"prompt": "hello world " * (LIMIT // 12 - 10), "max_tokens": 2})
    return {
        "lone surrogate, completions": ("/v1/completions",
                                        b'{"prompt": "a\\ud800b", "max_tokens": 2}', AUTH),
        "lone surrogate, chat": ("/v1/chat/completions", b'{"messages": [{"role": "user", '
                                 b'"content": "a\\ud800b"}], "max_tokens": 2}', AUTH),
        "lone surrogate, tokenize": ("/tokenize", b'{"prompt": "a\\ud800b"}', AUTH),
        "4 MiB of text": ("/v1/completions", text.encode(), AUTH),
        "2M token ids": ("/v1/completions",
                         b'{"prompt": [' + b",".join([b"1"] * (LIMIT // 2 - 20)) + b"]}", AUTH),
        "1M one-token prompts": ("/v1/completions", b'{"prompt": [' + b",".join(
            [b"[1]"] * (LIMIT // 4 - 20)) + b"]}", AUTH),
        "largest tokenisable prompt": ("/tokenize", json.dumps({"prompt": LARGEST}).encode(),
                                       AUTH),
        "tokenize without the key": ("/tokenize", b'{"prompt": "hi"}',
                                     {"content-type": "application/json"}),
        "lower-case bearer": ("/tokenize", b'{"prompt": "hi"}',
                              {**AUTH, "Authorization": f"bearer {KEY}"}),
        "temperature 1e9": ("/v1/completions",
                            b'{"prompt": "x", "max_tokens": 2, "temperature": 1e9}', AUTH),
        "empty cache_salt": ("/v1/completions",
                             b'{"prompt": "x", "max_tokens": 2, "cache_salt": ""}', AUTH),
    }


def probe_case(url: str, path: str, body: bytes, headers: dict[str, str]) -> dict[str, Any]:
    result: dict[str, Any] = {}

    def send() -> None:
        started = time.monotonic()
        r = httpx.post(f"{url}{path}", content=body, headers=headers, timeout=300)
        result.update(status=r.status_code, seconds=round(time.monotonic() - started, 3),
                      answer=r.text[:160])

    sender = threading.Thread(target=send)
    health: list[float] = []
    with httpx.Client() as client:
        client.get(f"{url}/health")
        sender.start()
        while sender.is_alive():
            t = time.monotonic()
            client.get(f"{url}/health", timeout=300)
            health.append(time.monotonic() - t)
            time.sleep(0.01)
    sender.join()
    result.update(health_max_ms=round(max(health) * 1e3, 1),
                  health_median_ms=round(statistics.median(health) * 1e3, 1))
    return result


async def streams_then_sigterm(srv: LaunchedServer, cap: float) -> dict[str, Any]:
    url = srv.base_url
    ends: list[str] = []

    async def one(i: int, client: httpx.AsyncClient) -> None:
        body = {"prompt": f"Story {i}:", "max_tokens": 1500, "ignore_eos": True,
                "stream": True}
        last = "none"
        try:
            async with client.stream("POST", f"{url}/v1/completions", json=body,
                                     headers=AUTH) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        last = line if line == "data: [DONE]" else "chunk"
        except httpx.HTTPError as exc:
            last = f"cut ({type(exc).__name__})"
        ends.append(last)

    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [asyncio.create_task(one(i, client)) for i in range(16)]
        await asyncio.sleep(4)
        srv.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        while srv.proc.poll() is None and time.monotonic() - signalled < cap:
            await asyncio.sleep(0.1)
        exited = srv.proc.poll() is not None
        seconds = round(time.monotonic() - signalled, 1)
        if not exited:
            srv.proc.kill()
        await asyncio.gather(*tasks)
    return {"exited": exited, "seconds": seconds, "returncode": srv.proc.returncode,
            "stream_ends": {e: ends.count(e) for e in sorted(set(ends))}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cwd", help="run the server from this checkout")
    parser.add_argument("--sigterm-args", nargs="*", default=["--shutdown-timeout", "5"],
                        help="extra flags of the server that gets SIGTERM (none for a checkout "
                             "without --shutdown-timeout)")
    parser.add_argument("--cap", type=float, default=40.0,
                        help="seconds to wait for the exit before SIGKILL")
    parser.add_argument("--json")
    args = parser.parse_args()
    base = ["--api-key", KEY, "--max-num-seqs", "16"]
    result: dict[str, Any] = {"bench": "abuse", "options": vars(args), "cases": {}}
    with LaunchedServer(base, cwd=args.cwd) as srv:
        for name, (path, body, headers) in cases().items():
            result["cases"][name] = probe_case(srv.base_url, path, body, headers)
            print(f"{name}: {result['cases'][name]}")
        models = httpx.get(f"{srv.base_url}/v1/models", headers=AUTH).json()
        result["models_root"] = models["data"][0].get("root")
    with LaunchedServer(base + args.sigterm_args, cwd=args.cwd, stop_timeout=1) as srv:
        result["sigterm_16_streams"] = asyncio.run(streams_then_sigterm(srv, args.cap))
    print(json.dumps({k: v for k, v in result.items() if k != "cases"}, indent=1))
    save(result, args.json, None, lambda r, p: None)


if __name__ == "__main__":
    main()
