"""The input-grounded workload (speculative decoding's honest test): tasks whose answer quotes
the prompt, built from this project's own source files and docs, seeded.

    rename   "Rewrite this function with the variable X renamed to Y": a function of vmkv/
    typo     "Copy this paragraph and fix the typo": a paragraph of docs/, two letters swapped
    quote    "Quote the lines that mention X": a stretch of a source file, X in a few lines

Each task's output length is the reference answer's token count plus a little (the model's
answer may run a bit longer), capped by ``max_output``. Prompts go through the model's chat
template when it has one (an instruct model answers instead of continuing the text).
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Callable
from pathlib import Path

from vmkv.chat_template import chat_token_ids

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("rename", "typo", "quote")


def _functions(rng: random.Random) -> list[str]:
    """Source of vmkv's functions of 8-30 lines that assign a local variable."""
    found = []
    for path in sorted((ROOT / "vmkv").rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and 8 <= node.end_lineno - node.lineno <= 30:
                found.append("\n".join(lines[node.lineno - 1 : node.end_lineno]))
    rng.shuffle(found)
    return found


def _rename(source: str, rng: random.Random) -> tuple[str, str] | None:
    names = sorted(set(re.findall(r"^\s+([a-z_][a-z0-9_]{2,})\s*=[^=]", source, re.M)))
    if not names:
        return None
    old = rng.choice(names)
    new = f"renamed_{old}"
    answer = re.sub(rf"\b{old}\b", new, source)
    return (f"Rewrite this Python function with the variable `{old}` renamed to `{new}`. "
            f"Reply with the code only.\n\n{source}\n", answer)


def _paragraphs(rng: random.Random) -> list[str]:
    found = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        for para in path.read_text().split("\n\n"):
            if 300 <= len(para) <= 900 and not para.lstrip().startswith(("|", "```", "#")):
                found.append(para.strip())
    rng.shuffle(found)
    return found


def _typo(para: str, rng: random.Random) -> tuple[str, str] | None:
    words = [m for m in re.finditer(r"\b[a-z]{6,}\b", para)]
    if not words:
        return None
    w = rng.choice(words)
    i = rng.randrange(1, len(w.group()) - 2)
    word = w.group()
    typo = word[:i] + word[i + 1] + word[i] + word[i + 2 :]
    text = para[: w.start()] + typo + para[w.end() :]
    return (f"Copy this paragraph exactly, fixing the one typo in it. Reply with the paragraph "
            f"only.\n\n{text}\n", para)


def _quote(rng: random.Random) -> tuple[str, str] | None:
    paths = sorted((ROOT / "vmkv").rglob("*.py"))
    lines = rng.choice(paths).read_text().splitlines()
    if len(lines) < 40:
        return None
    start = rng.randrange(0, len(lines) - 39)  # a 40-line file: its one chunk
    chunk = lines[start : start + 40]
    words = [w for w in set(re.findall(r"\b[a-z_]{5,}\b", "\n".join(chunk)))
             if 2 <= sum(w in line for line in chunk) <= 5]
    if not words:
        return None
    word = rng.choice(sorted(words))
    quoted = "\n".join(line for line in chunk if word in line)
    body = "\n".join(chunk)
    return (f"Quote, exactly and in order, the lines of this file that mention `{word}`. Reply "
            f"with those lines only.\n\n{body}\n", quoted)


def grounded_workload(n: int, encode_chat: Callable[[str], list[int]],
                      encode: Callable[[str], list[int]], *, seed: int = 0,
                      max_output: int = 384) -> list[tuple[str, list[int], int]]:
    """``n`` tasks, the kinds in turn: ``(kind, prompt ids, output length)`` each."""
    rng = random.Random(seed)
    functions, paragraphs = _functions(rng), _paragraphs(rng)
    out: list[tuple[str, list[int], int]] = []
    while len(out) < n:
        kind = KINDS[len(out) % len(KINDS)]
        task = (_rename(functions.pop(), rng) if kind == "rename"
                else _typo(paragraphs.pop(), rng) if kind == "typo" else _quote(rng))
        if task is None:
            continue
        prompt, answer = task
        output_len = min(max_output, len(encode(answer)) + 8)
        out.append((kind, encode_chat(prompt), output_len))
    return out


def chat_encoder(tokenizer: object) -> Callable[[str], list[int]]:
    """Text -> the ids of a one-turn chat asking it (plain ids without a chat template)."""
    if getattr(tokenizer, "chat_template", None):
        return lambda text: chat_token_ids(tokenizer, [{"role": "user", "content": text}])
    return lambda text: tokenizer(text).input_ids  # type: ignore[operator]


def repeated_ngram_share(outputs: list[list[int]], accepted: list[list[int]], n: int = 4
                         ) -> float:
    """Of the accepted proposals (output positions, per output), the share inside an
    ``n``-gram that occurs twice or more in that output itself (a model repeating itself)."""
    inside = total = 0
    for tokens, positions in zip(outputs, accepted, strict=True):
        grams: dict[tuple[int, ...], int] = {}
        for i in range(len(tokens) - n + 1):
            key = tuple(tokens[i : i + n])
            grams[key] = grams.get(key, 0) + 1
        covered = set()
        for i in range(len(tokens) - n + 1):
            if grams[tuple(tokens[i : i + n])] > 1:
                covered.update(range(i, i + n))
        inside += sum(p in covered for p in positions)
        total += len(positions)
    return inside / total if total else 0.0
