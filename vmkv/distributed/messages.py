"""What rank 0 sends the tensor-parallel workers, once per step (pickled over gloo); a
:class:`vmkv.commands.Stop` ends their loop."""

from __future__ import annotations

from dataclasses import dataclass, field

from vmkv.distributed.kv_replay import KVCall
from vmkv.executor.plan import StepPlan


@dataclass(frozen=True)
class StepMessage:
    """Rank 0's KV calls since the last message, then (optionally) a step to run with it.

    ``ping``: join a barrier (rank 0 checks the ranks while idle); ``check``: send a digest
    of the KV manager's state back (``VMKV_TP_CHECK=1``)."""

    kv_calls: list[KVCall]
    swapped_ids: list[str] = field(default_factory=list)
    step: StepPlan | None = None
    ping: bool = False
    check: bool = False
