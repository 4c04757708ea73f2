"""What rank 0 sends the tensor-parallel workers, once per step (pickled over gloo); a
:class:`vmkv.commands.Stop` ends their loop."""

from __future__ import annotations

from dataclasses import dataclass

from vmkv.executor.plan import StepPlan
from vmkv.kv.changes import KVChange


@dataclass(frozen=True)
class StepMessage:
    """Rank 0's KV changes since the last message (vmkv/kv/changes.py), then (optionally) a
    step to run with them.

    ``ping``: join a barrier (rank 0 checks the ranks while idle); ``check``: send a digest
    of the KV manager's state back (``--tp-check``)."""

    kv_changes: list[KVChange]
    step: StepPlan | None = None
    ping: bool = False
    check: bool = False
