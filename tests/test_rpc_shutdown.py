"""A stream cancelled while its handler runs (what a peer's shutdown does to the streams it
serves) ends quietly: real hivemind P2P daemons on 127.0.0.1, in one process."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest
from hivemind.p2p import P2P

from swarmgrad.peer.net.dht_process import remove_dead_sockets
from swarmgrad.peer.net.rpc import FramedRPC, RPCFailed, Traffic
from swarmgrad.protocol import wire_pb2 as pb

pytestmark = pytest.mark.timeout(90)


def test_a_stream_cancelled_mid_handler_ends_without_an_asyncio_error(p2p_daemons: None) -> None:
    async def scenario() -> tuple[list[dict], BaseException | None]:
        loop = asyncio.get_running_loop()
        reported: list[dict] = []
        loop.set_exception_handler(lambda _loop, context: reported.append(context))
        server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        client = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                  initial_peers=[str(a) for a in await server.get_visible_maddrs()])
        try:
            entered, serving = asyncio.Event(), []

            async def stuck(request: pb.StateRequest, peer) -> pb.StateResponse:
                serving.append(asyncio.current_task())
                entered.set()
                await asyncio.Event().wait()  # until cancelled
                raise AssertionError("unreachable")

            rpc = FramedRPC(server, "test-shutdown", Traffic(), max_message_bytes=1 << 20)
            await rpc.add_handler("state", pb.StateRequest, stuck,
                                  lambda status, reason: pb.StateResponse(status=status, reason=reason))
            caller = FramedRPC(client, "test-shutdown", Traffic(), max_message_bytes=1 << 20)
            call = asyncio.create_task(caller.call(server.peer_id, "state", pb.StateRequest(), pb.StateResponse,
                                                   timeout=30))
            await asyncio.wait_for(entered.wait(), 30)
            serving[0].cancel()  # as the loop's shutdown cancels every task it still has
            failure: BaseException | None = None
            try:
                await asyncio.wait_for(call, 30)
            except RPCFailed as e:  # the caller learns its stream ended
                failure = e
            await asyncio.sleep(0.5)  # asyncio's done-callback of the cancelled stream runs here
            return reported, failure
        finally:
            await client.shutdown()
            await server.shutdown()

    reported, failure = asyncio.run(scenario())
    assert not reported, [c.get("message") for c in reported]
    assert failure is not None, "the call cannot succeed: its handler never answered"
    # said as what it is (nothing came back), not as a malformed answer
    assert "no answer, the stream ended" in str(failure) and "bad response" not in str(failure), failure


def test_a_peer_whose_daemon_was_killed_is_no_longer_connected(p2p_daemons: None) -> None:
    """outcome.agree stops waiting for the vote of a member we hold no connection to: the p2p daemon
    of a SIGKILLed peer resets its sockets, so ours drops it (FramedRPC.connected) within moments."""
    async def scenario() -> tuple[bool, bool]:
        began = time.time()
        server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        client = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                  initial_peers=[str(a) for a in await server.get_visible_maddrs()])
        try:
            async def state(request: pb.StateRequest, peer) -> pb.StateResponse:
                return pb.StateResponse(status=pb.OK)

            rpc = FramedRPC(server, "test-connected", Traffic(), max_message_bytes=1 << 20)
            await rpc.add_handler("state", pb.StateRequest, state,
                                  lambda status, reason: pb.StateResponse(status=status, reason=reason))
            caller = FramedRPC(client, "test-connected", Traffic(), max_message_bytes=1 << 20)
            await caller.call(server.peer_id, "state", pb.StateRequest(), pb.StateResponse, timeout=30)
            before = str(server.peer_id) in await caller.connected()
            os.kill(server._child.pid, signal.SIGKILL)  # the daemon dies as a killed peer's does
            deadline = time.monotonic() + 20
            while str(server.peer_id) in await caller.connected() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return before, str(server.peer_id) in await caller.connected()
        finally:
            await client.shutdown()
            with contextlib.suppress(Exception):
                await server.shutdown()
            remove_dead_sockets(began)  # a SIGKILLed daemon leaves its control socket

    before, after = asyncio.run(scenario())
    assert before, "a peer we just called is connected"
    assert not after, "the killed peer's connection is gone"
