"""Swarm state in the DHT: who serves which stage, the run's clock, round registrations.

Keys (all under the run id, so runs never see each other's records):
  {run}/stage/{s}          subkey peer id -> PeerRecord as a dict   (expires: timeouts.announce_ttl)
  {run}/epoch              the run's time origin for wall-clock rounds
  {run}/round/{s}/{r}      subkey peer id -> registration for round r of stage s
Values are small dicts (hivemind's pipe breaks on values over ~16 KiB, see the primer). Every
record read back is validated; a malformed record or one of another manifest is dropped.
"""
from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import asdict, dataclass
from typing import Any

from hivemind import DHT
from hivemind.utils import get_dht_time

from swarmgrad.protocol.framing import ProtocolError
from swarmgrad.protocol.records import bounded_record_fields, validate_registration

logger = logging.getLogger(__name__)

JOINING, ONLINE, LEAVING = "joining", "online", "leaving"
EPOCH_TTL = 7 * 86400.0
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

    def to_value(self) -> dict[str, Any]:
        value = asdict(self)
        value.pop("peer_id")
        value["maddrs"] = list(self.maddrs)
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
                   driver=f["driver"], maddrs=tuple(f["maddrs"]), memory=f["memory"], moving=f["moving"])


def stage_key(run_id: str, stage: int) -> str:
    return f"{run_id}/stage/{stage}"


def round_key(run_id: str, stage: int, round: int) -> str:
    return f"{run_id}/round/{stage}/{round}"


class SwarmView:
    """The peer's window on the DHT: typed reads and writes, each with a deadline."""

    def __init__(self, dht: DHT, run_id: str, manifest_hash: str, n_stages: int, timeout: float, ttl: float):
        self.dht = dht
        self.run_id = run_id
        self.manifest_hash = manifest_hash
        self.n_stages = n_stages
        self.timeout = timeout
        self.ttl = ttl

    async def _store(self, key: str, subkey: str | None, value: Any, ttl: float) -> bool:
        future = self.dht.store(key, value, get_dht_time() + ttl, subkey=subkey, return_future=True)
        return bool(await asyncio.wait_for(future, self.timeout))

    async def _get(self, key: str) -> Any:
        future = self.dht.get(key, latest=True, return_future=True)
        found = await asyncio.wait_for(future, self.timeout)
        return None if found is None else found.value

    async def announce(self, record: PeerRecord) -> bool:
        return await self._store(stage_key(self.run_id, record.stage), record.peer_id, record.to_value(), self.ttl)

    async def stage_records(self, stage: int) -> list[PeerRecord]:
        """Live replicas of `stage` that run our manifest (any manifest, for a view built without
        one, as `swarmgrad status --run-id` does), sorted by peer id."""
        raw = await self._get(stage_key(self.run_id, stage))
        records = []
        if isinstance(raw, dict):
            for subkey, item in raw.items():
                record = PeerRecord.from_value(str(subkey), getattr(item, "value", None))
                if record is None or record.stage != stage:
                    logger.debug("dropped a malformed record under stage %d from %s", stage, subkey)
                elif not self.manifest_hash or record.manifest_hash == self.manifest_hash:
                    records.append(record)
        return sorted(records, key=lambda r: r.peer_id)

    async def swarm(self) -> dict[int, list[PeerRecord]]:
        results = await asyncio.gather(*(self.stage_records(s) for s in range(self.n_stages)))
        return dict(enumerate(results))

    async def epoch(self) -> float:
        """The run's time origin: read it, or set it to now if nobody has (first writer wins)."""
        found = await self._get(self._epoch_key)
        if not isinstance(found, (int, float)):
            await self.refresh_epoch(float(get_dht_time()))
            found = await self._get(self._epoch_key)
        if not isinstance(found, (int, float)) or not math.isfinite(found):
            raise RuntimeError(f"could not read or set the run's epoch in the DHT ({found!r})")
        return float(found)

    @property
    def _epoch_key(self) -> str:
        return f"{self.run_id}/epoch"

    async def refresh_epoch(self, epoch: float) -> bool:
        """(Re)store the run's time origin, so it outlives any one peer while anyone runs."""
        return await self._store(self._epoch_key, None, epoch, EPOCH_TTL)

    async def register_round(self, stage: int, round: int, peer_id: str, value: dict[str, Any]) -> bool:
        return await self._store(round_key(self.run_id, stage, round), peer_id, value, self.ttl * 4)

    async def round_registrations(self, stage: int, round: int) -> dict[str, dict[str, Any]]:
        """Registrations for a round, each checked (protocol.records.validate_registration); bad
        ones are dropped, so a malformed value cannot make matchmaking raise."""
        raw = await self._get(round_key(self.run_id, stage, round))
        out = {}
        if isinstance(raw, dict):
            for subkey, item in raw.items():
                try:
                    out[str(subkey)] = validate_registration(getattr(item, "value", None)).to_value()
                except ProtocolError as e:
                    logger.debug("dropped a registration for stage %d round %d from %s: %s", stage, round, subkey, e)
        return out

    async def post_check(self, stage: int, round: int, peer_id: str, digest: str) -> bool:
        """Post the digest of the mean this replica decoded in a round (the reducers' cross-check)."""
        return await self._store(f"{round_key(self.run_id, stage, round)}/check", peer_id, digest, self.ttl * 4)

    async def round_checks(self, stage: int, round: int) -> dict[str, str]:
        raw = await self._get(f"{round_key(self.run_id, stage, round)}/check")
        out = {}
        if isinstance(raw, dict):
            for subkey, item in raw.items():
                value = getattr(item, "value", None)
                if isinstance(value, str) and len(value) <= 64:
                    out[str(subkey)] = value
        return out
