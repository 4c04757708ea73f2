"""Structured outputs: output constrained by a JSON schema, a regex, a choice or an EBNF grammar.

    StructuredOutputsParams (params.py)   what a request asks for; validated, hashable
    GrammarCompilerCache (compiler.py)    xgrammar compile, once per distinct params (LRU cache)
    GrammarState (matcher.py)             one sequence's matcher: bitmask, accept, fork

The sampler (vmkv/sampling/grammar.py) masks the logits of constrained rows with one bitmask
tensor per step; the engine advances each sequence's matcher with the token it accepted.
"""

from vmkv.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
