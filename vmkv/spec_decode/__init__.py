"""Speculative decoding: proposers guess a sequence's next tokens, one step verifies them all
(k + 1 query rows), and the KV of the rejected ones is rolled back (docs/speculative.md).

    config.py       --speculative-config (vLLM's JSON), checked       (torch-free: a leaf)
    ngram.py        prompt lookup over the sequence's prompt and output
    suffix.py       the longest suffix match in the sequence or recent finished outputs
    draft_model.py  a draft model's greedy guesses (its own executor and KV cache)
    proposer.py     the method's proposer, the adaptive policy, the counters
    verifier.py     round-by-round verification with the engine's own sampler
    metrics.py      vLLM's spec_decode counters
"""
