"""A peer behind NAT opens the connections itself.

libp2p keeps a connection usable in both directions, so once a NATed peer has dialled a public
peer, that peer's drivers, averaging parts, backups and state requests reach it directly over that
connection. Without it they go through the relay (peer/net/reachability.py), which costs the relay's
bandwidth twice, adds its latency, and was seen to cut a transfer in flight when the direct
connection replaced the relayed one (docs/nat.md). So a peer in `relay` or `client` mode dials, every
heartbeat, the peers of the run it may work with and has no connection to yet. Two NATed peers
cannot dial each other: between them the relay (and hole punching where the NATs allow) remains.

The same look keeps our DHT node in the swarm. A NATed peer's DHT runs in client mode: nobody
sends it requests, so its routing table is filled only by answers to its own, and hivemind drops a
node from it after one unanswered request. In a small swarm two transient failures empty the table
for good: every read then finds nothing (seen in tests/test_nat.py: the NATed replica stopped seeing
its partner's round registrations and averaged alone until the run ended). So each look also pings,
from inside the DHT process, the peers we are connected to or started from that are missing from
the table (`keep_in_routing_table`); an answer puts them back.

`dial_targets` is the pure choice; `DialOut` gathers the snapshot (the swarm's records, the
daemon's open connections) and dials, each dial under `timeouts.dht`.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, Callable, Iterable, Mapping, Sequence

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from swarmgrad.peer.net.deadline import within
from swarmgrad.peer.events import EventLog
from swarmgrad.peer.net.dht_view import SwarmView
from swarmgrad.peer.net.errors import P2P_FAILURES, LoopSteps, RPCFailed, dht_call
from swarmgrad.peer.records import LEAVING, PeerRecord

logger = logging.getLogger(__name__)

MAX_DIALS = 64
"""Connections one NATed peer keeps open on its own initiative: its stage, its neighbours, the
drivers first. A NAT's mapping table and the peers' connection managers are finite."""


def dial_targets(records: Mapping[int, Sequence[PeerRecord]], connected: Iterable[str], me: str,
                 my_stage: int | None, limit: int = MAX_DIALS) -> list[PeerRecord]:
    """The peers to dial now: those of the run with an address, not us, not LEAVING, not yet
    connected; own stage first, then the adjacent stages and drivers, then the rest, at most
    `limit` (counting the connections already open)."""
    open_ = set(connected)

    def rank(r: PeerRecord) -> int:
        if my_stage is None:
            return 0 if r.driver else 1
        if r.stage == my_stage:
            return 0
        if abs(r.stage - my_stage) == 1 or r.driver:
            return 1
        return 2

    seen: set[str] = set()
    candidates = []
    for recs in records.values():
        for r in recs:
            if r.peer_id == me or r.peer_id in seen or r.state == LEAVING or not r.maddrs:
                continue
            seen.add(r.peer_id)
            candidates.append(r)
    candidates.sort(key=lambda r: (rank(r), r.peer_id))
    room = max(0, limit - len(open_ & seen))
    return [r for r in candidates if r.peer_id not in open_][:room]


async def keep_in_routing_table(_dht: Any, node: Any, peer_ids: Sequence[str]) -> int:
    """Runs in the DHT process (`DHT.run_coroutine`): ping each of `peer_ids` that our routing table
    lacks, which adds it back when it answers. Returns how many were added."""
    from hivemind.p2p import PeerID  # the DHT process unpickles this function by name
    table = node.protocol.routing_table
    added = 0
    for peer_id in peer_ids:
        try:
            peer = PeerID.from_base58(peer_id)
        except ValueError:  # a malformed id in a record: nothing to ping
            continue
        if peer == node.peer_id or peer in table:
            continue
        if await node.protocol.call_ping(peer, validate=False, strict=False) is not None:
            added += 1
    return added


class DialOut:
    """Every `interval` seconds, connect to the peers `dial_targets` names. Owned by the peer
    daemon, which cancels `run()`; a failed dial is logged and retried at the next look."""

    def __init__(self, p2p: P2P, swarm: SwarmView, *, peer_id: str, stage: Callable[[], int | None],
                 interval: float, timeout: float, events: EventLog | None = None, dht: Any = None,
                 initial_peers: Sequence[str] = ()):
        """`stage`: the stage this peer serves now (it may move). `dht` (a hivemind DHT): keep the
        peers we are connected to, and `initial_peers` (their ids), in its routing table."""
        self.p2p = p2p
        self.dht = dht
        self.initial_peers = tuple(initial_peers)
        self.rejoined = 0
        """Peers put back into the DHT's routing table so far."""
        self.events = events
        self.swarm = swarm
        self.peer_id = peer_id
        self.stage = stage
        self.interval = interval
        self.timeout = timeout
        self.dialled = 0
        """Connections opened so far (for the log and tests)."""

    async def step(self) -> int:
        """One look: dial whom `dial_targets` names; returns how many connections it opened. Raises
        SwarmUnavailable or RPCFailed (or TimeoutError) when the swarm or the daemon does not answer."""
        records = await self.swarm.swarm()
        try:
            peers = await within(self.p2p.list_peers(), self.timeout)
        except P2P_FAILURES as e:
            raise RPCFailed(f"listing connections: {type(e).__name__}: {e}") from e
        connected = [str(p.peer_id) for p in peers]
        opened: list[str] = []
        for r in dial_targets(records, connected, self.peer_id, self.stage()):
            try:
                # hivemind's P2P has no public connect(): its daemon client does the one call we need
                # (the daemon wants transport addresses: records carry them with a /p2p/<id> suffix)
                addrs = [Multiaddr(a.split("/p2p/")[0]) for a in r.maddrs]
                await within(self.p2p._client.connect(PeerID.from_base58(r.peer_id), addrs), self.timeout)
                opened.append(r.peer_id)
            except (ValueError, asyncio.TimeoutError, *P2P_FAILURES) as e:
                # unreachable (another NATed peer), gone, or a bad address in its record (ValueError)
                logger.debug("dial-out to %s failed: %s: %s", r.peer_id[-8:], type(e).__name__, e)
        if opened:
            logger.info("opened %d connection(s) to peers of the run (behind NAT, others reach us over them)",
                        len(opened))
            if self.events is not None:
                self.events.emit("dialled_out", peers=opened)
        self.dialled += len(opened)
        if self.dht is not None:
            await self._keep_dht_connected([*self.initial_peers, *connected, *opened])
        return len(opened)

    async def _keep_dht_connected(self, peer_ids: Sequence[str]) -> None:
        wanted = tuple(dict.fromkeys(p for p in peer_ids if p != self.peer_id))[:MAX_DIALS]
        if not wanted:
            return
        added = await dht_call("pinging peers missing from the DHT's routing table", lambda: self.dht.run_coroutine(
            functools.partial(keep_in_routing_table, peer_ids=wanted), return_future=True), self.timeout * 2)
        if added:
            logger.info("put %d peer(s) back into the DHT's routing table (client mode forgets unanswering "
                        "peers)", added)
            self.rejoined += added

    async def run(self) -> None:
        """Look every `interval` seconds until cancelled. A look the network fails is logged
        (`LoopSteps`); one that raises anything else is a bug, logged with its traceback, and the
        next look runs anyway: dialling out is an aid, and the peer works (relayed) without it."""
        steps = LoopSteps("dial-out", logger)
        while True:
            await steps.run("look", self.step)
            await asyncio.sleep(self.interval)
