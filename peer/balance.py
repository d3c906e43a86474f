"""Stage choice, pure. For now a newcomer takes the stage with the fewest live replicas (ties:
the lowest stage); throughput-aware rebalancing (DESIGN.md, "Rebalancing") builds on this."""
from __future__ import annotations

from typing import Mapping, Sequence

from swarmgrad.peer.swarm import JOINING, ONLINE, PeerRecord


def choose_stage(view: Mapping[int, Sequence[PeerRecord]], n_stages: int, exclude: str = "") -> int:
    """The stage with the fewest JOINING or ONLINE replicas, not counting `exclude` (ourselves)."""
    def replicas(stage: int) -> int:
        return sum(1 for r in view.get(stage, ()) if r.state in (JOINING, ONLINE) and r.peer_id != exclude)
    return min(range(n_stages), key=lambda s: (replicas(s), s))
