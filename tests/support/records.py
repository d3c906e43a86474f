"""DHT records as tests write them: every field a decision reads, the rest fixed."""
from __future__ import annotations

from swarmgrad.peer.records import ONLINE, PeerRecord


def rec(peer: str, *, stage: int = 1, state: str = ONLINE, round_no: int = 0, applied: int = 0, digest: str = "d",
        driver: bool = False) -> PeerRecord:
    return PeerRecord(peer_id=peer, stage=stage, state=state, throughput=1.0, round=round_no, applied_rounds=applied,
                      digest=digest, manifest_hash="h", driver=driver)
