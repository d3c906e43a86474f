"""Framed protobuf RPCs over hivemind's P2P layer, with byte counting and deadlines.

Each RPC is one libp2p stream: the request is cut into frames (protocol/framing.py), the
handler's response comes back the same way. Handlers never raise across the wire: a
ProtocolError becomes a refusal with its status and reason, anything else becomes INTERNAL
and is logged here, so a bad request costs the server one log line and nothing else.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from google.protobuf.message import Message
from hivemind.p2p import P2P, P2PContext, PeerID

from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.framing import ProtocolError, read_message, to_frames

logger = logging.getLogger(__name__)

Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)


@dataclass
class Traffic:
    """Bytes of swarmgrad messages this peer sent and received (payload, not libp2p overhead)."""
    sent: int = 0
    recv: int = 0


class RPCFailed(Exception):
    """A call that got no usable response: timeout, unreachable peer, broken stream."""


class FramedRPC:
    def __init__(self, p2p: P2P, namespace: str, traffic: Traffic, max_message_bytes: int):
        self.p2p = p2p
        self.namespace = namespace
        self.traffic = traffic
        self.max_message_bytes = max_message_bytes
        self._registered: list[str] = []

    def _name(self, method: str) -> str:
        return f"{self.namespace}::{method}"

    async def add_handler(self, method: str, request_type: type[Req],
                          handler: Callable[[Req, PeerID], Awaitable[Message]],
                          refusal: Callable[[int, str], Message]) -> None:
        async def serve(frames: AsyncIterator[pb.Frame], context: P2PContext) -> AsyncIterator[pb.Frame]:
            try:
                request, size = await read_message(frames, request_type, self.max_message_bytes)
                self.traffic.recv += size
                response = await handler(request, context.remote_id)
            except ProtocolError as e:
                logger.info("refused %s from %s: %s", method, str(context.remote_id)[-8:], e)
                response = refusal(e.status, e.reason)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a bug must not take the server down; the caller learns it failed
                logger.exception("%s handler failed", method)
                response = refusal(pb.INTERNAL, f"{type(e).__name__}: {e}")
            for frame in to_frames(response):
                self.traffic.sent += len(frame.data)
                yield frame

        await self.p2p.add_protobuf_handler(self._name(method), serve, pb.Frame, stream_input=True, stream_output=True)
        self._registered.append(method)

    async def remove_handlers(self) -> None:
        for method in self._registered:
            try:
                await self.p2p.remove_protobuf_handler(self._name(method), stream_input=True, stream_output=True)
            except Exception as e:  # the daemon may already be gone at shutdown
                logger.debug("could not remove handler %s: %s", method, e)
        self._registered.clear()

    async def call(self, peer: PeerID | str, method: str, request: Message, response_type: type[Resp],
                   timeout: float) -> Resp:
        """Send `request` and wait at most `timeout` seconds for the whole response."""
        peer_id = peer if isinstance(peer, PeerID) else PeerID.from_base58(peer)
        frames = list(to_frames(request))

        async def outgoing() -> AsyncIterator[pb.Frame]:
            for frame in frames:
                self.traffic.sent += len(frame.data)
                yield frame

        async def exchange() -> Resp:
            stream = await self.p2p.iterate_protobuf_handler(peer_id, self._name(method), outgoing(), pb.Frame)
            response, size = await read_message(stream, response_type, self.max_message_bytes)
            self.traffic.recv += size
            return response

        try:
            return await asyncio.wait_for(exchange(), timeout=timeout)
        except asyncio.TimeoutError:
            raise RPCFailed(f"{method} to {str(peer_id)[-8:]} timed out after {timeout:.1f}s") from None
        except ProtocolError as e:
            raise RPCFailed(f"{method} to {str(peer_id)[-8:]}: bad response: {e}") from None
        except (ConnectionError, OSError, EOFError) as e:
            raise RPCFailed(f"{method} to {str(peer_id)[-8:]}: {type(e).__name__}: {e}") from None
        except Exception as e:  # P2PDaemonError, P2PHandlerError and friends
            raise RPCFailed(f"{method} to {str(peer_id)[-8:]}: {type(e).__name__}: {e}") from None
