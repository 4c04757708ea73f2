"""Sampled tokens in, request outputs out: the engine's output side.

    new_sequence / fork        a request's sequences (sampling state, grammar, detokenizer)
    append(seq, token)         token ids, logprobs, grammar, stop token?, detokenise,
                               stop string?, length?  ->  the finish reason, if it ends now
    prompt_logprobs(req, ...)  scored prompt tokens
    output(req)                what the request gained this step, as its ``output_kind`` wants:
                               a delta, the sum so far, or nothing until it ends

A step costs what it added, never what the output already holds: a sequence keeps only the
text it has not emitted yet (held back while it may still be the start of a stop string) and
the logprobs not yet emitted; only a CUMULATIVE or FINAL_ONLY request keeps its sum (an
:class:`~vmkv.engine.outputs.OutputAccumulator`, O(1) per step to add to).

Stop semantics are vLLM's: a sequence that ends on EOS or on one of ``stop_token_ids`` does not
return that token's text unless ``include_stop_str_in_output`` is set; a matched stop string is
cut from the text (kept with ``include_stop_str_in_output``).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from vmkv.engine.detokenizer import IncrementalDetokenizer
from vmkv.engine.output_state import RequestOutputState, SeqOutputState
from vmkv.engine.outputs import CompletionOutput, OutputAccumulator, RequestMetrics, RequestOutput
from vmkv.engine.sequence import Request, Sequence
from vmkv.sampling import SamplingState
from vmkv.sampling_params import RequestOutputKind
from vmkv.structured.matcher import GrammarState

logger = logging.getLogger("vmkv")


class OutputProcessor:
    """Builds sequences, turns their sampled tokens into text and stops, and makes outputs."""

    def __init__(self, tokenizer: Any, eos_token_ids: tuple[int, ...], max_model_len: int,
                 device: str) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.device = device

    # -- sequences ----------------------------------------------------------------------------
    def new_request(self, req: Request, grammar: GrammarState | None) -> Sequence:
        """Set up ``req``'s output state and return its first sequence (sample 0)."""
        wants_sum = req.params.output_kind is not RequestOutputKind.DELTA
        state = RequestOutputState(total=OutputAccumulator() if wants_sum else None)
        if req.params.prompt_logprobs is not None:  # the first prompt token has none
            state.unsent_prompt_logprobs = [None]
            req.num_prompt_logprobs = 1
        req.output = state
        return self._new_sequence(req, 0, list(req.prompt_token_ids), grammar)

    def fork(self, parent: Sequence) -> list[Sequence]:
        """The ``parent.pending_forks`` other samples of its request, after its prompt: new
        sequences with its tokens and a fork of its grammar (the caller shares the KV)."""
        grammar = parent.sampling_state.grammar
        return [self._new_sequence(parent.request, index, list(parent.token_ids),
                                   grammar.fork() if grammar is not None else None)
                for index in range(1, parent.pending_forks + 1)]

    def _new_sequence(self, req: Request, index: int, token_ids: list[int],
                      grammar: GrammarState | None) -> Sequence:
        params = req.params
        if index and params.seed is not None:  # each sample its own reproducible stream
            params = replace(params, seed=(params.seed + index) % 2**63)
        state = SamplingState(params, req.prompt_token_ids, [], self.eos_token_ids,
                              grammar=grammar, bad_words_token_ids=req.bad_words_token_ids,
                              device=self.device)
        seq = Sequence(f"{req.request_id}:{index}", req, index, token_ids,
                       len(req.prompt_token_ids), state)
        seq.output = SeqOutputState(IncrementalDetokenizer(
            self.tokenizer, seq.num_prompt_tokens, req.params.skip_special_tokens))
        req.seqs.append(seq)
        return seq

    # -- tokens -------------------------------------------------------------------------------
    def prompt_logprobs(self, req: Request, entries: list[dict[int, float]]) -> None:
        """Record the logprobs of the next ``len(entries)`` prompt tokens."""
        req.num_prompt_logprobs += len(entries)
        req.output.unsent_prompt_logprobs.extend(entries)

    def append(self, seq: Sequence, token: int, logprob: float | None,
               top: list[tuple[int, float]] | None) -> str | None:
        """Add a sampled token; return the finish reason if the sequence ends with it (the
        caller frees it), else None. ``stop_reason`` is set here."""
        seq.token_ids.append(token)
        seq.sampling_state.output_token_ids.append(token)
        params, state = seq.request.params, seq.output
        if params.logprobs is not None:
            entry = {token: float(logprob)} if logprob is not None else {}
            entry.update({t: float(v) for t, v in (top or [])})
            state.unsent_logprobs.append(entry)
        grammar = seq.sampling_state.grammar
        if grammar is not None and not grammar.accept(token):  # the mask makes this unreachable
            logger.error("%s: the grammar rejected token %d; aborting", seq.seq_id, token)
            return "abort"
        grammar_done = grammar is not None and grammar.is_terminated
        stopped = self._stop_token(seq, token, grammar_done)
        if not stopped or params.include_stop_str_in_output:
            new_text = state.detokenizer.step(seq.token_ids)
            if new_text:
                held = len(state.unsent_text)
                state.unsent_text += new_text
                if (not stopped and params.stop and seq.num_output_tokens >= params.min_tokens
                        and self._stop_string(seq, held)):
                    return "stop"
        if stopped or grammar_done:  # the grammar took EOS although ignore_eos was set
            return "stop"
        if (seq.num_output_tokens >= seq.request.max_tokens
                or seq.num_tokens >= self.max_model_len):
            return "length"
        return None

    def _stop_token(self, seq: Sequence, token: int, grammar_done: bool) -> bool:
        """Whether ``token`` ends the sequence as EOS or a stop token id (past min_tokens)."""
        params = seq.request.params
        if seq.num_output_tokens < params.min_tokens:
            return False
        if token in self.eos_token_ids and (not params.ignore_eos or grammar_done):
            return True
        if token in params.stop_token_ids:
            seq.stop_reason = token
            return True
        return False

    @staticmethod
    def _stop_string(seq: Sequence, held: int) -> bool:
        """Find the earliest stop string in the unsent text (the part from ``held`` is new, a
        match may begin up to ``len(stop) - 1`` characters before it: stop strings always
        begin in the unsent text, see :meth:`_safe_len`); cut the text there."""
        params, state = seq.request.params, seq.output
        text = state.unsent_text
        best: tuple[int, str] | None = None
        for stop in params.stop:
            at = text.find(stop, max(0, held - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        at, stop = best
        state.unsent_text = text[: at + len(stop)] if params.include_stop_str_in_output \
            else text[:at]
        seq.stop_reason = stop
        return True

    @staticmethod
    def _safe_len(seq: Sequence) -> int:
        """How much of the unsent text may be emitted: while the sequence runs, the last
        ``max(len(stop)) - 1`` characters of the whole text are held back (they may begin a
        stop string), so a stop string never begins in text already emitted."""
        text = seq.output.unsent_text
        if seq.finish_reason is not None or not seq.request.params.stop:
            return len(text)
        hold = max(len(s) for s in seq.request.params.stop) - 1
        return max(0, len(text) - hold)

    # -- outputs ------------------------------------------------------------------------------
    def output(self, req: Request) -> RequestOutput | None:
        """What ``req`` returns after this step (``finished`` once every sequence ended):
        its delta, or its sum; None for a FINAL_ONLY request still running."""
        delta = self._delta(req)
        total = req.output.total
        if total is None:
            return delta
        total.add(delta)
        if req.params.output_kind is RequestOutputKind.CUMULATIVE:
            return total.output()
        return total.take() if delta.finished else None  # FINAL_ONLY

    def _delta(self, req: Request) -> RequestOutput:
        state = req.output
        completions = [c for c in map(self._seq_delta, req.seqs) if c is not None]
        prompt = prompt_ids = None
        if not state.sent_prompt:
            state.sent_prompt = True
            prompt, prompt_ids = req.prompt, req.prompt_token_ids
        prompt_logprobs = state.unsent_prompt_logprobs or None
        if prompt_logprobs is not None:
            state.unsent_prompt_logprobs = []
        metrics = RequestMetrics(req.arrival_time, req.first_scheduled_time,
                                 req.first_token_time, req.finish_time)
        return RequestOutput(req.request_id, prompt, prompt_ids, completions, req.is_finished,
                             metrics, req.num_cached_tokens, req.error, prompt_logprobs)

    def _seq_delta(self, seq: Sequence) -> CompletionOutput | None:
        state = seq.output
        if state.sent_finish:
            return None
        start = seq.num_prompt_tokens + state.sent_tokens
        token_ids = seq.token_ids[start:]
        safe = self._safe_len(seq)
        text = state.unsent_text[:safe]
        finished = seq.finish_reason is not None
        if not token_ids and not text and not finished:
            return None
        state.unsent_text = state.unsent_text[safe:]
        state.sent_tokens += len(token_ids)
        state.sent_finish = finished
        logprobs = None
        if seq.request.params.logprobs is not None:
            logprobs, state.unsent_logprobs = state.unsent_logprobs, []
        return CompletionOutput(seq.index, text, token_ids, seq.finish_reason, seq.stop_reason,
                                logprobs)
