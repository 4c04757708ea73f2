"""The offline API: ``LLM(...).generate(prompts, params)`` and ``.chat(messages, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from vmkv.config import CacheConfig
from vmkv.engine.config import EngineConfig
from vmkv.engine.llm_engine import LLMEngine
from vmkv.engine.outputs import RequestOutput
from vmkv.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    """A model with a KV cache and a scheduler, for batches of prompts in one process.

    Args:
        model: HF model folder, ``.gguf`` file, or None for the default model
            (SmolLM2-135M-Instruct).
        kv_mode: "virtual" (contiguous slots, pages mapped on demand) or "paged".
        device: "cpu" or "cuda[:N]".
        dtype: "auto" (float32 on CPU, bfloat16 on CUDA), "float32", "bfloat16", "float16".
        kv_cache_memory: physical KV budget in bytes.
        page_size: virtual page size in bytes (None: 16 KiB per-layer / 64 KiB all-layers on the
            host, the driver granularity on CUDA).
        kv_layout: "all-layers" or "per-layer" (virtual mode); None: per-layer on CPU,
            all-layers on CUDA.
        block_size: tokens per block (paged mode).
        enable_prefix_caching: share the KV of common prompt prefixes across requests (default on).
        linear_backend: "auto" (oneDNN-packed linears for float32 on CPU), "onednn", "torch".
        max_model_len, max_num_seqs, max_num_batched_tokens, preemption_mode, seed:
            as in :class:`~vmkv.engine.config.EngineConfig`.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        kv_mode: str = "virtual",
        device: str = "cpu",
        dtype: str = "auto",
        kv_cache_memory: int = 1 << 30,
        page_size: int | None = None,
        kv_layout: str | None = None,
        block_size: int = 16,
        premap_pages: int = 0,
        max_idle_memory: int | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        preemption_mode: str = "recompute",
        seed: int = 0,
        enable_prefix_caching: bool = True,
        linear_backend: str = "auto",
    ) -> None:
        cache = CacheConfig(kv_mode=kv_mode, kv_cache_bytes=kv_cache_memory,
                            page_size=page_size, layout=kv_layout, block_size=block_size,
                            premap_pages=premap_pages, max_idle_bytes=max_idle_memory,
                            precreate=device != "cpu",
                            enable_prefix_caching=enable_prefix_caching)
        self.engine = LLMEngine(EngineConfig(
            model=model, device=device, dtype=dtype, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            preemption_mode=preemption_mode, cache=cache, seed=seed,
            linear_backend=linear_backend))
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An LLM over an engine built from a full :class:`EngineConfig` (the CLI's path)."""
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config)
        llm._ids = itertools.count()
        return llm

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order.

        Raises ValueError (and queues nothing) if any prompt or parameter is invalid.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt
        prompts = list(prompts)
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} sampling params for "
                                 f"{len(prompts)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        added: list[str] = []
        try:
            for rid, prompt, p in zip(ids, prompts, params, strict=True):
                self.engine.add_request(rid, prompt, p)
                added.append(rid)
            return self._run(ids, use_tqdm)
        except BaseException:
            for rid in added:  # leave the engine clean: nothing half-run stays queued
                self.engine.abort_request(rid)
            raise

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix unit (see :meth:`LLMEngine.reset_prefix_cache`)."""
        return self.engine.reset_prefix_cache()

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True
                            ) -> list[int]:
        """Token ids of a conversation under the model's chat template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True,
                                                 add_generation_prompt=add_generation_prompt)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns a dict
            ids = ids["input_ids"]
        return list(ids)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="requests", unit="req", dynamic_ncols=True)
        wanted = set(ids)
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[rid] for rid in ids]
