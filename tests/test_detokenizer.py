"""Incremental detokenisation against decoding the whole output at once."""

from __future__ import annotations

import random

import pytest

from vmkv.engine.detokenizer import IncrementalDetokenizer, window_decoder


@pytest.fixture(scope="module")
def tokenizer(default_model):
    from vmkv.models import load_tokenizer

    return load_tokenizer(default_model)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_add_up_to_the_whole_decode(tokenizer, skip_special_tokens: bool) -> None:
    """Random ids (multi-byte characters split over tokens, special tokens among them) and a
    chat reply: the deltas joined are ``decode(output)``, and the backend window decoder gives
    ``tokenizer.decode``'s text for every window."""
    fast = window_decoder(tokenizer)
    assert fast != tokenizer.decode  # the default model's tokenizer takes the backend path
    rng = random.Random(0)
    prompt = tokenizer("Hello there")["input_ids"]
    outputs = [[rng.randrange(len(tokenizer)) for _ in range(300)],
               tokenizer("Grüße, 東京! ✓ 🙂 done")["input_ids"]]
    for output in outputs:
        ids = list(prompt)
        detok = IncrementalDetokenizer(tokenizer, len(prompt), skip_special_tokens)
        text = ""
        for token in output:
            ids.append(token)
            text += detok.step(ids)
            window = ids[max(0, len(ids) - 7):]
            assert fast(window, skip_special_tokens=skip_special_tokens) == tokenizer.decode(
                window, skip_special_tokens=skip_special_tokens)
        whole = tokenizer.decode(output, skip_special_tokens=skip_special_tokens)
        assert whole.startswith(text) and len(whole) - len(text) <= 1  # at most a partial char


def test_a_tokenizer_that_cleans_up_spaces_keeps_its_own_decode(tokenizer) -> None:
    class CleaningUp:
        backend_tokenizer = tokenizer.backend_tokenizer
        clean_up_tokenization_spaces = True

        def decode(self, ids, skip_special_tokens=False) -> str:
            return "cleaned"

    t = CleaningUp()
    assert window_decoder(t)([1, 2]) == "cleaned"
