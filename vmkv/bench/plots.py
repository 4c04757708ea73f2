"""PNG figures of benchmark results (matplotlib, Agg backend, imported only when asked for)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

MODE_COLORS = {"virtual": "tab:blue", "paged": "tab:orange", "virtual+prefix": "tab:green",
               "paged+prefix": "tab:red", "virtual+json": "tab:purple", "paged+json": "tab:brown",
               "virtual+sampled": "tab:olive", "paged+sampled": "tab:cyan"}


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (imported on first use)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: str | os.PathLike[str]) -> None:
    """Lay out, write ``fig`` as a PNG at ``path`` (parents created) and close it."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    pyplot().close(fig)


def throughput(result: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Output tokens/s per mode per repetition, and KV memory in use over the last run."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    runs = result["runs"]
    for mode in dict.fromkeys(r["mode"] for r in runs):
        mine = [r for r in runs if r["mode"] == mode]
        ax1.plot([r["repeat"] for r in mine], [r["output_tokens_per_s"] for r in mine], "o-",
                 label=mode, color=MODE_COLORS.get(mode))
        last = mine[-1]["trace"]
        ax2.plot(last["t"], np.array(last["bytes_in_use"]) / 2**20, label=f"{mode} in use",
                 color=MODE_COLORS.get(mode))
        ax2.plot(last["t"], np.array(last["token_bytes"]) / 2**20, ":",
                 label=f"{mode} tokens", color=MODE_COLORS.get(mode))
    if result.get("hf"):
        ax1.axhline(result["hf"]["output_tokens_per_s"], color="gray", ls="--", label="hf")
    ax1.set(xlabel="repetition", ylabel="output tokens/s", title="throughput")
    ax1.set_xticks(sorted({r["repeat"] for r in runs}))
    ax1.set_ylim(bottom=0)
    ax1.legend()
    ax2.set(xlabel="s (last repetition)", ylabel="KV MiB", title="KV memory")
    ax2.legend(fontsize="small")
    save(fig, path)


def serve(result: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """CDFs of TTFT, TPOT, ITL and E2E latency, one line per request rate."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(13, 3.2))
    names = (("ttfts", "TTFT"), ("tpots", "TPOT"), ("itls", "ITL"), ("e2els", "E2E latency"))
    for run in result["runs"]:
        for ax, (key, title) in zip(axes, names, strict=True):
            values = np.sort(np.array(run["samples"][key]) * 1e3)
            if len(values):
                ax.plot(values, np.arange(1, len(values) + 1) / len(values),
                        label=f"rate {run['request_rate']}")
            ax.set(title=title, xlabel="ms")
    axes[0].set_ylabel("fraction of requests")
    axes[0].legend(fontsize="small")
    save(fig, path)


def kernels(result: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Time per layer against context length, one line per batch size and mode."""
    plt = pyplot()
    from matplotlib import ticker

    groups = sorted({(r["device"], r["phase"], r.get("kv_dtype", "")) for r in result["rows"]})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 3.4), squeeze=False)
    for ax, (device, phase, kv_dtype) in zip(axes[0], groups, strict=True):
        rows = [r for r in result["rows"] if r["device"] == device and r["phase"] == phase
                and r.get("kv_dtype", "") == kv_dtype]
        styles = {"virtual": "-", "paged": "--", "identity": "-.", "shuffled": "--"}
        for i, batch in enumerate(sorted({r["batch"] for r in rows})):
            mine = sorted((r for r in rows if r["batch"] == batch), key=lambda r: r["context"])
            for key in [k for k in styles if f"{k}_ms" in mine[0]]:
                ax.plot([r["context"] for r in mine], [r[f"{key}_ms"] for r in mine],
                        styles[key], marker="o", color=f"C{i}", label=f"B={batch} {key}")
        ax.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="ms per layer",
               title=f"{device} {phase} {kv_dtype}".strip())
        contexts = sorted({r["context"] for r in rows})
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.legend(fontsize="x-small")
    save(fig, path)


def profile(result: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Per phase, the step split into its parts (stacked), beside the parts' rooflines."""
    from vmkv.bench.profile import PARTS

    plt = pyplot()
    phases = result["phases"]
    fig, axes = plt.subplots(1, len(phases), figsize=(5 * len(phases), 3.8))
    colors = plt.get_cmap("tab10").colors
    for ax, phase in zip(np.atleast_1d(axes), phases, strict=True):
        for x, key in ((0, None), (1, "roofline_ms")):
            bottom = 0.0
            for i, part in enumerate(PARTS):
                value = phase[part] if key is None else phase[key][part]
                ax.bar(x, value, bottom=bottom, color=colors[i], label=part if x == 0 else None)
                bottom += value
        ax.set_xticks([0, 1], ["measured", "roofline"])
        ax.set(ylabel="ms per step",
               title=f"{phase['phase']}: {phase['new_tokens']} new tokens, "
                     f"{phase['output_tokens_per_s']:.0f} out tok/s")
        ax.legend(fontsize="small")
    save(fig, path)
