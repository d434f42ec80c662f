"""Planning: pure functions over shard metadata (no I/O, no collectives)."""
