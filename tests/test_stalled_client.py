"""A streaming client that stops reading costs a real ``vmkv serve`` process little memory, and
its request is aborted when the client goes (the real openai client, on 127.0.0.1).

Before outputs were deltas, every step queued a copy of each sample's whole text and tokens
for a client that no longer read them. That only begins once the kernel's socket buffers are
full (up to ~4 MiB of SSE chunks on loopback), so the stream is wide (n=16) and its chunks big
(20 top logprobs per token): the buffers fill within ~300 tokens. Measured on a 2-core EPYC, heap
growth at 700 tokens per sample: 103.5 MiB before deltas (4dea21a~1), 27.5 MiB after. Now a
stream merges what its reader has not taken into one pending delta.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from vmkv.bench.launch import LaunchedServer

pytestmark = pytest.mark.usefixtures("default_model")
N, MAX_TOKENS = 16, 4096
STALLED_TOKENS = 700  # per sample, generated while the client reads nothing
MAX_GROWTH = 56 << 20
FULL_SEND_QUEUE = 1 << 20  # the server's socket holds at least this much unread data


def heap_bytes(pid: int) -> int:
    """The process's anonymous resident memory (Python's heap; the KV cache lives in shared
    memfd pages, accounted by the KV metrics, not here)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/<pid>/status")


def send_queue_bytes(port: int) -> int:
    """Bytes queued in the kernel for the client on the server's listening port (the largest
    ``tx_queue`` of a socket bound to it in /proc/net/tcp)."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.read().splitlines()[1:]]
    return max((int(row[4].split(":")[0], 16) for row in rows
                if int(row[1].split(":")[1], 16) == port), default=0)


def engine_numbers(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            reason = sample.labels.get("finished_reason")
            values[sample.name + (f"{{{reason}}}" if reason else "")] = sample.value
    return values


def wait_for(url: str, done: str, check: Callable[[dict[str, float]], bool],
             timeout: float = 900) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while not check(numbers := engine_numbers(url)):
        assert time.monotonic() < deadline, f"timed out waiting until {done}: {numbers}"
        time.sleep(0.5)
    return numbers


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc (Linux)")
def test_a_stalled_stream_costs_little_memory_and_is_aborted_when_its_client_goes() -> None:
    with LaunchedServer(["--max-model-len", str(MAX_TOKENS + 64), "--max-num-seqs", str(N),
                         "--served-model-name", "smol"]) as srv:
        url = srv.base_url
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                               timeout=900)
        stream = client.completions.create(
            model="smol", prompt="Tell me a very long story about a dragon:", n=N,
            max_tokens=MAX_TOKENS, stream=True, seed=0, logprobs=20,  # big chunks: the socket
            extra_body={"ignore_eos": True})  # buffers (~4 MiB) fill within ~300 steps
        chunks = iter(stream)
        for _ in range(2 * N):  # it streams...
            assert next(chunks).choices
        before = heap_bytes(srv.proc.pid)
        # ... then the client stops reading while the engine writes on
        stalled = wait_for(url, f"{STALLED_TOKENS} tokens per sample", lambda m: m[
            "vllm:generation_tokens_total"] >= N * STALLED_TOKENS)
        grown = heap_bytes(srv.proc.pid) - before
        # the server could write no more: otherwise the heap had nothing to hold
        assert send_queue_bytes(srv.port) >= FULL_SEND_QUEUE
        stream.close()  # the client goes
        after = wait_for(url, "the request ended", lambda m: m["vllm:num_requests_running"] == 0)
        assert after["vllm:request_success_total{abort}"] == N  # every sample aborted ...
        assert after["vllm:generation_tokens_total"] < N * MAX_TOKENS  # ... before its end
        assert after["vmkv:kv_physical_bytes_in_use"] == 0
        assert stalled["vllm:num_requests_running"] == N
        assert grown < MAX_GROWTH, f"the server's heap grew {grown / 2**20:.0f} MiB"
