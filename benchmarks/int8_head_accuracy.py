"""Top-1 agreement and perplexity of the int8 LM head against the dense head, on real text.

The int8 head is ``--lm-head-dtype int8``.

transformers gives the model's final hidden states (bfloat16) for teacher-forced chunks of the
project's own docs; vmkv's kernel (``vmkv.kernels.cpu_int8_head``) turns them into logits twice,
its int8 products alone and rescored (what the engine serves), and both are compared with the
dense head (float32 sums of the bf16 products): the share of positions whose top-1 token is
the dense head's, and the perplexity of the text's tokens.

    python benchmarks/int8_head_accuracy.py --model gemma-3-270m \
        --out docs/results/quant/int8-head-accuracy-gemma3.json
"""

from __future__ import annotations

import argparse
import json
import math
from datetime import date
from pathlib import Path

import torch

from vmkv.kernels import cpu_int8_head
from vmkv.models import resolve_model
from vmkv.models.quant.int8_head import Int8Head

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ("docs/ARCHITECTURE.md", "docs/models.md")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model name or folder (default: the default)")
    ap.add_argument("--positions", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    text = "\n\n".join((ROOT / t).read_text() for t in TEXTS)
    ids = tok(text, return_tensors="pt").input_ids[0][: args.positions + 1]
    weight = model.get_output_embeddings().weight.detach()  # [V, K] bf16
    head = Int8Head(weight)
    agree = {"int8_only": 0, "rescored": 0}
    logprob = {"dense": 0.0, "int8_only": 0.0, "rescored": 0.0}
    n = 0
    with torch.inference_mode():
        for i in range(0, len(ids) - 1, args.chunk):
            chunk = ids[i : i + args.chunk + 1]
            hidden = model.model(chunk[:-1][None]).last_hidden_state[0].contiguous()  # [T, K]
            target = chunk[1:, None]  # [T, 1]
            logits = {"dense": hidden.float() @ weight.float().t(),  # [T, V]
                      "int8_only": torch.empty(len(hidden), weight.shape[0]),
                      "rescored": head(hidden)}
            cpu_int8_head.head(hidden, head._args, logits["int8_only"], 0)
            best = logits["dense"].argmax(dim=1)
            for name, lg in logits.items():
                logprob[name] += torch.log_softmax(lg, dim=1).gather(1, target).sum().item()
                if name != "dense":
                    agree[name] += (lg.argmax(dim=1) == best).sum().item()
            n += len(target)
    result = {"what": __doc__.splitlines()[0], "date": date.today().isoformat(),
              "model": str(path), "texts": TEXTS, "positions": n,
              **{f"agreement_{k}": v / n for k, v in agree.items()},
              **{f"ppl_{k}": math.exp(-v / n) for k, v in logprob.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
