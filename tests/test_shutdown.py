"""Graceful shutdown of a real ``vmkv serve`` process: SIGTERM with 16 streams in flight drains
on ``--shutdown-timeout`` and exits 0; a second signal exits at once. Before the fix the process
waited for every stream (170 s with 16 streams), past any orchestrator's grace period."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from vmkv.bench.launch import LaunchedServer
from vmkv.server.shutdown import ABORT_GRACE

pytestmark = pytest.mark.usefixtures("default_model")
DEADLINE = 3.0


async def stream(url: str, client: httpx.AsyncClient, max_tokens: int,
                 started: asyncio.Event) -> list[dict | str]:
    """Every event of one streamed completion (``"[DONE]"`` as a string)."""
    body = {"prompt": "Tell me a long story:", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "temperature": 0}
    events: list[dict | str] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
                started.set()
    return events


def finish(events: list[dict | str]) -> tuple[str, str | None]:
    last = [e["choices"][0] for e in events if isinstance(e, dict) and e["choices"]][-1]
    return last["finish_reason"], last.get("stop_reason")


def test_sigterm_drains_on_the_deadline_then_exits_0() -> None:
    args = ["--max-model-len", "1024", "--max-num-seqs", "16", "--shutdown-timeout",
            str(DEADLINE)]
    with LaunchedServer(args) as srv:
        url = srv.base_url

        async def main() -> tuple[list, float, httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                flags = [asyncio.Event() for _ in range(16)]
                # 4 short requests finish within the deadline; 12 long ones cannot
                tasks = [asyncio.create_task(stream(url, client, 6 if i < 4 else 900, flags[i]))
                         for i in range(16)]
                await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flags)), 120)
                srv.proc.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                await asyncio.sleep(0.5)
                refused = await client.post(f"{url}/v1/completions", json={"prompt": "x"})
                health = await client.get(f"{url}/health")
                results = await asyncio.gather(*tasks)
                while srv.proc.poll() is None and time.monotonic() - signalled < 30:
                    await asyncio.sleep(0.05)
                return results, time.monotonic() - signalled, refused, health

        results, elapsed, refused, health = asyncio.run(main())
        log = srv.log_tail(60)
        assert srv.proc.returncode == 0, log
        # the contract: the deadline, then ABORT_GRACE for the last events, then the clean-up
        # (a generous 10 s margin: the assertion is about ending, not about speed)
        assert elapsed < DEADLINE + ABORT_GRACE + 10, f"exited {elapsed:.1f} s after SIGTERM"
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert health.status_code == 503 and "draining" in health.json()["error"]["message"]
    for i, events in enumerate(results):  # every client saw a clean end
        assert events[-1] == "[DONE]"
        assert finish(events) == (("length", None) if i < 4 else ("abort", "shutdown"))
    assert "aborted 12 requests" in log


def test_a_second_signal_exits_at_once() -> None:
    first, second = signal.SIGINT, signal.SIGTERM  # SIGINT drains too; either one ends it
    with LaunchedServer(["--max-model-len", "512", "--shutdown-timeout", "60"]) as srv:
        url = srv.base_url

        async def main() -> None:
            async with httpx.AsyncClient(timeout=60) as client:
                started = asyncio.Event()
                task = asyncio.create_task(stream(url, client, 400, started))
                await asyncio.wait_for(started.wait(), 60)
                srv.proc.send_signal(first)
                await asyncio.sleep(0.5)
                assert srv.proc.poll() is None  # draining: the stream still runs
                srv.proc.send_signal(second)
                signalled = time.monotonic()
                while srv.proc.poll() is None and time.monotonic() - signalled < 10:
                    await asyncio.sleep(0.02)
                assert srv.proc.poll() is not None  # at once: not after the 60 s drain
                with pytest.raises(httpx.HTTPError):
                    await task  # cut off: the process is gone

        asyncio.run(main())
        assert srv.proc.returncode == 128 + second
