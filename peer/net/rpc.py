"""Framed protobuf RPCs over hivemind's P2P layer, with byte counting, deadlines and limits.

Each RPC is one raw libp2p stream: the request is cut into length-prefixed frames
(protocol/framing.py), the handler's response comes back the same way. We do not use
hivemind's protobuf streams: they read a message's 8-byte length prefix and then that many
bytes before any check of ours runs. Here every frame's length is checked before it is read,
frames are counted, a request must arrive within `read_timeout`, and a remote peer may hold at
most `max_streams_per_peer` streams at once, so what a stranger can make us hold is bounded.

Handlers never raise across the wire: a ProtocolError becomes a refusal with its status and
reason, anything else becomes INTERNAL and is logged here, so a bad request costs the server
one log line and nothing else. A caller gets a response or RPCFailed for whatever the network or
the remote did; only a bug of ours raises anything else.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, TypeVar

from google.protobuf.message import Message
from hivemind.p2p import P2P, PeerID

from swarmgrad.peer.net.deadline import within
from swarmgrad.peer.net.errors import P2P_FAILURES, RPCFailed
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.framing import (MAX_FRAME_BYTES, STREAM_ENDED, ProtocolError, discard, encode_stream,
                                        read_stream_message, write_chunks)

logger = logging.getLogger(__name__)

Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)


TRAFFIC_KINDS = ("activations", "gradients", "averaging", "state", "other")
"""What a message carries, for byte counts: pipeline forward requests (activations) and their
answers (gradients), the rounds' reduce-scatter parts, state downloads and backups; "other" for a
method this table does not know."""


def traffic_kind(method: str, response: bool) -> str:
    """The kind of a request (response=False) or a response of `method`, one of TRAFFIC_KINDS.
    A refusal counts as the kind of the answer it replaces."""
    if method == "forward":
        return "gradients" if response else "activations"
    return {"average": "averaging", "state": "state", "put": "state", "get": "state"}.get(method, "other")


class LinkMeter:
    """This peer's measured transfer rate (bytes/s), from calls that moved at least `min_bytes`
    (state downloads, backups: big enough that latency does not dominate), as an EMA. What a
    move's switch time is computed with (peer/placement/rules.py: the gain must repay the download)."""

    def __init__(self, min_bytes: int = 1 << 20, alpha: float = 0.3):
        self.min_bytes = min_bytes
        self.alpha = alpha
        self.rate: float | None = None
        self.samples = 0

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes < self.min_bytes or not seconds > 0:
            return
        rate = nbytes / seconds
        self.rate = rate if self.rate is None else (1 - self.alpha) * self.rate + self.alpha * rate
        self.samples += 1

    def estimate(self, default: float) -> float:
        return self.rate if self.rate is not None else default


@dataclass
class Traffic:
    """Bytes of swarmgrad messages this peer sent and received (payload, not libp2p overhead),
    in all and by kind (TRAFFIC_KINDS). The by-kind dicts hold every kind from the start, so
    another thread (a metrics scrape) may read them while they are being added to."""
    sent: int = 0
    recv: int = 0
    sent_by_kind: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TRAFFIC_KINDS, 0))
    recv_by_kind: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TRAFFIC_KINDS, 0))
    link: LinkMeter = field(default_factory=LinkMeter)

    def add_sent(self, kind: str, n: int) -> None:
        self.sent += n
        self.sent_by_kind[kind] += n

    def add_recv(self, kind: str, n: int) -> None:
        self.recv += n
        self.recv_by_kind[kind] += n


@dataclass
class CallTiming:
    """When a call's bytes moved, for a caller that estimates its link (peer/pipeline/window.py).
    Filled in by `FramedRPC.call(timing=...)`; times are time.monotonic()."""
    started: float = 0.0
    """The stream was opened and the request began to be written."""
    sent: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once the whole request has been handed to the transport (or the call ended)."""
    first_byte: float = 0.0
    """The response's first frame arrived (0: none did)."""
    done: float = 0.0
    request_bytes: int = 0
    response_bytes: int = 0


REQUEST_READ_S: contextvars.ContextVar[float] = contextvars.ContextVar("request_read_s", default=0.0)
"""In a handler: seconds the request being served took to arrive, first frame to last (0: unknown)."""


def stage_namespace(run_id: str, stage: int) -> str:
    """Handlers of a stage replica live under their own namespace, so a peer that moves can serve
    its old and its new stage at once (make-before-break)."""
    return f"swarmgrad/{run_id}/stage{stage}"


class FramedRPC:
    """Serve and call framed RPCs under one namespace.

    Args:
        p2p: the hivemind P2P instance (its daemon carries the streams).
        namespace: prefix of the protocol names, e.g. "swarmgrad/<run_id>".
        traffic: counters this object adds to.
        max_message_bytes: the largest request or response accepted (pipeline.max_message_mb).
        read_timeout: seconds a remote has to deliver a whole request once its stream is open;
            after that the request is refused with DEADLINE_EXCEEDED.
        max_streams_per_peer: streams one remote peer may have open to us at once (all methods
            together); one more is refused with BUSY before any of it is read.
        max_streams: streams open to us from all peers together; one more is refused with BUSY.
        max_frames: frames accepted for one message (default: protocol.framing.max_frames_for).
        max_buffered_bytes: bytes of requests being read, from all streams together (default
            4 * max_message_bytes); a frame that would pass it is refused with BUSY, so many
            peers with one slow stream each cannot make us hold max_streams whole messages.
        drain_timeout: after refusing a request early, seconds spent reading and discarding what
            the caller still sends (at most max_message_bytes), so that it can read the refusal.
        gate: in a private run, `Admission.check` (peer/private/admission.py): given the caller's libp2p
            id as the transport authenticated it, None to serve it, or why not; the request is
            then refused with UNAUTHORIZED before any of it is read or counted.
    """

    def __init__(self, p2p: P2P, namespace: str, traffic: Traffic, max_message_bytes: int, *,
                 read_timeout: float = 60.0, max_streams_per_peer: int = 8, max_streams: int = 256,
                 max_frames: int | None = None, drain_timeout: float = 2.0,
                 max_buffered_bytes: int | None = None,
                 gate: Callable[[PeerID], Awaitable[str | None]] | None = None):
        self.p2p = p2p
        self.gate = gate
        self.namespace = namespace
        self.traffic = traffic
        self.max_message_bytes = max_message_bytes
        self.read_timeout = read_timeout
        self.max_streams_per_peer = max_streams_per_peer
        self.max_streams = max_streams
        self.max_frames = max_frames
        self.drain_timeout = drain_timeout
        self.max_buffered_bytes = 4 * max_message_bytes if max_buffered_bytes is None else max_buffered_bytes
        self.buffered_bytes = 0
        """Bytes of requests read so far by streams whose request is not yet parsed."""
        self._registered: list[str] = []
        self._open: dict[PeerID, int] = {}

    def _name(self, method: str) -> str:
        return f"{self.namespace}::{method}"

    @property
    def open_streams(self) -> int:
        return sum(self._open.values())

    async def _read(self, reader: asyncio.StreamReader, message_type: type[Req],
                    reserve: Callable[[int], None] | None = None) -> tuple[Req, int]:
        return await read_stream_message(reader, message_type, self.max_message_bytes, max_frames=self.max_frames,
                                         max_frame_bytes=MAX_FRAME_BYTES, reserve=reserve)

    async def _write(self, writer: asyncio.StreamWriter, message: Message, kind: str) -> None:
        chunks, size = encode_stream(message)
        await write_chunks(writer, chunks)
        self.traffic.add_sent(kind, size)

    # ------------------------------------------------------------------ serving

    async def add_handler(self, method: str, request_type: type[Req],
                          handler: Callable[[Req, PeerID], Awaitable[Message]],
                          refusal: Callable[[int, str], Message]) -> None:
        async def serve(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            logger.debug("%s stream from %s opened", method, str(info.peer_id)[-8:])
            try:
                await self._serve(method, request_type, handler, refusal, info.peer_id, reader, writer)
            except asyncio.CancelledError:
                # the peer's shutdown cancels its open streams. Nobody awaits this task (it is asyncio's
                # client_connected_cb), and on 3.11 a cancelled one makes asyncio log an ERROR with
                # a traceback per open stream (fixed in 3.12), so end it here, quietly
                logger.debug("%s stream from %s cancelled (shutting down)", method, str(info.peer_id)[-8:])
            except (ConnectionError, asyncio.IncompleteReadError, EOFError) as e:  # a caller gone mid-answer
                logger.debug("%s stream from %s ended: %s: %s", method, str(info.peer_id)[-8:], type(e).__name__, e)
            except Exception:  # our bug: the caller only sees its stream end, so say it here, loudly
                logger.exception("%s stream from %s failed", method, str(info.peer_id)[-8:])
            finally:
                writer.close()

        await self.p2p.add_binary_stream_handler(self._name(method), serve)
        self._registered.append(method)

    async def _serve(self, method: str, request_type: type[Req], handler: Callable[[Req, PeerID], Awaitable[Message]],
                     refusal: Callable[[int, str], Message], peer: PeerID,
                     reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        who = str(peer)[-8:]
        answer_kind = traffic_kind(method, response=True)
        if self._open.get(peer, 0) >= self.max_streams_per_peer or self.open_streams >= self.max_streams:
            logger.info("refused %s from %s: too many open streams", method, who)
            await self._write(writer, refusal(pb.BUSY, f"too many open streams (at most {self.max_streams_per_peer} "
                                                      f"per peer, {self.max_streams} in all)"), answer_kind)
            await self._drain(reader)
            return
        self._open[peer] = self._open.get(peer, 0) + 1
        held = 0

        def reserve(n: int) -> None:
            nonlocal held
            if self.buffered_bytes + n > self.max_buffered_bytes:
                raise ProtocolError(pb.BUSY, f"too many request bytes in flight (at most {self.max_buffered_bytes})")
            self.buffered_bytes += n
            held += n

        first_frame = 0.0

        def reserve_timed(n: int) -> None:
            nonlocal first_frame
            first_frame = first_frame or time.monotonic()
            reserve(n)

        try:
            if self.gate is not None:  # inside the stream count: a stranger's refused streams are bounded too
                why = await self.gate(peer)
                if why is not None:
                    logger.info("refused %s from %s: %s", method, who, why)
                    await self._write(writer, refusal(pb.UNAUTHORIZED, f"not admitted to this run: {why}"),
                                      answer_kind)
                    await self._drain(reader)
                    return
            try:
                request, size = await within(self._read(reader, request_type, reserve_timed), self.read_timeout)
            except asyncio.TimeoutError:
                error = ProtocolError(pb.DEADLINE_EXCEEDED, f"request not received within {self.read_timeout:g}s")
            except ProtocolError as e:
                error = e
            else:
                self.buffered_bytes -= held
                held = 0
                self.traffic.add_recv(traffic_kind(method, response=False), size)
                REQUEST_READ_S.set(time.monotonic() - first_frame if first_frame else 0.0)
                answer = await self._answer(method, handler, refusal, request, peer)
                await self._write(writer, answer, answer_kind)
                logger.debug("answered %s from %s (status %d) %.3fs after its first frame", method, who,
                             getattr(answer, "status", -1), time.monotonic() - first_frame if first_frame else -1)
                await self._drain(reader)  # the answer must reach the caller before we close (_drain says why)
                return
            logger.info("refused %s from %s: %s", method, who, error)
            await self._write(writer, refusal(error.status, error.reason), answer_kind)
            await self._drain(reader)
        finally:
            self.buffered_bytes -= held
            self._open[peer] -= 1
            if not self._open[peer]:
                del self._open[peer]

    async def _drain(self, reader: asyncio.StreamReader) -> None:
        """After answering, wait (bounded in bytes and time) until the caller closes its side, which
        it does once it has read the whole answer. Closing first loses answers: the p2p daemon
        (go-libp2p-daemon's doStreamPipe) resets a stream whose handler side closed while the
        remote side is still open, and a reset discards what the caller's daemon has received but
        not yet handed over, so the caller sees its stream end without a response ("stream ended
        before the last frame", from live peers, under load). After refusing early, the same wait
        lets the caller finish writing, so it reads the refusal instead of a reset stream."""
        try:
            await within(discard(reader, self.max_message_bytes), self.drain_timeout)
        except asyncio.TimeoutError:
            pass

    async def _answer(self, method: str, handler: Callable[[Req, PeerID], Awaitable[Message]],
                      refusal: Callable[[int, str], Message], request: Req, peer: PeerID) -> Message:
        try:
            return await handler(request, peer)
        except ProtocolError as e:
            logger.info("refused %s from %s: %s", method, str(peer)[-8:], e)
            return refusal(e.status, e.reason)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug must not take the server down; the caller learns it failed
            logger.exception("%s handler failed", method)
            return refusal(pb.INTERNAL, f"{type(e).__name__}: {e}")

    def open_streams_of(self, peer: str) -> int:
        """Streams `peer` has open to our handlers now: being read, answered, or waiting for the
        caller to close after our answer (so while an answer is still on its way to it)."""
        return sum(n for p, n in self._open.items() if str(p) == peer)

    async def connected(self) -> set[str]:
        """Peers the p2p daemon holds a connection to now (base58 ids): a peer killed since our last
        exchange with it is gone from it at once (its sockets reset). Raises RPCFailed if the daemon
        does not say; the caller bounds the time."""
        try:
            return {str(info.peer_id) for info in await self.p2p.list_peers()}
        except P2P_FAILURES as e:
            raise RPCFailed(f"listing connections: {type(e).__name__}: {e}") from e

    async def remove_handlers(self) -> None:
        for method in self._registered:
            try:
                await self.p2p.remove_binary_stream_handler(self._name(method))
            except P2P_FAILURES as e:  # the daemon may already be gone at shutdown
                logger.debug("could not remove handler %s: %s: %s", method, type(e).__name__, e)
        self._registered.clear()

    # ------------------------------------------------------------------ calling

    async def call(self, peer: PeerID | str, method: str, request: Message, response_type: type[Resp],
                   timeout: float, timing: CallTiming | None = None) -> Resp:
        """Send `request` and wait at most `timeout` seconds for the whole response.

        The response is read under the same limits as a request (frame size, frame count,
        max_message_bytes). Raises RPCFailed when no parsed response came (a timeout, a peer
        the daemon cannot reach, a broken stream, a response over the limits or unparsable); the response's fields are the caller's to validate
        (protocol/responses.py). `timing`, if given, is filled in as the bytes move; its `sent`
        event is set however the call ends."""
        timing = CallTiming() if timing is None else timing
        try:
            return await self._call(peer, method, request, response_type, timeout, timing)
        finally:
            timing.sent.set()

    async def _call(self, peer: PeerID | str, method: str, request: Message, response_type: type[Resp],
                    timeout: float, timing: CallTiming) -> Resp:
        try:
            peer_id = peer if isinstance(peer, PeerID) else PeerID.from_base58(peer)
        except ValueError as e:  # base58 that does not decode
            raise RPCFailed(f"{method} to {str(peer)[:16]!r}: not a peer id ({type(e).__name__})") from None
        chunks, size = encode_stream(request)
        who = str(peer_id)[-8:]

        async def send(writer: asyncio.StreamWriter) -> None:
            await write_chunks(writer, chunks)
            self.traffic.add_sent(traffic_kind(method, response=False), size)
            timing.sent.set()

        got = 0

        def first_frame(n: int) -> None:
            nonlocal got
            got += n
            timing.first_byte = timing.first_byte or time.monotonic()

        async def exchange() -> Resp:
            started = time.monotonic()
            _, reader, writer = await self.p2p.call_binary_stream_handler(peer_id, self._name(method))
            timing.started, timing.request_bytes = time.monotonic(), size
            sending = asyncio.create_task(send(writer))
            try:
                # read while we write: a server that refuses early answers before it has read it all
                response, received = await self._read(reader, response_type, first_frame)
            finally:
                sending.cancel()
                try:
                    await sending
                except (asyncio.CancelledError, *P2P_FAILURES) as e:  # a broken pipe once the server answered
                    logger.debug("%s to %s: request not sent whole (%s)", method, who, type(e).__name__)
                writer.close()
            self.traffic.add_recv(traffic_kind(method, response=True), received)
            timing.done, timing.response_bytes = time.monotonic(), received
            self.traffic.link.observe(size + received, timing.done - started)
            return response

        try:
            return await within(exchange(), timeout)
        except asyncio.TimeoutError:
            raise RPCFailed(f"{method} to {who} timed out after {timeout:.1f}s") from None
        except ProtocolError as e:
            # how far the exchange got tells a stream reset (nothing came back) from a short answer
            where = (f"request {'sent' if timing.sent.is_set() else 'not sent whole'}, {got} response bytes, "
                     f"{time.monotonic() - (timing.started or time.monotonic()):.2f}s after the stream opened")
            if got == 0 and e.reason == STREAM_ENDED:  # nothing malformed came: no answer came at all
                raise RPCFailed(f"{method} to {who}: no answer, the stream ended ({where}): the peer stopped "
                                "or the stream was reset") from None
            raise RPCFailed(f"{method} to {who}: bad response: {e} ({where})") from None
        except P2P_FAILURES as e:  # ConnectionError, P2PDaemonError, IncompleteReadError and friends
            raise RPCFailed(f"{method} to {who}: {type(e).__name__}: {e}") from None
