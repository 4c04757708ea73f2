"""The offline API: ``LLM(...).generate(prompts, params)`` and ``.chat(messages, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from vmkv.chat_template import chat_token_ids
from vmkv.config import EngineConfig
from vmkv.engine.outputs import RequestOutput
from vmkv.options import check_names
from vmkv.process_tuning import tune_process
from vmkv.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from vmkv.engine.llm_engine import LLMEngine

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    """A model with a KV cache and a scheduler, for batches of prompts in one process.

    ``LLM(model, **options)`` takes exactly the fields of :class:`~vmkv.config.EngineConfig`
    as keyword options (``kv_mode``, ``device``, ``dtype``, ``kv_cache_memory`` in bytes,
    ``page_size``, ``kv_layout``, ``block_size``, ``max_model_len``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``preemption_mode``, ``enable_prefix_caching``, ``seed``, ...),
    with the same defaults as the command line's flags; a misspelt one is a TypeError and an
    impossible value a ValueError. ``model``: HF model folder, ``.gguf`` file, or None for the
    default model (SmolLM2-135M-Instruct).

    Construction tunes the process first (OpenMP defaults, glibc malloc; see
    vmkv/process_tuning.py, off with ``VMKV_PROCESS_TUNING=0``), then loads torch and the model.

    :meth:`close` (or leaving ``with LLM(...) as llm:``) releases the KV memory and stops the
    tensor-parallel ranks at once; an ``LLM`` nobody closes releases them when its engine is
    garbage-collected (so ``del llm`` then a new tensor-parallel ``LLM`` works).
    """

    def __init__(self, model: str | None = None, **options: Any) -> None:
        check_names(EngineConfig, options, "LLM()")
        self._start(EngineConfig(model=model, **options))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An LLM over an engine built from a full :class:`EngineConfig` (the CLI's path)."""
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        tune_process()  # before torch loads (with the engine), so the OpenMP settings count
        from vmkv.engine.llm_engine import LLMEngine

        self.engine: LLMEngine = LLMEngine(config)
        self._ids = itertools.count()

    def close(self) -> None:
        """Abort what runs, release the KV memory, stop the ranks (safe to call again)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

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
        final = {id(p): replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params}
        params = [final[id(p)] for p in params]  # one whole output per request, at its end
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
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them
        (``tools``: OpenAI tool definitions, for templates that render them)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt, tools)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix unit (see :meth:`LLMEngine.reset_prefix_cache`)."""
        return self.engine.reset_prefix_cache()

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a conversation under the model's chat template (ValueError if none)."""
        return chat_token_ids(self.tokenizer, messages, add_generation_prompt, tools)

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
