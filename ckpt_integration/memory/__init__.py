"""The in-memory checkpoint tier: snapshots in host shared memory, replicated to peer nodes.

See ``docs/memory.md``. Modules: ``plan`` (pure: replication and restore plans), ``slots``
(snapshot files and commit records in a node's shared memory), ``transfer`` (peer copies over a
gloo group), ``restore`` (inventory, agreement, verified reads), ``tier``
(:class:`MemoryCheckpoints`).
"""

from .plan import ReplicationPlan, replication_plan
from .tier import MemoryCheckpoints, RestoreReport

__all__ = ["MemoryCheckpoints", "RestoreReport", "ReplicationPlan", "replication_plan"]
