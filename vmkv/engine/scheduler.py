"""Iteration-level scheduler: one token budget per step, no prefill or decode phases.

Each step maps ``{seq_id: num_scheduled_tokens}`` under ``max_num_batched_tokens`` and
``max_num_seqs``. Running sequences come first (a decode is 1 token; an unfinished prefill
continues with as many as the budget allows); then, if nothing was preempted this step, waiting
sequences are admitted first-come-first-served, their prompts prefilled in chunks that fill the
rest of the budget. Strict FCFS: a waiting head that does not fit blocks the queue. A waiting
sequence is admitted next to running ones only when its whole remaining prefill fits with room
left for every running sequence's next token (admitting it earlier only gets it preempted and
its chunks recomputed a step later).

When the KV manager cannot grow a running sequence, the newest running sequence is preempted
all-or-nothing and put back at the front of the queue:

    recompute  its KV is dropped; it re-prefills prompt + generated tokens later
    swap       its KV is copied to host memory and its pages/blocks released; on re-admission
               fresh memory is allocated and the KV copied back (no recomputation)

A sequence that cannot fit even with every other sequence preempted is finished with
``finish_reason="length"`` (``stop_reason="kv_capacity"``) instead of looping. A sequence whose
memory the OS or driver refuses (the KV manager raises ``VmmError``) is finished with
``finish_reason="error"`` and reported in ``SchedulerOutput.failed``; the others go on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from vmkv.config import PREEMPTION_MODES
from vmkv.engine.sequence import SeqStatus, Sequence
from vmkv.kv.base import KVCacheManager, VmmError


@dataclass
class SchedulerOutput:
    """What one step runs: sequences in batch order and their token counts."""

    scheduled: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted: list[Sequence] = field(default_factory=list)
    out_of_capacity: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, VmmError]] = field(default_factory=list)  # memory refused

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.scheduled.append(seq)
        self.num_scheduled_tokens[seq.seq_id] = num_tokens

    def drop_finished(self) -> None:
        """Unschedule sequences finished since planning (their KV is gone)."""
        for seq in [s for s in self.scheduled if s.is_finished]:
            self.scheduled.remove(seq)
            del self.num_scheduled_tokens[seq.seq_id]


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0  # tokens whose KV was dropped and must be prefilled again
    num_swapped_out_tokens: int = 0
    num_swapped_in_tokens: int = 0


class Scheduler:
    """FCFS token-budget scheduler over one :class:`KVCacheManager`."""

    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption_mode: str = "recompute",
        propose: Callable[[Sequence, int, int], list[int]] | None = None,
    ) -> None:
        """``propose(seq, room, batch_size)``: speculative decoding's proposals for a decoding
        sequence (at most ``room``), scheduled as ``1 + len(proposals)`` query tokens."""
        if max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
        if max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {max_num_batched_tokens}")
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.propose = propose
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()

    # -- queues -------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (or a freshly forked child: it joins ``running`` directly)."""
        if seq.num_computed_tokens:
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
        else:
            seq.status = SeqStatus.WAITING
            self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out of the queues and release its KV (finished or aborted)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if self.kv.room.holds(seq.seq_id):
            self.kv.free(seq.seq_id)
        seq.swapped = None
        seq.status = SeqStatus.FINISHED

    @property
    def num_seqs(self) -> int:
        return len(self.running) + len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- the step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan one step; KV room for every scheduled token is allocated on return."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_new_tokens, budget)
            try:
                # room for proposals: what the budget keeps after one token each for the rest
                if self._speculate(seq, n, budget - (len(self.running) - 1 - i)):
                    n, allocated = 1 + len(seq.draft_token_ids), True
                else:
                    allocated = self._allocate_or_preempt(seq, n, out)
            except VmmError as exc:
                self._fail(seq, exc, out)
                continue
            if allocated:
                out.add(seq, n)
                budget -= n
                i += 1
            # else seq itself left ``running`` (preempted, out of capacity or failed): same index
        if out.preempted:
            return out
        # running sequences plus the samples they will fork after their prompt
        seqs = len(self.running) + sum(s.pending_forks for s in self.running)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seqs + 1 + seq.pending_forks > self.max_num_seqs:
                break
            seqs += 1 + seq.pending_forks
            try:
                admitted = self._admit(seq, budget, out)
            except VmmError as exc:
                seqs -= 1 + seq.pending_forks
                self._fail(seq, exc, out)
                continue
            if admitted is None:
                break
            n = admitted
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.add(seq, n)
            budget -= n
        return out

    def _speculate(self, seq: Sequence, n: int, room: int) -> bool:
        """Schedule decoding ``seq`` with proposals (``seq.draft_token_ids``) when there are
        some and their room is free now (False: as usual, one token)."""
        if (self.propose is None or n != 1 or room < 2 or not seq.num_output_tokens
                or seq.pending_forks):
            return False
        drafts = self.propose(seq, room - 1, len(self.running))
        if not drafts or not self.kv.allocate(seq.seq_id, 1 + len(drafts)):
            return False
        seq.draft_token_ids = drafts
        return True

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int | None:
        """Room for the waiting head's next chunk: its token count, or None when it must wait
        (it may have been finished as hopeless)."""
        hit = self._match_prefix(seq)
        n = min(seq.num_new_tokens, budget)
        if not self._leaves_headroom(seq):
            self._unmatch(seq, hit)
            return None
        if seq.swapped is not None:
            # swap in only when the next chunk fits too (no swap-in/out thrashing)
            if not self.kv.room.can_allocate(seq.seq_id, seq.swapped.num_tokens + n):
                self._finish_if_hopeless(seq, out)
                return None
            self._swap_in(seq)
        if not self.kv.allocate(seq.seq_id, n):
            self._unmatch(seq, hit)
            self._finish_if_hopeless(seq, out)
            return None
        return n

    def _fail(self, seq: Sequence, exc: VmmError, out: SchedulerOutput) -> None:
        """The OS/driver refused ``seq``'s memory: it leaves the queues holding nothing."""
        self.remove(seq)
        seq.num_computed_tokens = 0
        seq.finish_reason, seq.stop_reason = "error", None
        out.failed.append((seq, exc))

    def update(self, out: SchedulerOutput) -> None:
        """Record that the step ran: scheduled tokens are now computed (and their completed
        units published to the prefix cache)."""
        prefix = self.kv.prefix
        for seq in out.scheduled:
            seq.num_computed_tokens += out.num_scheduled_tokens[seq.seq_id]
            if prefix.enabled and not seq.draft_token_ids:  # (proposals: after verifying)
                prefix.publish(seq.seq_id, seq.token_ids, seq.num_computed_tokens,
                               seq.request.cache_salt)

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """After ``seq``'s verify step: it keeps the KV of its first ``num_tokens`` tokens
        (the verified ones), the rejected proposals' room goes back (``kv.free`` with
        ``keep_tokens``), and only verified tokens reach the prefix cache."""
        seq.draft_token_ids = []
        if seq.is_finished:  # its KV is gone already
            return
        self.kv.free(seq.seq_id, keep_tokens=num_tokens)
        seq.num_computed_tokens = num_tokens
        if self.kv.prefix.enabled:
            self.kv.prefix.publish(seq.seq_id, seq.token_ids, num_tokens,
                                   seq.request.cache_salt)

    # -- prefix caching -----------------------------------------------------------------------
    def _match_prefix(self, seq: Sequence) -> int:
        """Cached tokens for a sequence about to be admitted fresh (0 if none)."""
        if (seq.num_computed_tokens or seq.swapped is not None or not self.kv.prefix.enabled
                or seq.request.params.prompt_logprobs is not None):  # (recompute to score it)
            return 0
        hit = self.kv.prefix.match(seq.seq_id, seq.token_ids, seq.request.cache_salt)
        seq.num_computed_tokens = hit
        if seq.request.first_scheduled_time is None:  # first admission: what the user sees
            seq.request.num_cached_tokens = hit
        return hit

    def _unmatch(self, seq: Sequence, hit: int) -> None:
        """Admission failed after a prefix hit: give the hit back (the cache keeps it)."""
        if hit:
            self.kv.free(seq.seq_id)
            seq.num_computed_tokens = 0

    def _leaves_headroom(self, seq: Sequence) -> bool:
        """Admit only if the newcomer's whole remaining prefill fits and the running sequences
        could still take their next token; otherwise it would be preempted (and its chunks
        recomputed) a step or two later."""
        if not self.running:
            return True
        total = seq.num_new_tokens + (seq.swapped.num_tokens if seq.swapped else 0)
        room = self.kv.room
        need = room.units_needed(seq.seq_id, total)
        if need is None:
            return False
        reserve = sum(room.units_needed(r.seq_id, 1) or 0 for r in self.running)
        return need + reserve <= room.free_units

    # -- preemption ---------------------------------------------------------------------------
    def _allocate_or_preempt(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Room for ``n`` tokens of running ``seq``, preempting the newest running sequences
        as needed. False when ``seq`` itself had to leave ``running``."""
        while not self.kv.allocate(seq.seq_id, n):
            victim = self.running[-1]
            if victim is seq and len(self.running) == 1:
                self.running.pop()
                self._out_of_capacity(seq, out)
                return False
            self.running.pop()
            try:
                self._preempt(victim)
            except VmmError as exc:  # its KV could not be saved: the victim fails, alone
                self._fail(victim, exc, out)
            else:
                out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.stats.num_preemptions += 1
        if self.preemption_mode == "swap":
            self.stats.num_swapped_out_tokens += self.kv.room.num_tokens(seq.seq_id)
            seq.swapped = self.kv.swap.out(seq.seq_id)
        else:
            self.stats.num_recomputed_tokens += seq.num_computed_tokens
            self.kv.free(seq.seq_id)
            seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def _swap_in(self, seq: Sequence) -> None:
        if not self.kv.swap.back(seq.seq_id, seq.swapped):
            raise AssertionError("swap_in failed although can_allocate said it fits")
        self.stats.num_swapped_in_tokens += self.kv.room.num_tokens(seq.seq_id)
        seq.swapped = None

    def _finish_if_hopeless(self, seq: Sequence, out: SchedulerOutput) -> None:
        """A waiting head that does not fit with nothing running never will."""
        if not self.running:
            self.waiting.popleft()
            self._out_of_capacity(seq, out)

    def _out_of_capacity(self, seq: Sequence, out: SchedulerOutput) -> None:
        if self.kv.room.holds(seq.seq_id):
            self.kv.free(seq.seq_id)
        seq.swapped = None
        seq.status = SeqStatus.FINISHED
        seq.finish_reason, seq.stop_reason = "length", "kv_capacity"
        out.out_of_capacity.append(seq)
