"""The fakes the in-process tests stand on (tests/support/): the in-memory DHT keeps the swarm
DHT's guarantees under the real SwarmView, and the loopback transport carries the real FramedRPC
with its links' delay and bandwidth, resets a killed peer's streams and lists connections."""
from __future__ import annotations

import asyncio
import time

import pytest
from hivemind.utils import get_dht_time

from swarmgrad.peer.net.record_signing import MAX_RECORD_TTL
from swarmgrad.peer.net.rpc import FramedRPC, RPCFailed, Traffic
from swarmgrad.protocol import wire_pb2 as pb

from conftest import small_manifest
from support.dht import MemoryDHT, announce, swarm_view
from support.swarm import peer_ids
from support.transport import LinkSpec, LoopbackNet

pytestmark = pytest.mark.timeout(30)

A, B, C = peer_ids(3, "support")


def refusal(status: int, reason: str) -> pb.StateResponse:
    return pb.StateResponse(status=status, reason=reason)


# the in-memory DHT under the real SwarmView ---------------------------------------------------------
def test_a_peer_writes_only_its_own_entries_and_every_peer_reads_them(inprocess) -> None:
    async def scenario() -> None:
        m, dht = small_manifest(), MemoryDHT()
        a, b = swarm_view(dht, A, m), swarm_view(dht, B, m)
        await announce(a, 1, applied_rounds=3)
        assert [(r.peer_id, r.applied_rounds) for r in await b.stage_records(1)] == [(A, 3)]
        with pytest.raises(ValueError):  # the view refuses to write for another peer...
            await a.register_round(1, 0, B, {"digest": "d", "applied_rounds": 0, "weight": 1.0})
        # ...and the DHT refuses it as every peer's record signer would
        assert await dht.node(A).store("k", 1, get_dht_time() + 5, subkey=B, return_future=True) is False
        assert await dht.node(A).store("k", 1, get_dht_time() + MAX_RECORD_TTL + 120, subkey=A,
                                       return_future=True) is False
        assert await b.epoch() == await a.epoch()  # the first to ask sets it, the other reads it
        await a.register_round(1, 0, A, {"digest": "d", "applied_rounds": 0, "weight": 2.0})
        assert (await b.round_registrations(1, 0))[A]["weight"] == 2.0

    inprocess(scenario)


def test_entries_expire_and_an_unreachable_node_times_out(inprocess) -> None:
    async def scenario() -> None:
        dht = MemoryDHT()
        node = dht.node(A)
        assert await node.store("k", (1, 2), get_dht_time() + 0.2, subkey=A, return_future=True)
        found = await node.get("k", latest=True, return_future=True)
        assert found.value[A].value == (1, 2)  # through the DHT's serializer, as over the wire
        assert not await node.store("k", (3,), get_dht_time() + 0.1, subkey=A, return_future=True)  # expires sooner
        assert (await node.get("k", latest=True, return_future=True)).value[A].value == (1, 2)
        await asyncio.sleep(0.25)  # the entry's lifetime: a wall-clock expiry, no event marks it
        assert await node.get("k", latest=True, return_future=True) is None
        dht.unreachable.add(A)
        with pytest.raises(asyncio.TimeoutError):
            await node.get("k", latest=True, return_future=True)

    inprocess(scenario)


# the loopback transport under the real FramedRPC -----------------------------------------------------
async def serving(net: LoopbackNet, peer: str, entered: asyncio.Event | None = None) -> FramedRPC:
    """`peer` answers "state" with the caller's id; with `entered`, it sets that and never answers."""
    async def handle(request: pb.StateRequest, caller) -> pb.StateResponse:
        if entered is not None:
            entered.set()
            await asyncio.Event().wait()
        return pb.StateResponse(status=pb.OK, reason=str(caller)[-8:])

    rpc = FramedRPC(net.node(peer), "test", Traffic(), max_message_bytes=1 << 22, drain_timeout=0.5)
    await rpc.add_handler("state", pb.StateRequest, handle, refusal)
    return rpc


def test_framed_calls_cross_the_loopback_and_a_link_paces_them(inprocess) -> None:
    async def scenario() -> None:
        net = LoopbackNet()
        await serving(net, A)
        caller = FramedRPC(net.node(B), "test", Traffic(), max_message_bytes=1 << 22)
        resp = await caller.call(A, "state", pb.StateRequest(), pb.StateResponse, timeout=5)
        assert resp.status == pb.OK and resp.reason == B[-8:]  # the server saw who called
        assert await caller.connected() == {A}
        with pytest.raises(RPCFailed, match="not supported"):
            await caller.call(A, "nothing", pb.StateRequest(), pb.StateResponse, timeout=5)
        # 200 kB up a 1 MB/s link with 50 ms each way: at least 0.2 s + the stream's round trip
        net.set_link(B, A, LinkSpec(delay=0.05, bandwidth=1e6))
        big = pb.StateRequest(envelope=pb.Envelope(run_id="x" * 200_000))
        started = time.monotonic()
        await caller.call(A, "state", big, pb.StateResponse, timeout=10)
        took = time.monotonic() - started
        assert net.link(B, A).sent > 200_000
        assert took >= 0.2 + 0.1 + 0.05, took
        await net.close()

    inprocess(scenario)


def test_a_killed_peer_resets_its_streams_and_is_no_longer_connected(inprocess) -> None:
    async def scenario() -> None:
        net, entered = LoopbackNet(), asyncio.Event()
        await serving(net, A, entered)
        caller = FramedRPC(net.node(B), "test", Traffic(), max_message_bytes=1 << 22)
        call = asyncio.ensure_future(caller.call(A, "state", pb.StateRequest(), pb.StateResponse, timeout=10))
        await entered.wait()  # A is serving the call
        assert await caller.connected() == {A}
        net.kill(A)
        with pytest.raises(RPCFailed, match="no answer, the stream ended"):
            await call
        assert await caller.connected() == set()
        with pytest.raises(RPCFailed, match="failed to dial"):
            await caller.call(A, "state", pb.StateRequest(), pb.StateResponse, timeout=5)
        await net.close()

    inprocess(scenario)
