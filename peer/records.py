"""The shared record types and status names: what a replica announces about itself in the DHT.

Every subsystem reads these; this module imports nothing of `swarmgrad.peer`, so any module may
import it. Values read from the DHT are bounded by `protocol/records.py` before they become a
`PeerRecord`.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from swarmgrad.protocol.framing import ProtocolError
from swarmgrad.protocol.records import bounded_record_fields

FAILED = "failed"
"""The outcome of a member whose round failed, in its vote (any other outcome is a mean digest)."""

JOINING, ONLINE, LEAVING = "joining", "online", "leaving"
STATES = (JOINING, ONLINE, LEAVING)


@dataclass(frozen=True)
class PeerRecord:
    peer_id: str
    stage: int
    state: str
    throughput: float
    """Samples per second of this replica's forward+backward compute (waits excluded; an EMA)."""
    round: int
    applied_rounds: int
    digest: str
    manifest_hash: str
    driver: bool
    maddrs: tuple[str, ...] = ()
    memory: int = 0
    """Bytes this peer offers for a stage (0: not said)."""
    moving: bool = False
    """This replica is moving away from its stage (it serves until its next round boundary)."""
    pinned: bool = False
    """Its peer does not move between stages (`--stage N`, `--rebalance off`): placement never
    picks it as a mover, or an empty stage could wait on a peer that will not come."""
    stats: dict[str, Any] | None = None
    """What the replica last measured (ReplicaStats below, bounded by protocol/records.py): for
    people and dashboards only, never for decisions."""
    backups: tuple[tuple[int, int], ...] = ()
    """(stage, applied_rounds) of the backups this peer holds (peer/state/backup.py): placement prefers
    a holder of a stage's current state to repair it (it joins without a download)."""
    voucher: bytes = b""
    """The run owner's voucher for this peer (peer/net/vouchers.py; public runs only; b"": none)."""
    vouched: bool = False
    """The reader checked `voucher` and it holds: this peer is an anchor (peer/evidence.py). Set by
    the reader (net/dht_view.py SwarmView), never read from the wire."""

    def to_value(self) -> dict[str, Any]:
        value = asdict(self)
        value.pop("peer_id")
        value["maddrs"] = list(self.maddrs)
        value["backups"] = [list(pair) for pair in self.backups]
        if value["stats"] is None:
            del value["stats"]
        del value["vouched"]
        if not self.voucher:  # records without one are as they were
            del value["voucher"]
        return value

    @classmethod
    def from_value(cls, peer_id: str, value: Any) -> "PeerRecord | None":
        """A record read from the DHT, or None if any field is missing, mistyped or out of bounds
        (protocol.records.bounded_record_fields: e.g. a throughput of 1e308 or a round of 2^64)."""
        try:
            f = bounded_record_fields(value)
        except ProtocolError:
            return None
        if f["state"] not in STATES:
            return None
        return cls(peer_id=peer_id, stage=f["stage"], state=f["state"], throughput=f["throughput"], round=f["round"],
                   applied_rounds=f["applied_rounds"], digest=f["digest"], manifest_hash=f["manifest_hash"],
                   driver=f["driver"], maddrs=tuple(f["maddrs"]), memory=f["memory"], moving=f["moving"],
                   pinned=f["pinned"], stats=f["stats"], backups=f["backups"], voucher=f["voucher"])


def stage_key(run_id: str, stage: int) -> str:
    return f"{run_id}/stage/{stage}"


def round_key(run_id: str, stage: int, round_no: int) -> str:
    return f"{run_id}/round/{stage}/{round_no}"


@dataclass
class ReplicaStats:
    """What a replica last measured, announced with its record for whoever watches the swarm
    (the coordinator's dashboard, `swarmgrad status`). Nobody routes or averages by it."""
    train_loss: float | None = None
    val_loss: float | None = None
    """bits/byte of the last evaluation (drivers only)."""
    val_nats: float | None = None
    """The same evaluation in nats per token of the run's tokenizer (per byte for the byte-level model)."""
    val_ppl: float | None = None
    """Its perplexity per token: exp(val_nats)."""
    round_s: float | None = None
    group_size: int | None = None
    samples_per_s: float | None = None
    samples: int = 0
    """Samples this replica trained so far."""
    bytes_sent: int = 0
    """Bytes this peer sent so far (all kinds)."""
    bytes_activations: int = 0
    bytes_gradients: int = 0
    bytes_averaging: int = 0
    bytes_state: int = 0
    """Bytes this peer sent so far, by kind (peer/net/rpc.py TRAFFIC_KINDS)."""

    def to_value(self) -> dict:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in self.__dict__.items()}
