"""A peer's life cycle: the `Peer` (stage choice, moves, shutdown), the replica of one stage it serves, its metrics."""
