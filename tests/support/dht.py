"""An in-memory DHT with the part of hivemind's `DHT` interface that `SwarmView` uses (`peer_id`,
`store`, `get`), so the real view (peer/net/dht_view.py: record parsing, TTL clamps, the epoch
vote, registration checks) runs over it unchanged.

What the swarm's DHT guarantees and this one keeps:
- dictionary values: each entry is under a subkey, and a node stores only under its own peer id
  (the real swarm's `SignedRecordValidator` refuses any other: the store returns False);
- expiry: an entry is not returned after its expiration time, and one expiring more than
  MAX_RECORD_TTL (+ clock skew) from now is refused, as the validator does;
- a subkey keeps the entry with the latest expiration (a store expiring earlier returns False);
- values go through the DHT's serializer (hivemind's MSGPackSerializer) as on the wire.
Nothing is delayed: every read sees every store before it. `unreachable` makes one node's
reads and stores fail as a DHT whose peers do not answer does (asyncio.TimeoutError)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from hivemind.utils import MSGPackSerializer, ValueWithExpiration, get_dht_time

from swarmgrad.peer.manifest import Manifest
from swarmgrad.peer.net.dht_view import SwarmView
from swarmgrad.peer.net.record_signing import MAX_CLOCK_SKEW, MAX_RECORD_TTL
from swarmgrad.peer.records import ONLINE, PeerRecord


@dataclass
class _Entry:
    packed: bytes
    expiration: float


@dataclass
class MemoryDHT:
    """The records of one in-process swarm: key -> subkey -> entry, shared by every node."""
    records: dict[str, dict[str, _Entry]] = field(default_factory=dict)
    unreachable: set[str] = field(default_factory=set)
    """Peer ids whose DHT calls fail (their node cannot reach the swarm)."""
    _stored: list[asyncio.Future] = field(default_factory=list)

    async def next_store(self) -> None:
        """Return after the next accepted store (a test waits for a write instead of polling)."""
        future = asyncio.get_running_loop().create_future()
        self._stored.append(future)
        await future

    def _notify(self) -> None:
        waiting, self._stored = self._stored, []
        for future in waiting:
            if not future.done():
                future.set_result(None)

    def node(self, peer_id: str) -> "MemoryDHTNode":
        return MemoryDHTNode(self, peer_id)

    def forget(self, peer_id: str) -> None:
        """Drop every entry `peer_id` wrote, as if each had expired."""
        for entries in self.records.values():
            entries.pop(peer_id, None)

    def entries(self, key: str) -> dict[str, ValueWithExpiration]:
        """The live entries under `key` (subkey -> value with expiration)."""
        now = get_dht_time()
        live = {}
        for subkey, entry in list(self.records.get(key, {}).items()):
            if entry.expiration <= now:
                del self.records[key][subkey]
                continue
            live[subkey] = ValueWithExpiration(MSGPackSerializer.loads(entry.packed), entry.expiration)
        return live


class MemoryDHTNode:
    """One peer's handle on a MemoryDHT, standing in for its `hivemind.DHT`."""

    def __init__(self, dht: MemoryDHT, peer_id: str):
        self.memory = dht
        self.peer_id = peer_id

    def _done(self, result: Any) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        if self.peer_id in self.memory.unreachable:
            future.set_exception(asyncio.TimeoutError(f"{self.peer_id[-8:]} cannot reach the DHT"))
        else:
            future.set_result(result)
        return future

    def store(self, key: str, value: Any, expiration_time: float, subkey: str | None = None,
              return_future: bool = False) -> asyncio.Future:
        assert return_future, "SwarmView awaits its stores"
        if self.peer_id in self.memory.unreachable:
            return self._done(False)  # fails: no peer of the swarm answered
        if subkey != self.peer_id or expiration_time > get_dht_time() + MAX_RECORD_TTL + MAX_CLOCK_SKEW:
            return self._done(False)  # the signing validator refuses it on every peer
        entries = self.memory.records.setdefault(key, {})
        old = entries.get(subkey)
        if old is not None and expiration_time <= old.expiration:
            return self._done(False)  # the stored entry is newer
        entries[subkey] = _Entry(MSGPackSerializer.dumps(value), float(expiration_time))
        self.memory._notify()
        return self._done(True)

    def get(self, key: str, latest: bool = False, return_future: bool = False) -> asyncio.Future:
        assert return_future, "SwarmView awaits its reads"
        live = self.memory.entries(key)
        if not live:
            return self._done(None)
        return self._done(ValueWithExpiration(live, max(v.expiration_time for v in live.values())))


def swarm_view(dht: MemoryDHT, peer_id: str, manifest: Manifest) -> SwarmView:
    """`peer_id`'s SwarmView of the run over `dht` (as a Peer of `manifest` builds it)."""
    return SwarmView(dht.node(peer_id), manifest.run_id, manifest.hash, manifest.stages.count,
                     manifest.timeouts.dht, manifest.timeouts.announce_ttl)


async def announce(view: SwarmView, stage: int, *, state: str = ONLINE, applied_rounds: int = 0,
                   digest: str = "digest", round_no: int = 0, driver: bool = False) -> None:
    """Store the record of `view`'s peer as a replica of `stage` (what its Presence would)."""
    stored = await view.announce(PeerRecord(peer_id=view.peer_id, stage=stage, state=state, throughput=1.0, round=round_no,
                                            applied_rounds=applied_rounds, digest=digest,
                                            manifest_hash=view.manifest_hash, driver=driver))
    assert stored, f"the record of {view.peer_id} was refused"
