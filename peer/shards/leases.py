"""Shard leases and the swarm's data position, as pure functions over a snapshot of the drivers'
DHT records (the daemon's side is peer/shards/leaser.py).

Each driver writes one record, `{run}/data` subkey = its peer id (signed by it, like every swarm
record: peer/net/record_signing.py), holding:
- its view of the **data position**: the epoch, the shards done in it (a bitmap over the indices
  of `ShardSource.shard_ids()`), and for shards begun and not done the windows claimed so far
  (`offsets`); every driver republishes the union of what it has read, so the position outlives
  the drivers that made it;
- its **lease**: the shard it trains (`held`, with `since`, when it took it) and `until`, when the
  lease expires unless renewed; `claimed`: windows [0, claimed) of that shard are its to train.

Invariant ("no window trained twice in an epoch"): a driver draws only windows below its
published claim, and whoever takes a shard over starts at the highest claim published for it.
So a crashed driver's shard goes on where its claim ended; the windows it claimed but never drew
(at most one and a half claim blocks: a claim is extended by a block when half a block is left) come back next epoch. Windows of the crashed driver's last,
unaveraged round never reached θ_global; they are not trained again either.

Contested shards (two drivers took the same free shard at once): the lease with the earlier
`since` wins, ties go to the lower peer id (`lease_winner`). Each taker reads back after writing
and the loser drops the shard before drawing from it.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from swarmgrad.peer.manifest_checks import MAX_SHARDS

__all__ = ["DataPosition", "DriverRecord", "Lease", "MAX_SHARDS", "choose_shard", "epoch_complete",
           "lease_winner", "live_leases", "merge_position", "parse_record"]

RECORD_VERSION = 1


@dataclass(frozen=True)
class DataPosition:
    """How far the swarm is through its data: `epoch` (from 0), the shards `done` in it (indices),
    and `offsets`: for a shard begun and not done, the windows claimed (trained or skipped) so far.
    Positions only grow within an epoch; a later epoch supersedes an earlier one."""
    n_shards: int
    epoch: int = 0
    done: frozenset[int] = frozenset()
    offsets: Mapping[int, int] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.done) >= self.n_shards

    def with_claim(self, shard: int, claimed: int) -> "DataPosition":
        if shard in self.done or claimed <= self.offsets.get(shard, 0):
            return self
        return DataPosition(self.n_shards, self.epoch, self.done, {**self.offsets, shard: claimed})

    def with_done(self, shard: int) -> "DataPosition":
        offsets = {k: v for k, v in self.offsets.items() if k != shard}
        return DataPosition(self.n_shards, self.epoch, self.done | {shard}, offsets)

    def next_epoch(self) -> "DataPosition":
        return DataPosition(self.n_shards, self.epoch + 1)

    def to_json(self) -> dict[str, Any]:
        """For checkpoints and --save-dir (data_position.json): plain JSON."""
        return {"epoch": self.epoch, "shards": self.n_shards, "done": sorted(self.done),
                "offsets": {str(k): v for k, v in sorted(self.offsets.items())}}

    @classmethod
    def from_json(cls, value: Mapping[str, Any], n_shards: int) -> "DataPosition":
        """Raises ValueError when `value` is malformed or is about another number of shards."""
        if not isinstance(value, Mapping) or value.get("shards") != n_shards:
            raise ValueError(f"a data position of {value.get('shards') if isinstance(value, Mapping) else value!r} "
                             f"shards, not {n_shards} (data.shards changed?)")
        epoch, done, offsets = value.get("epoch"), value.get("done"), value.get("offsets", {})
        if not _count(epoch) or not isinstance(done, list) or not isinstance(offsets, Mapping):
            raise ValueError("a data position needs an epoch, a list `done` and a table `offsets`")
        if not all(_count(k) and k < n_shards for k in done):
            raise ValueError("a data position's done list names shards outside [0, shards)")
        parsed = {}
        for k, v in offsets.items():
            if not (str(k).isdigit() and int(k) < n_shards and _count(v)):
                raise ValueError(f"a data position's offset {k!r}: {v!r} is not a shard index and a count")
            parsed[int(k)] = v
        return cls(n_shards, epoch, frozenset(done), {k: v for k, v in parsed.items() if k not in done})

    def summary(self) -> str:
        return (f"epoch {self.epoch}: {len(self.done)} of {self.n_shards} shards done, "
                f"{len(self.offsets)} begun")


@dataclass(frozen=True)
class Lease:
    peer_id: str
    shard: int
    since: float
    until: float
    claimed: int


@dataclass(frozen=True)
class DriverRecord:
    """One driver's record, parsed and checked (`parse_record`)."""
    peer_id: str
    position: DataPosition
    lease: Lease | None

    def to_value(self) -> dict[str, Any]:
        p, lease = self.position, self.lease
        value: dict[str, Any] = {"v": RECORD_VERSION, "shards": p.n_shards, "epoch": p.epoch,
                                 "done": _bitmap(p.done, p.n_shards),
                                 "offsets": [[k, v] for k, v in sorted(p.offsets.items())]}
        if lease is not None:
            value.update(held=lease.shard, since=lease.since, until=lease.until, claimed=lease.claimed)
        return value


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _time(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _bitmap(indices: Iterable[int], n: int) -> bytes:
    bits = bytearray((n + 7) // 8)
    for k in indices:
        bits[k // 8] |= 1 << (k % 8)
    return bytes(bits)


def _indices(bits: bytes, n: int) -> frozenset[int]:
    return frozenset(k for k in range(n) if bits[k // 8] >> (k % 8) & 1)


def parse_record(peer_id: str, value: Any, n_shards: int) -> DriverRecord | None:
    """The record `peer_id` wrote, or None when it is malformed or about another number of shards
    (another corpus: it is none of our business). Never raises on a peer's bytes."""
    if not isinstance(value, Mapping) or value.get("v") != RECORD_VERSION or value.get("shards") != n_shards:
        return None
    epoch, done, offsets = value.get("epoch"), value.get("done"), value.get("offsets")
    if not _count(epoch) or not isinstance(done, bytes) or len(done) != (n_shards + 7) // 8:
        return None
    if not isinstance(offsets, list) or len(offsets) > n_shards:
        return None
    done_set = _indices(done, n_shards)
    parsed: dict[int, int] = {}
    for item in offsets:
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and _count(item[0]) and item[0] < n_shards
                and _count(item[1])):
            return None
        parsed[item[0]] = item[1]
    position = DataPosition(n_shards, epoch, done_set, {k: v for k, v in parsed.items() if k not in done_set})
    lease = None
    if "held" in value:
        held, since, until, claimed = value["held"], value.get("since"), value.get("until"), value.get("claimed")
        if not (_count(held) and held < n_shards and _time(since) and _time(until) and _count(claimed)):
            return None
        lease = Lease(peer_id, held, float(since), float(until), claimed)
    return DriverRecord(peer_id, position, lease)


def merge_position(mine: DataPosition, records: Iterable[DriverRecord]) -> DataPosition:
    """The position as far as anyone has published it: the latest epoch among `mine` and the
    records, the union of its done sets, the highest claim per begun shard, and the claim of every
    lease of that epoch (a holder's claim is the start for whoever takes the shard after it)."""
    records = list(records)
    epoch = max([mine.epoch, *(r.position.epoch for r in records)])
    same = [p for p in (mine, *(r.position for r in records)) if p.epoch == epoch]
    done = frozenset().union(*(p.done for p in same))
    offsets: dict[int, int] = {}
    claims = [(k, v) for p in same for k, v in p.offsets.items()]
    claims += [(r.lease.shard, r.lease.claimed) for r in records if r.lease and r.position.epoch == epoch]
    for k, v in claims:
        if k not in done and v > 0:  # a lease that claimed nothing yet (just taken) has begun nothing
            offsets[k] = max(offsets.get(k, 0), v)
    return DataPosition(mine.n_shards, epoch, done, offsets)


def live_leases(records: Iterable[DriverRecord], epoch: int, now: float) -> list[Lease]:
    """The leases of `epoch` not expired at `now`."""
    return [r.lease for r in records if r.lease is not None and r.position.epoch == epoch and r.lease.until > now]


def lease_winner(leases: Iterable[Lease], shard: int) -> str | None:
    """Who holds `shard` among live leases: the earliest `since`, then the lowest peer id."""
    contenders = [lease for lease in leases if lease.shard == shard]
    if not contenders:
        return None
    return min(contenders, key=lambda lease: (lease.since, lease.peer_id)).peer_id


def _rank(me: str, epoch: int, shard: int) -> bytes:
    return hashlib.sha256(f"{me}/{epoch}/{shard}".encode()).digest()


def choose_shard(position: DataPosition, leases: Iterable[Lease], me: str) -> int | None:
    """The shard `me` should lease next, or None when every shard not done is leased by another.

    Begun shards first (a crashed or departed driver's, lowest index first): the epoch's tail is
    then as short as it can be. Among untouched shards, each driver ranks them by a hash of its
    peer id, so drivers starting at once rarely reach for the same one."""
    taken = {lease.shard for lease in leases if lease.peer_id != me}
    free = [k for k in range(position.n_shards) if k not in position.done and k not in taken]
    if not free:
        return None
    begun = [k for k in free if position.offsets.get(k, 0) > 0]
    if begun:
        return min(begun)
    return min(free, key=lambda k: _rank(me, position.epoch, k))


def epoch_complete(position: DataPosition) -> bool:
    """Every shard of the epoch is done: the next epoch may start."""
    return position.complete


def _shard_count(raw: list[tuple[str, Any]]) -> int | None:
    """The number of shards most records name (the streaming path's count comes from the corpus,
    which a reader without it, a coordinator or `swarmgrad status`, does not list)."""
    counts = [v.get("shards") for _, v in raw if isinstance(v, Mapping) and _count(v.get("shards"))]
    return max(set(counts), key=lambda n: (counts.count(n), -n)) if counts else None


def swarm_position(raw: Iterable[tuple[str, Any]], n_shards: int | None = None) -> DataPosition | None:
    """The data position the raw records (peer id, value) publish together, or None when none
    parses: what a coordinator's checkpoint keeps. `n_shards` None: the count most records name."""
    raw = list(raw)
    n_shards = n_shards if n_shards is not None else _shard_count(raw)
    if n_shards is None:
        return None
    records = [r for r in (parse_record(p, v, n_shards) for p, v in raw) if r is not None]
    return merge_position(DataPosition(n_shards), records) if records else None


def swarm_data(raw: Iterable[tuple[str, Any]], n_shards: int | None, now: float) -> dict[str, Any] | None:
    """The swarm's data position and live leases as `swarmgrad status` shows them, from the raw
    records (peer id, value); `n_shards` from the manifest, or (None) the count most records name.
    None when no driver leases shards."""
    raw = list(raw)
    n_shards = n_shards if n_shards is not None else _shard_count(raw)
    if n_shards is None:
        return None
    records = [r for r in (parse_record(p, v, n_shards) for p, v in raw) if r is not None]
    if not records:
        return None
    position = merge_position(DataPosition(n_shards), records)
    leases = sorted(live_leases(records, position.epoch, now), key=lambda lease: lease.shard)
    return {"epoch": position.epoch, "shards": n_shards, "done": len(position.done), "begun": len(position.offsets),
            "windows_claimed": sum(position.offsets.values()),
            "leases": [{"peer_id": lease.peer_id, "shard": lease.shard, "claimed": lease.claimed,
                        "expires_in": round(lease.until - now, 1)} for lease in leases]}
