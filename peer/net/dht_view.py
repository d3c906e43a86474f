"""Swarm state in the DHT: who serves which stage, the run's clock, round registrations.

Keys (all under the run id, so runs never see each other's records):
  {run}/stage/{s}          subkey peer id -> PeerRecord as a dict   (expires: timeouts.announce_ttl)
  {run}/epoch              subkey peer id -> the run's time origin for wall-clock rounds, as
                           that peer believes it (the swarm's epoch is the value most announce)
  {run}/round/{s}/{r}      subkey peer id -> registration for round r of stage s
  {run}/round/{s}/{r}/check  subkey peer id -> digest of the mean that peer decoded
  {run}/round/{s}/{r}/abandoned  subkey peer id -> its group's hash: it failed round r, did not
                           apply it and never will (it re-syncs; peer/state/sync.py)
  {run}/data               subkey peer id -> a driver's data position and shard lease
                           (peer/shards/leases.py parses it; expires: DATA_TTL)
Every subkey is its writer's peer id and every value is signed by it: the DHT is built with
`record_signing.SignedRecordValidator`, which refuses (on store and on get) a record whose
signature is not the subkey's peer's, and any expiry beyond MAX_RECORD_TTL. Writes here clamp
their TTL to it; reads also drop entries that expire later than twice their kind's TTL (the
validator cannot tell kinds apart), so a peer that vanished stays a ghost for 2 TTLs at most.
Values are small dicts (hivemind's pipe breaks on values over ~16 KiB). Every record read back
is validated; a malformed record or one of another manifest is dropped.

Every read and write has the view's deadline and raises `SwarmUnavailable` (peer/net/errors.py)
when the network fails it; any other exception is a bug and propagates.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter
from typing import Any, Callable, Iterable

from hivemind import DHT
from hivemind.utils import get_dht_time

from swarmgrad.peer.net.errors import SwarmUnavailable, dht_call
from swarmgrad.peer.net.identity import is_peer_id
from swarmgrad.peer.net.record_signing import MAX_CLOCK_SKEW, MAX_RECORD_TTL
from swarmgrad.peer.net.vouchers import OwnVoucher, VoucherBook, run_fingerprint
from swarmgrad.peer.records import PeerRecord, round_key, stage_key
from swarmgrad.protocol.framing import ProtocolError
from swarmgrad.protocol.records import validate_registration

logger = logging.getLogger(__name__)

EPOCH_TTL = MAX_RECORD_TTL
"""Each peer's epoch entry; the heartbeat refreshes it, so the epoch lives while anyone runs."""
DATA_TTL = MAX_RECORD_TTL
"""A driver's data record: it carries the data position, which should outlive its writer (its
lease expires by the time written inside it, not by the record's expiry)."""
READ_TTL_FACTOR = 2.0
"""Entries expiring later than now + this x their kind's TTL are ignored (a pinned ghost)."""


def agreed_epoch(epochs: Iterable[float]) -> float | None:
    """The epoch most writers announce; ties go to the earliest. None if there is none.

    Honest peers copy the epoch they read, so they all announce one value; a stranger announcing
    another (an earlier one would shift every joiner's rounds) is outvoted unless it outnumbers
    them. Two peers that open a swarm at once each write their own `now`, read both back and
    agree on the earlier one (a tie)."""
    counts = Counter(epochs)
    if not counts:
        return None
    return min(counts, key=lambda e: (-counts[e], e))


class SwarmView:
    """The peer's window on the DHT: typed reads and writes, each with a deadline (`timeout`),
    each raising SwarmUnavailable when the network fails it.

    `dht` must be built with `record_signing.SignedRecordValidator` (holding this peer's key for
    a peer that writes), like every other DHT of the swarm; see the module docstring."""

    def __init__(self, dht: DHT, run_id: str, manifest_hash: str, n_stages: int, timeout: float, ttl: float):
        self.dht = dht
        self.run_id = run_id
        self.manifest_hash = manifest_hash
        self.n_stages = n_stages
        self.timeout = timeout
        self.ttl = ttl
        self._peer_id: str | None = None
        self.admitted: Callable[[str, int], bool] | None = None
        """Private runs: Admission.admitted(peer id, stage); stage records and round registrations
        of peers it refuses (revoked, expired, or certified for another stage) are ignored, so
        nobody routes to or averages with them."""
        self.vouchers: VoucherBook | None = VoucherBook(run_id, manifest_hash) if run_fingerprint(run_id) else None
        """Public runs: the vouchers of the records read, checked against the run's owner key (the
        fingerprint in the run id; peer/net/vouchers.py); a record whose voucher holds is read as
        `vouched` (an anchor, peer/evidence.py). Private runs have none (admission decides)."""
        self.own_voucher: OwnVoucher | None = None
        """The voucher announced with our own records (`swarmgrad peer --voucher`, `--owner-key`)."""

    @property
    def peer_id(self) -> str:
        """Our peer id: the subkey of everything we write (the validator signs only that)."""
        if self._peer_id is None:
            self._peer_id = str(self.dht.peer_id)
        return self._peer_id

    @property
    def _round_ttl(self) -> float:
        return self.ttl * 4

    async def _store(self, key: str, subkey: str, value: Any, ttl: float) -> bool:
        """Store our entry under `key`. Raises ValueError for another peer's subkey: nobody would
        accept it (the validator signs only our own)."""
        if subkey != self.peer_id:
            raise ValueError(f"a peer writes only its own entries ({subkey} is not {self.peer_id})")
        ttl = min(ttl, MAX_RECORD_TTL)  # other peers refuse anything longer
        stored = await dht_call(f"storing {key}", lambda: self.dht.store(
            key, value, get_dht_time() + ttl, subkey=subkey, return_future=True), self.timeout)
        return bool(stored)

    async def _get(self, key: str) -> Any:
        found = await dht_call(f"reading {key}", lambda: self.dht.get(key, latest=True, return_future=True),
                               self.timeout)
        return None if found is None else found.value

    async def _entries(self, key: str, ttl: float) -> list[tuple[str, Any]]:
        return signed_entries(await self._get(key), ttl, key)

    async def announce(self, record: PeerRecord) -> bool:
        if self.own_voucher is not None and record.peer_id == self.peer_id:
            record = dataclasses.replace(record, voucher=self.own_voucher.current(get_dht_time()))
        return await self._store(stage_key(self.run_id, record.stage), record.peer_id, record.to_value(), self.ttl)

    async def stage_records(self, stage: int) -> list[PeerRecord]:
        """Live replicas of `stage` that run our manifest (any manifest, for a view built without
        one, as `swarmgrad status --run-id` does), sorted by peer id."""
        records = []
        for peer_id, value in await self._entries(stage_key(self.run_id, stage), self.ttl):
            record = PeerRecord.from_value(peer_id, value)
            if record is None or record.stage != stage:
                logger.debug("dropped a malformed record under stage %d from %s", stage, peer_id)
            elif self.admitted is not None and not self.admitted(peer_id, stage):
                logger.debug("ignored the record of %s under stage %d: not admitted", peer_id[-8:], stage)
            elif not self.manifest_hash or record.manifest_hash == self.manifest_hash:
                records.append(record)
        return sorted(self._mark_vouched(records), key=lambda r: r.peer_id)

    def _mark_vouched(self, records: list[PeerRecord]) -> list[PeerRecord]:
        """`records`, those whose voucher holds marked `vouched` (none in a private run)."""
        if self.vouchers is None or not any(r.voucher for r in records):
            return records
        vouched = self.vouchers.vouched([(r.peer_id, r.voucher) for r in records], get_dht_time())
        return [dataclasses.replace(r, vouched=True) if r.peer_id in vouched else r for r in records]

    async def swarm(self) -> dict[int, list[PeerRecord]]:
        results = await asyncio.gather(*(self.stage_records(s) for s in range(self.n_stages)))
        return dict(enumerate(results))

    async def epochs(self) -> dict[str, float]:
        """Each writer's epoch: finite, positive, and not later than now (+ clock skew): a start
        in the future is nobody's."""
        latest = get_dht_time() + MAX_CLOCK_SKEW
        out = {}
        for peer_id, value in await self._entries(self._epoch_key, EPOCH_TTL):
            if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= latest:
                out[peer_id] = float(value)
        return out

    async def epoch(self, origin: float | None = None) -> float:
        """The run's time origin (`agreed_epoch` over the signed entries; in a public run where any
        anchor, a peer the owner vouches for, wrote one, over the anchors' entries only). If nobody has set one,
        we write `origin` (default: now) and read back, so peers that start together agree. A
        swarm resuming from round R passes now − R·round_seconds, so its wall clock goes on at
        round R instead of making the restored replicas wait R rounds for a fresh clock."""
        epochs = await self.epochs()
        if not epochs:
            now = float(get_dht_time())
            await self.refresh_epoch(now if origin is None or not 0 < origin <= now else float(origin))
            epochs = await self.epochs()
        anchors = await self._anchors() if self.vouchers is not None and epochs else set()
        if anchors & set(epochs):  # the owner's word over any number of ids (docs/trust.md, "Epoch")
            epochs = {p: e for p, e in epochs.items() if p in anchors}
        found = agreed_epoch(epochs.values())
        if found is None:  # our write was stored nowhere, or its read found nothing
            raise SwarmUnavailable(f"{self._epoch_key}: could not read or set the run's epoch in the DHT")
        return found

    async def _anchors(self) -> set[str]:
        """The vouched peers with a record under any stage (peer/net/vouchers.py)."""
        return {r.peer_id for records in (await self.swarm()).values() for r in records if r.vouched}

    @property
    def _epoch_key(self) -> str:
        return f"{self.run_id}/epoch"

    async def refresh_epoch(self, epoch: float) -> bool:
        """(Re)store our entry for the run's time origin, so it outlives any one peer while anyone runs."""
        return await self._store(self._epoch_key, self.peer_id, epoch, EPOCH_TTL)

    async def register_round(self, stage: int, round_no: int, peer_id: str, value: dict[str, Any]) -> bool:
        return await self._store(round_key(self.run_id, stage, round_no), peer_id, value, self._round_ttl)

    async def round_registrations(self, stage: int, round_no: int) -> dict[str, dict[str, Any]]:
        """Registrations for a round, each checked (protocol.records.validate_registration); bad
        ones are dropped, so a malformed value cannot make matchmaking raise."""
        out = {}
        for peer_id, value in await self._entries(round_key(self.run_id, stage, round_no), self._round_ttl):
            if self.admitted is not None and not self.admitted(peer_id, stage):
                logger.debug("ignored the registration of %s for stage %d: not admitted there", peer_id[-8:], stage)
                continue
            try:
                out[peer_id] = validate_registration(value).to_value()
            except ProtocolError as e:
                logger.debug("dropped a registration for stage %d round %d from %s: %s", stage, round_no, peer_id, e)
        return out

    async def post_check(self, stage: int, round_no: int, peer_id: str, digest: str) -> bool:
        """Post the digest of the mean this replica decoded in a round (the reducers' cross-check)."""
        return await self._store(f"{round_key(self.run_id, stage, round_no)}/check", peer_id, digest, self._round_ttl)

    async def round_checks(self, stage: int, round_no: int) -> dict[str, str]:
        return await self._short_strings(f"{round_key(self.run_id, stage, round_no)}/check")

    async def post_abandoned(self, stage: int, round_no: int, peer_id: str, group_hash: str) -> bool:
        """Say that this replica failed the round and did not apply it: the other members re-syncing
        from it need not wait for it to announce a later round (peer/state/sync.py)."""
        return await self._store(f"{round_key(self.run_id, stage, round_no)}/abandoned", peer_id, group_hash,
                                 self._round_ttl)

    async def round_abandoned(self, stage: int, round_no: int) -> dict[str, str]:
        return await self._short_strings(f"{round_key(self.run_id, stage, round_no)}/abandoned")

    @property
    def data_key(self) -> str:
        return f"{self.run_id}/data"

    async def publish_data(self, value: dict[str, Any]) -> bool:
        """Store our data record (a driver's position and lease, peer/shards/leases.py), tagged
        with our manifest's hash."""
        return await self._store(self.data_key, self.peer_id, {"manifest": self.manifest_hash, "record": value},
                                 DATA_TTL)

    async def data_records(self) -> list[tuple[str, Any]]:
        """(peer id, value) of the drivers' data records of our manifest (any manifest, for a view
        built without one) from admitted peers; the values are parsed by peer/shards/leases.py."""
        out = []
        for peer_id, value in await self._entries(self.data_key, DATA_TTL):
            if not isinstance(value, dict) or "record" not in value:
                continue
            if self.admitted is not None and not self.admitted(peer_id):
                continue
            if not self.manifest_hash or value.get("manifest") == self.manifest_hash:
                out.append((peer_id, value["record"]))
        return out

    async def _short_strings(self, key: str) -> dict[str, str]:
        out = {}
        for peer_id, value in await self._entries(key, self._round_ttl):
            if isinstance(value, str) and len(value) <= 64:
                out[peer_id] = value
        return out


def signed_entries(raw: Any, ttl: float, key: str = "") -> list[tuple[str, Any]]:
    """(peer id, value) of each entry of a DHT dictionary value whose subkey is a peer id (the
    validator checked that its peer signed it) and whose expiry is at most READ_TTL_FACTOR x `ttl`
    from now. A plain value, or any other subkey, is skipped. Every reader of peer-written entries
    (this view, peer/private/admission.py) goes through here."""
    if not isinstance(raw, dict):
        return []
    latest = get_dht_time() + READ_TTL_FACTOR * min(ttl, MAX_RECORD_TTL)
    out = []
    for subkey, item in raw.items():
        expiration = getattr(item, "expiration_time", None)
        if not is_peer_id(subkey) or not isinstance(expiration, (int, float)) or not expiration <= latest:
            logger.debug("ignored an entry under %s from %.16s: not a peer id or expires too late", key, subkey)
            continue
        out.append((subkey, getattr(item, "value", None)))
    return out
