"""A loopback at the level of `FramedRPC.call` for tests of one component's handlers (the
averager's reducers): requests and responses are serialised and parsed as on the wire, a
ProtocolError raised by a handler becomes a refusal as FramedRPC makes it, and a test can swap a
peer's handler (a two-faced reducer, a lost answer) or mark a peer dead. Whole peers run over the
stream-level transport instead (tests/support/transport.py), where the real FramedRPC frames them."""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from swarmgrad.peer.net.rpc import RPCFailed
from swarmgrad.protocol.framing import ProtocolError

Handler = Callable[[Any, str], Awaitable[Any]]

DEAD_PEER_WAIT_S = 0.2
"""How long a call to or from a dead peer takes to fail (a dial that gets no answer)."""


class LoopbackNetwork:
    """The peers' handlers by peer id (one method: each test wires the one it exercises)."""

    def __init__(self) -> None:
        self.handlers: dict[str, Handler] = {}
        self.dead: set[str] = set()

    def rpc(self, me: str) -> "LoopbackRPC":
        return LoopbackRPC(self, me)


class LoopbackRPC:
    """One peer's side: `call` and `connected`, as the averager uses FramedRPC."""

    def __init__(self, net: LoopbackNetwork, me: str):
        self.net, self.me = net, me

    async def connected(self) -> set[str]:
        """As a p2p daemon lists its connections: a dead peer's are gone."""
        return set() if self.me in self.net.dead else {p for p in self.net.handlers if p not in self.net.dead}

    async def call(self, peer: str, method: str, request: Any, response_type: type, timeout: float) -> Any:
        if peer in self.net.dead or self.me in self.net.dead:
            await asyncio.sleep(min(timeout, DEAD_PEER_WAIT_S))
            raise RPCFailed(f"{method} to {peer}: unreachable")
        wire = type(request).FromString(request.SerializeToString())
        try:
            resp = await asyncio.wait_for(self.net.handlers[peer](wire, self.me), timeout)
        except asyncio.TimeoutError:
            raise RPCFailed(f"{method} to {peer} timed out") from None
        except ProtocolError as e:
            resp = response_type(status=e.status, reason=e.reason)
        return response_type.FromString(resp.SerializeToString())
