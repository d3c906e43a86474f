"""A loopback transport with the part of hivemind's `P2P` interface that `FramedRPC` uses
(peer/net/rpc.py: `add_binary_stream_handler`, `remove_binary_stream_handler`,
`call_binary_stream_handler`, `list_peers`, `peer_id`), so the real framing, size limits,
deadlines and validation run over it, in one event loop.

Every directed link between two peers has a one-way delay and a bandwidth (`LinkSpec`; default:
instant). Bytes are delivered in order per stream; streams sharing a link share its bandwidth (a
chunk is scheduled when it is written, first come first served). A writer's `drain` waits while
more than HIGH_WATER bytes of its stream are on the link or unread at the other end, so a sender
is held back by a slow link or a slow reader as by a socket. `kill` ends a peer as SIGKILL ends its daemon: its streams reset (the
other side reads the end of the stream), its handlers go, and nobody is connected to it."""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Awaitable, Callable

from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import PeerInfo, StreamInfo
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils.multiaddr import Multiaddr

HIGH_WATER = 1 << 16
"""Bytes of one stream on its link, or unread by its reader, before its writer's drain waits (a
socket's buffers)."""
SLICE = 1 << 14
"""A paced write is cut into slices of this size, so a reader sees a big frame arrive gradually."""
ADDR = Multiaddr("/ip4/127.0.0.1/tcp/0")

StreamHandler = Callable[[StreamInfo, asyncio.StreamReader, "LoopbackWriter"], Awaitable[None]]


@dataclass(frozen=True)
class LinkSpec:
    delay: float = 0.0
    """One-way latency, seconds."""
    bandwidth: float = math.inf
    """Bytes per second."""

    @property
    def instant(self) -> bool:
        return self.delay <= 0 and math.isinf(self.bandwidth)


class _Link:
    """One direction between two peers: when each written chunk arrives."""

    def __init__(self, spec: LinkSpec):
        self.spec = spec
        self.busy_until = 0.0
        self.sent = 0
        """Bytes written onto this link (what the tests measure a link by)."""

    def arrival(self, nbytes: int, now: float) -> float:
        start = max(now, self.busy_until)
        self.busy_until = start + nbytes / self.spec.bandwidth
        self.sent += nbytes
        return self.busy_until + self.spec.delay


class _Pipe:
    """One direction of a stream. Written bytes reach `reader` at their link arrival time; closing
    delivers what is on the link, then the end of the stream; a reset drops it and ends at once."""

    def __init__(self, net: "LoopbackNet", link: _Link):
        self.net = net
        self.link = link
        # the reader pauses us (pause_reading) once it holds 2 x limit unread bytes
        self.reader = asyncio.StreamReader(limit=HIGH_WATER // 2)
        self.reader.set_transport(self)  # type: ignore[arg-type]
        self.closed = False
        self.reset_reason: str | None = None
        self.pending = 0
        """Bytes written and not yet delivered to the reader (on the link)."""
        self._paused = False
        self._queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        self._pump: asyncio.Task | None = None
        self._drained = asyncio.Event()
        self._drained.set()

    # the reader's view of us as its transport
    def pause_reading(self) -> None:
        self._paused = True
        self._update()

    def resume_reading(self) -> None:
        self._paused = False
        self._update()

    def _update(self) -> None:
        if self.reset_reason is not None or (not self._paused and self.pending <= HIGH_WATER):
            self._drained.set()
        else:
            self._drained.clear()

    def write(self, data: bytes) -> None:
        if self.reset_reason is not None:
            raise ConnectionResetError(self.reset_reason)
        if self.closed:
            raise ConnectionError("write on a closed stream")
        if not data:
            return
        if self.link.spec.instant and self._pump is None:
            self.link.sent += len(data)
            self.reader.feed_data(bytes(data))
            return
        loop = asyncio.get_running_loop()
        view = memoryview(bytes(data))
        for start in range(0, len(view), SLICE):
            piece = bytes(view[start:start + SLICE])
            self._queue.put_nowait((self.link.arrival(len(piece), loop.time()), piece))
            self.pending += len(piece)
        self._update()
        if self._pump is None:
            self._pump = self.net._own(self._deliver())

    async def drain(self) -> None:
        await self._drained.wait()
        if self.reset_reason is not None:
            raise ConnectionResetError(self.reset_reason)

    def close(self) -> None:
        if self.closed or self.reset_reason is not None:
            return
        self.closed = True
        if self._pump is None:
            self.reader.feed_eof()
        else:
            self._queue.put_nowait(None)

    def reset(self, reason: str) -> None:
        if self.reset_reason is not None:
            return
        self.reset_reason = reason
        if self._pump is not None:
            self._pump.cancel()
        self.pending = 0
        self._update()
        if not self.reader.at_eof():
            self.reader.feed_eof()

    async def _deliver(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            item = await self._queue.get()
            if item is None:
                self.reader.feed_eof()
                return
            arrival, piece = item
            wait = arrival - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)  # the link's transfer time: no event stands for it
            self.reader.feed_data(piece)
            self.pending -= len(piece)
            self._update()


class LoopbackWriter:
    """The writing end of a loopback stream, with the StreamWriter methods FramedRPC calls.
    Closing it ends both directions for this side, as closing a p2p stream socket does."""

    def __init__(self, out: _Pipe, into: _Pipe):
        self._out, self._in = out, into

    def write(self, data: bytes) -> None:
        self._out.write(data)

    async def drain(self) -> None:
        await self._out.drain()

    def close(self) -> None:
        self._out.close()

    def is_closing(self) -> bool:
        return self._out.closed or self._out.reset_reason is not None

    async def wait_closed(self) -> None:
        return None

    def can_write_eof(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default


class LoopbackNet:
    """The links and live peers of one in-process swarm. Owns every task it starts (stream
    handlers, paced deliveries); `close` cancels and awaits them."""

    def __init__(self, default: LinkSpec = LinkSpec()):
        self.default = default
        self.nodes: dict[str, LoopbackP2P] = {}
        self._specs: dict[tuple[str, str], LinkSpec] = {}
        self._links: dict[tuple[str, str], _Link] = {}
        self._tasks: set[asyncio.Task] = set()

    def node(self, peer_id: str) -> "LoopbackP2P":
        assert peer_id not in self.nodes or not self.nodes[peer_id].alive, f"{peer_id} is already on the net"
        self.nodes[peer_id] = node = LoopbackP2P(self, peer_id)
        return node

    def set_link(self, a: str, b: str, spec: LinkSpec, both_ways: bool = True) -> None:
        """The link from `a` to `b` (and back, unless both_ways is False), for streams opened from now."""
        for pair in [(a, b), (b, a)] if both_ways else [(a, b)]:
            self._specs[pair] = spec
            self._links.pop(pair, None)

    def link(self, a: str, b: str) -> _Link:
        if (a, b) not in self._links:
            self._links[(a, b)] = _Link(self._specs.get((a, b), self.default))
        return self._links[(a, b)]

    def kill(self, peer_id: str) -> None:
        """As SIGKILL to the peer's daemon: streams reset, handlers gone, no more connections."""
        node = self.nodes.get(peer_id)
        if node is not None:
            node._die()
        for other in self.nodes.values():
            other.connections.discard(peer_id)

    def _own(self, coro: Awaitable[None]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        for node in list(self.nodes.values()):
            node._die()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class LoopbackP2P:
    """One peer on a LoopbackNet, standing in for its `hivemind.P2P`."""

    def __init__(self, net: LoopbackNet, peer_id: str):
        self.net = net
        self.peer_id = PeerID.from_base58(peer_id)
        self.name = peer_id
        self.alive = True
        self.handlers: dict[str, StreamHandler] = {}
        self.connections: set[str] = set()
        """Peers a stream was opened with, either way (what a p2p daemon lists as connected)."""
        self._streams: set[tuple[_Pipe, _Pipe]] = set()

    async def add_binary_stream_handler(self, name: str, handler: StreamHandler, balanced: bool = False) -> None:
        self._check_alive()
        self.handlers[name] = handler

    async def remove_binary_stream_handler(self, name: str) -> None:
        self._check_alive()
        self.handlers.pop(name, None)

    async def list_peers(self) -> list[PeerInfo]:
        self._check_alive()
        return [PeerInfo(PeerID.from_base58(p), [ADDR]) for p in sorted(self.connections)]

    async def call_binary_stream_handler(self, peer_id: PeerID, handler_name: str
                                         ) -> tuple[StreamInfo, asyncio.StreamReader, LoopbackWriter]:
        self._check_alive()
        target = self.net.nodes.get(peer_id.to_base58())
        if target is None or not target.alive:
            raise P2PDaemonError(f"failed to dial {peer_id}: no route to the peer")
        there, back = self.net.link(self.name, target.name), self.net.link(target.name, self.name)
        if there.spec.delay + back.spec.delay > 0:
            await asyncio.sleep(there.spec.delay + back.spec.delay)  # opening a stream costs a round trip
            if not (self.alive and target.alive):
                raise P2PDaemonError(f"failed to dial {peer_id}: the connection was reset")
        handler = target.handlers.get(handler_name)
        if handler is None:
            raise P2PDaemonError(f"protocols not supported: [{handler_name}]")
        request, response = _Pipe(self.net, there), _Pipe(self.net, back)
        stream = (request, response)
        self._streams.add(stream)
        target._streams.add(stream)
        self.connections.add(target.name)
        target.connections.add(self.name)
        info = StreamInfo(self.peer_id, ADDR, handler_name)
        task = self.net._own(handler(info, request.reader, LoopbackWriter(response, request)))
        task.add_done_callback(lambda _: (self._streams.discard(stream), target._streams.discard(stream)))
        return StreamInfo(target.peer_id, ADDR, handler_name), response.reader, LoopbackWriter(request, response)

    def _check_alive(self) -> None:
        if not self.alive:
            raise P2PDaemonError("the daemon is gone")

    def _die(self) -> None:
        self.alive = False
        self.handlers.clear()
        self.connections.clear()
        for request, response in list(self._streams):
            request.reset("the peer's daemon is gone")
            response.reset("the peer's daemon is gone")
        self._streams.clear()
