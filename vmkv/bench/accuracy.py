"""``vmkv bench accuracy``: teacher-forced agreement and perplexity of weight formats and KV
cache dtypes, through the engine itself.

    text (the project's own docs by default) -> tokens -> chunks of --chunk tokens
    each variant (quantization:dtype[:kv_cache_dtype], e.g. gguf:float32 or none:bfloat16:int8;
    --kv-cache-dtype int8 scores the reference's weights with that KV) scores every chunk with
    prompt_logprobs=1: per position its top-1 token and the text's next token's logprob
    against the reference variant (default none:float32, the dequantized float32 model):
        agreement   share of positions whose top-1 token is the reference's
        perplexity  exp(-mean logprob of the text's tokens), and its ratio to the reference's

Every position of a chunk but its first is scored (the first has no context in the chunk).
The JSON holds each variant's numbers, the positions, the text's source and the environment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: the project's own prose, read when no --text is given (>= 2,000 tokens of the default model)
DEFAULT_TEXTS = ("docs/ARCHITECTURE.md", "docs/models.md")
COLUMNS = ("variant", "positions", "agreement", "perplexity", "ppl_ratio", "weights")


@dataclass(frozen=True)
class Scores:
    """One variant's teacher-forced results: per scored position its top-1 token and the
    logprob of the text's token there."""

    top1: list[int]
    logprobs: list[float]
    weights: str

    @property
    def perplexity(self) -> float:
        return math.exp(-sum(self.logprobs) / len(self.logprobs))


def parse_variant(text: str) -> tuple[str, str, str]:
    """``quantization[:dtype[:kv_cache_dtype]]`` (float32, auto by default) -> the triple;
    ValueError otherwise."""
    from vmkv.config import DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS

    quant, _, rest = text.partition(":")
    dtype, _, kv = rest.partition(":")
    dtype, kv = dtype or "float32", kv or "auto"
    if quant not in QUANTIZATIONS or dtype not in DTYPES or kv not in KV_CACHE_DTYPES:
        raise ValueError(f"a variant is quantization[:dtype[:kv_cache_dtype]] with quantization "
                         f"in {QUANTIZATIONS}, dtype in {DTYPES} and kv_cache_dtype in "
                         f"{KV_CACHE_DTYPES}, got {text!r}")
    return quant, dtype, kv


def text_tokens(tokenizer: Any, files: list[str] | None, root: Path) -> tuple[list[int], str]:
    """The token ids of ``files`` (default: :data:`DEFAULT_TEXTS` under ``root``) and a label."""
    paths = [Path(f) for f in files] if files else [root / f for f in DEFAULT_TEXTS]
    text = "\n\n".join(p.read_text() for p in paths)
    return tokenizer(text)["input_ids"], ", ".join(p.name for p in paths)


def score(options: dict[str, Any], chunks: list[list[int]]) -> Scores:
    """Score ``chunks`` with an engine built from ``options`` (LLM keyword arguments)."""
    from vmkv.llm import LLM
    from vmkv.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    top1: list[int] = []
    logprobs: list[float] = []
    with LLM(**options) as llm:
        weights = next((line for line in llm.engine.executor.describe()
                        if line.startswith("weights: ")), "")
        outputs = llm.generate([list(c) for c in chunks], params, use_tqdm=False)
        for chunk, out in zip(chunks, outputs, strict=True):
            for token, scored in zip(chunk[1:], (out.prompt_logprobs or [])[1:], strict=True):
                assert scored is not None and token in scored
                top1.append(max(scored, key=scored.__getitem__))
                logprobs.append(scored[token])
    return Scores(top1, logprobs, weights)


def run(variants: list[str], reference: str, *, model: str | None = None,
        texts: list[str] | None = None, positions: int = 2000, chunk: int = 512,
        kv_mode: str = "virtual") -> dict[str, Any]:
    """Each of ``variants`` against ``reference`` over ``positions`` teacher-forced positions
    of real text (see the module docstring)."""
    from vmkv.models import load_tokenizer, resolve_model

    path = resolve_model(model, progress=False)
    ids, source = text_tokens(load_tokenizer(path), texts, Path(__file__).resolve().parents[2])
    per_chunk = chunk - 1
    need = -(-positions // per_chunk) * chunk
    if len(ids) < need:
        raise ValueError(f"the text has {len(ids)} tokens; {positions} positions in chunks of "
                         f"{chunk} need {need} (add --text files)")
    chunks = [ids[i : i + chunk] for i in range(0, need, chunk)]
    common = dict(model=model, kv_mode=kv_mode, max_model_len=max(chunk + 1, 1024),
                  max_num_batched_tokens=max(chunk, 2048), enable_prefix_caching=False)
    results = {}
    for variant in dict.fromkeys([reference, *variants]):
        quant, dtype, kv = parse_variant(variant)
        results[variant] = score({**common, "quantization": quant, "dtype": dtype,
                                  "kv_cache_dtype": kv}, chunks)
    ref = results[reference]
    rows = []
    for variant, s in results.items():
        agree = sum(a == b for a, b in zip(s.top1, ref.top1, strict=True)) / len(s.top1)
        rows.append({"variant": variant, "positions": len(s.top1), "agreement": agree,
                     "perplexity": s.perplexity, "ppl_ratio": s.perplexity / ref.perplexity,
                     "weights": s.weights})
    return {"reference": reference, "text": source, "chunk": chunk, "kv_mode": kv_mode,
            "rows": rows}
