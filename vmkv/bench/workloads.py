"""Benchmark workloads: seeded, reproducible lists of ``(prompt_token_ids, output_len)``.

Prompts are random token ids drawn uniformly from the vocabulary without its special tokens
(no text, no tokenizer round trip), so every engine fed the same list does the same work; the
benches run every request greedily with ``ignore_eos=True`` and exactly ``output_len`` tokens.

    random          input and output lengths uniform in [lo, hi] (nano-vllm's bench: 100:1024)
    sharegpt-like   lognormal lengths with ShareGPT's published means (161.31 in / 337.99 out)
    alpaca-like     lognormal lengths with Alpaca's published means (19.31 in / 58.45 out)
    long-context    prompts of 2000-4000 tokens, 256-512 output tokens (decode over long KV)
    shared-prefix   one common prefix (default 512 tokens) + a unique suffix per request
    input-grounded  chat tasks that quote their prompt (renames, typo fixes, quotes of this
                    project's files: vmkv/bench/grounded.py), for speculative decoding
    jsonl           ``{"prompt": str | list[int], "output_len": int}`` per line

The lognormal lengths are stratified (one draw in each of the ``n`` equal-probability bins,
then shuffled), clipped to ``[4, max]`` and scaled so the sample mean equals the published one:
a few hundred requests match the means to well under 1% instead of the ~8% a plain draw
wanders (sigma 1 has a coefficient of variation of 1.3).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Any, NamedTuple

import numpy as np

WORKLOADS = ("random", "sharegpt-like", "alpaca-like", "long-context", "shared-prefix", "jsonl",
             "input-grounded")
Range = tuple[int, int]


class BenchRequest(NamedTuple):
    """One request of a workload: the prompt's token ids and the exact output length."""

    prompt_token_ids: list[int]
    output_len: int


@dataclass(frozen=True)
class LengthModel:
    """A lognormal length distribution with a target mean, clipped to ``[lo, hi]``."""

    mean: float
    sigma: float
    lo: int
    hi: int


#: published means (PagedAttention paper, §6.1); sigmas and caps are vmkv's choice (see docs)
SHAREGPT = (LengthModel(161.31, 1.0, 4, 1024), LengthModel(337.99, 0.9, 4, 1024))
ALPACA = (LengthModel(19.31, 0.6, 4, 256), LengthModel(58.45, 0.9, 4, 512))
#: per-workload defaults for --input-len / --output-len
DEFAULT_LENS: dict[str, tuple[Range, Range]] = {
    "random": ((100, 1024), (100, 1024)),
    "long-context": ((2000, 4000), (256, 512)),
    "shared-prefix": ((32, 128), (32, 128)),  # input: the unique suffix
}
DEFAULT_PREFIX_LEN = 512
#: (prompt length range, output length range) of the three mixes of the peer comparison
#: (benchmarks/peers/best_peers.py) and of ``vmkv bench study``, inclusive, random token ids
MIXES: dict[str, tuple[Range, Range]] = {
    "prompt-heavy": ((256, 1024), (32, 128)),
    "balanced": ((32, 256), (32, 256)),
    "decode-heavy": ((32, 128), (256, 1024)),
}


def parse_range(text: str) -> Range:
    """``"100:1024"`` -> (100, 1024); ``"128"`` -> (128, 128). ValueError when malformed."""
    parts = text.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (None, None)
    except ValueError:
        lo = hi = None
    if lo is None or hi is None or lo <= 0 or hi < lo:
        raise ValueError(f"expected a length N or a range LO:HI with 0 < LO <= HI, got {text!r}")
    return lo, hi


def allowed_token_ids(vocab_size: int, special_ids: Iterable[int] = ()) -> np.ndarray:
    """Token ids prompts may use: the vocabulary without ``special_ids``."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    ids = np.setdiff1d(np.arange(vocab_size), np.fromiter(special_ids, dtype=np.int64))
    if not len(ids):
        raise ValueError("every token id is special: nothing left for prompts")
    return ids


def special_token_ids(tokenizer: Any) -> list[int]:
    """Special and added tokens of an HF tokenizer (chat markers, EOS, padding...)."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return sorted(ids)


def _tokens(rng: np.random.Generator, vocab: np.ndarray, n: int) -> list[int]:
    return vocab[rng.integers(0, len(vocab), n)].tolist()


def _uniform(rng: np.random.Generator, n: int, r: Range) -> np.ndarray:
    return rng.integers(r[0], r[1] + 1, n)


def lognormal_lengths(rng: np.random.Generator, n: int, model: LengthModel) -> np.ndarray:
    """``n`` stratified lognormal lengths whose sample mean is ``model.mean`` (see module doc)."""
    normal = NormalDist()
    u = (np.arange(n) + rng.random(n)) / n  # one uniform draw per equal-probability bin
    z = np.array([normal.inv_cdf(min(max(x, 1e-12), 1 - 1e-12)) for x in u])
    raw = np.exp(math.log(model.mean) - model.sigma**2 / 2 + model.sigma * z)
    scale, lengths = 1.0, raw
    for _ in range(50):  # clipping and rounding move the mean: rescale until it holds
        lengths = np.clip(np.rint(raw * scale), model.lo, model.hi).astype(np.int64)
        m = lengths.mean()
        if abs(m / model.mean - 1) < 1e-3:
            break
        scale *= model.mean / m
    return rng.permutation(lengths)


def _from_lengths(rng: np.random.Generator, vocab: np.ndarray, inputs: Sequence[int],
                  outputs: Sequence[int]) -> list[BenchRequest]:
    return [BenchRequest(_tokens(rng, vocab, int(i)), int(o))
            for i, o in zip(inputs, outputs, strict=True)]


def random_workload(n: int, vocab: np.ndarray, *, input_len: Range, output_len: Range,
                    seed: int = 0) -> list[BenchRequest]:
    """Uniform input and output lengths in the given inclusive ranges."""
    rng = np.random.default_rng(seed)
    return _from_lengths(rng, vocab, _uniform(rng, n, input_len), _uniform(rng, n, output_len))


def lognormal_workload(n: int, vocab: np.ndarray, models: tuple[LengthModel, LengthModel], *,
                       seed: int = 0) -> list[BenchRequest]:
    """Input and output lengths from two independent :func:`lognormal_lengths` models."""
    rng = np.random.default_rng(seed)
    inputs = lognormal_lengths(rng, n, models[0])
    outputs = lognormal_lengths(rng, n, models[1])
    return _from_lengths(rng, vocab, inputs, outputs)


def shared_prefix_workload(n: int, vocab: np.ndarray, *, prefix_len: int, suffix_len: Range,
                           output_len: Range, seed: int = 0) -> list[BenchRequest]:
    """Every prompt is the same ``prefix_len`` tokens followed by a unique random suffix."""
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
    rng = np.random.default_rng(seed)
    prefix = _tokens(rng, vocab, prefix_len)
    suffixes = _uniform(rng, n, suffix_len)
    outputs = _uniform(rng, n, output_len)
    return [BenchRequest(prefix + _tokens(rng, vocab, int(s)), int(o))
            for s, o in zip(suffixes, outputs, strict=True)]


def load_jsonl(path: str | os.PathLike[str], encode: Callable[[str], list[int]] | None = None
               ) -> list[BenchRequest]:
    """Read ``{"prompt": str | list[int], "output_len": int}`` lines (text needs ``encode``)."""
    requests = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt, output_len = row["prompt"], row["output_len"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: expected {{\"prompt\", \"output_len\"}}: "
                                 f"{exc}") from None
            if isinstance(prompt, str):
                if encode is None:
                    raise ValueError(f"{path}:{lineno}: a text prompt needs a tokenizer")
                prompt = list(encode(prompt))
            if (not isinstance(prompt, list) or not prompt
                    or not all(isinstance(t, int) for t in prompt)):
                raise ValueError(f"{path}:{lineno}: prompt must be text or a non-empty list of "
                                 "token ids")
            if not isinstance(output_len, int) or output_len <= 0:
                raise ValueError(f"{path}:{lineno}: output_len must be a positive int, "
                                 f"got {output_len!r}")
            requests.append(BenchRequest(prompt, output_len))
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests


def save_jsonl(requests: Sequence[BenchRequest], path: str | os.PathLike[str]) -> None:
    """Write ``requests`` as jsonl (token-id prompts) for :func:`load_jsonl` or other engines."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps({"prompt": r.prompt_token_ids, "output_len": r.output_len}) + "\n")


@dataclass(frozen=True)
class WorkloadSpec:
    """What ``--workload`` and its options ask for (None lengths take the workload's default)."""

    name: str = "random"
    num_prompts: int = 64
    input_len: Range | None = None
    output_len: Range | None = None
    prefix_len: int = DEFAULT_PREFIX_LEN
    path: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.name!r}")
        if self.num_prompts <= 0:
            raise ValueError(f"num_prompts must be positive, got {self.num_prompts}")
        if self.name == "jsonl" and not self.path:
            raise ValueError("the jsonl workload needs a file (--jsonl PATH)")


def build(spec: WorkloadSpec, vocab_size: int, special_ids: Iterable[int] = (),
          encode: Callable[[str], list[int]] | None = None) -> list[BenchRequest]:
    """The requests ``spec`` describes, for a model with ``vocab_size`` tokens."""
    if spec.name == "jsonl":
        return load_jsonl(spec.path, encode)[: spec.num_prompts]
    if spec.name == "input-grounded":
        raise ValueError("the input-grounded workload is text: build it with for_tokenizer")
    vocab = allowed_token_ids(vocab_size, special_ids)
    n, seed = spec.num_prompts, spec.seed
    if spec.name in ("sharegpt-like", "alpaca-like"):
        if spec.input_len or spec.output_len:
            raise ValueError(f"{spec.name} has fixed length distributions; --input-len and "
                             "--output-len apply to random, long-context and shared-prefix")
        return lognormal_workload(n, vocab, SHAREGPT if spec.name == "sharegpt-like" else ALPACA,
                                  seed=seed)
    default_in, default_out = DEFAULT_LENS[spec.name]
    input_len, output_len = spec.input_len or default_in, spec.output_len or default_out
    if spec.name == "shared-prefix":
        return shared_prefix_workload(n, vocab, prefix_len=spec.prefix_len,
                                      suffix_len=input_len, output_len=output_len, seed=seed)
    return random_workload(n, vocab, input_len=input_len, output_len=output_len, seed=seed)


def describe(requests: Sequence[BenchRequest]) -> dict[str, Any]:
    """Counts and length statistics of a workload (recorded with every result)."""
    ins = np.array([len(r.prompt_token_ids) for r in requests])
    outs = np.array([r.output_len for r in requests])
    return {
        "num_requests": len(requests),
        "input_tokens": int(ins.sum()),
        "output_tokens": int(outs.sum()),
        "input_len": {"mean": float(ins.mean()), "min": int(ins.min()), "max": int(ins.max())},
        "output_len": {"mean": float(outs.mean()), "min": int(outs.min()), "max": int(outs.max())},
    }


def for_tokenizer(spec: WorkloadSpec, tokenizer: Any, vocab_size: int | None = None
                  ) -> list[BenchRequest]:
    """:func:`build` for a model with this HF tokenizer (its specials excluded from prompts)."""
    size = vocab_size or len(tokenizer)
    if spec.name == "input-grounded":
        from vmkv.bench.grounded import chat_encoder, grounded_workload

        tasks = grounded_workload(spec.num_prompts, chat_encoder(tokenizer),
                                  lambda text: tokenizer(text).input_ids, seed=spec.seed)
        return [BenchRequest(ids, n) for _, ids, n in tasks]
    return build(spec, size, special_token_ids(tokenizer),
                 encode=lambda text: tokenizer(text).input_ids)


def add_workload_args(p: Any, *, default: str = "random", num_prompts: int = 64) -> None:
    """The ``--workload`` options shared by ``bench throughput`` and ``bench serve``."""
    p.add_argument("--workload", choices=WORKLOADS, default=default)
    p.add_argument("--num-prompts", type=int, default=num_prompts)
    p.add_argument("--input-len", type=_range_arg, default=None,
                   help="N or LO:HI (random, long-context; shared-prefix: the suffix)")
    p.add_argument("--output-len", type=_range_arg, default=None, help="N or LO:HI")
    p.add_argument("--prefix-len", type=int, default=DEFAULT_PREFIX_LEN,
                   help="shared-prefix: tokens every prompt starts with")
    p.add_argument("--jsonl", default=None, metavar="PATH",
                   help='jsonl workload: {"prompt": str | [ids], "output_len": int} per line')


def spec_from_args(args: Any) -> WorkloadSpec:
    return WorkloadSpec(name=args.workload, num_prompts=args.num_prompts,
                        input_len=args.input_len, output_len=args.output_len,
                        prefix_len=args.prefix_len, path=args.jsonl, seed=args.seed)


def _range_arg(text: str) -> Range:
    import argparse

    try:
        return parse_range(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
