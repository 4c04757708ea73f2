"""When a sequence stops, and the text it returns (stop strings matched across tokens)."""

from __future__ import annotations

from vmkv.engine.sequence import Sequence


def check_stop(seq: Sequence, new_text_start: int, eos_token_ids: tuple[int, ...],
               max_model_len: int) -> None:
    """Set ``seq.finish_reason`` / ``stop_reason`` (and trim its text) if it must stop now.

    ``new_text_start`` is where this step's text delta begins in ``seq.output_text``; a stop
    string may begin up to ``len(stop) - 1`` characters before it.
    """
    params = seq.request.params
    last = seq.token_ids[-1]
    if seq.num_output_tokens >= params.min_tokens:
        if last in eos_token_ids and not params.ignore_eos:
            seq.finish_reason = "stop"
            return
        if last in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", last
            return
        if params.stop and _match_stop_string(seq, new_text_start):
            return
    if seq.num_output_tokens >= seq.request.max_tokens or seq.num_tokens >= max_model_len:
        seq.finish_reason = "length"


def _match_stop_string(seq: Sequence, new_text_start: int) -> bool:
    params = seq.request.params
    text = seq.output_text
    best: tuple[int, str] | None = None
    for stop in params.stop:
        at = text.find(stop, max(0, new_text_start - len(stop) + 1))
        if at >= 0 and (best is None or at < best[0]):
            best = (at, stop)
    if best is None:
        return False
    at, stop = best
    seq.output_text = text[: at + len(stop)] if params.include_stop_str_in_output else text[:at]
    seq.finish_reason, seq.stop_reason = "stop", stop
    return True


def stream_safe_len(seq: Sequence) -> int:
    """How much of the text can be shown while the sequence runs: the tail that might still
    become the start of a stop string is held back."""
    if seq.finish_reason is not None or not seq.request.params.stop:
        return len(seq.output_text)
    hold = max(len(s) for s in seq.request.params.stop) - 1
    return max(0, len(seq.output_text) - hold)
