"""Sampling: per-request state and the batched sampler (see ``sampler.py`` for the order)."""

from __future__ import annotations

from vmkv.sampling.sampler import Sampler, SamplerOutput
from vmkv.sampling.state import SamplingState

__all__ = ["Sampler", "SamplerOutput", "SamplingState"]
