"""Run a native llama.cpp server (``llama_cpp.sh``) on a vmkv workload file: every request at
once over ``--parallel N --cont-batching`` slots; print one ``PEER_RESULT {json}`` line.

Usage: python llama_cpp_offline.py LLAMA_BIN_DIR MODEL.gguf WORKLOAD.jsonl --threads 2
           [--parallel 64] [--ctx-per-slot 1024] [--warmup 8]

``MODEL.gguf`` is the default model's own file (vmkv's ``--quantization gguf`` serves the same
bytes). Requests are token ids, greedy (``top_k`` 1), ``ignore_eos``, ``n_predict = output_len``,
no prompt cache, sent from one thread each at once (llama-server queues what its slots cannot
take); the timed batch's wall time is from the first send to the last reply. The first
``--warmup`` requests run once before it. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from peer_result import exactness, print_result, read_workload


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def complete(base: str, prompt: list[int], output_len: int) -> int:
    """One request; the number of tokens it produced."""
    body = {"prompt": prompt, "n_predict": output_len, "ignore_eos": True, "temperature": 0.0,
            "top_k": 1, "cache_prompt": False}
    req = urllib.request.Request(f"{base}/completion", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return int(json.loads(r.read())["timings"]["predicted_n"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bin")
    ap.add_argument("model")
    ap.add_argument("workload")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--parallel", type=int, default=64)
    ap.add_argument("--ctx-per-slot", type=int, default=0,
                    help="context per slot (default: the workload's longest request)")
    ap.add_argument("--warmup", type=int, default=8)
    args = ap.parse_args()
    rows = read_workload(args.workload)
    per_slot = args.ctx_per_slot or max(len(r["prompt"]) + r["output_len"] for r in rows) + 8
    port = free_port()
    cmd = [str(Path(args.bin) / "llama-server"), "-m", args.model, "-t", str(args.threads),
           "-tb", str(args.threads), "--parallel", str(args.parallel), "--cont-batching",
           "-c", str(per_slot * args.parallel), "--port", str(port), "--host", "127.0.0.1"]
    started = time.monotonic()
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                if server.poll() is not None:
                    raise SystemExit(f"llama-server exited {server.returncode}") from None
                time.sleep(0.1)
        init_s = time.monotonic() - started
        with ThreadPoolExecutor(max_workers=len(rows)) as pool:
            if args.warmup:
                list(pool.map(lambda r: complete(base, r["prompt"], r["output_len"]),
                              rows[: args.warmup]))
            start = time.monotonic()
            lengths = list(pool.map(lambda r: complete(base, r["prompt"], r["output_len"]),
                                    rows))
            generate_s = time.monotonic() - start
    finally:
        server.terminate()
        server.wait(timeout=60)
    print_result({"engine_init_s": init_s, "generate_s": generate_s, **exactness(rows, lengths),
                  "settings": {"command": cmd}, "versions": {"llama.cpp": str(args.bin)}})


if __name__ == "__main__":
    main()
