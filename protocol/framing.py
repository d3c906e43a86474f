"""Messages over libp2p streams: serialise, cut into frames, reassemble with a size limit.

hivemind's unary RPCs go through the p2p daemon's persistent connection, capped at 4 MiB;
streams have no cap at all. Framing every message gives one path for all sizes and lets the
receiver refuse an oversize message while it arrives, before it is parsed or buffered whole.
"""
from __future__ import annotations

from typing import AsyncIterator, Iterator, TypeVar

from google.protobuf.message import DecodeError, Message

from swarmgrad.protocol import wire_pb2 as pb

FRAME_BYTES = 1 << 20
"""1 MiB frames: well under the daemon's limits, large enough that per-frame overhead is noise."""

M = TypeVar("M", bound=Message)


class ProtocolError(Exception):
    """A message refused at the boundary; `status` is a wire Status code, `reason` says why."""

    def __init__(self, status: int, reason: str):
        super().__init__(f"{pb.Status.Name(status)}: {reason}")
        self.status = status
        self.reason = reason


def to_frames(message: Message, frame_bytes: int = FRAME_BYTES) -> Iterator[pb.Frame]:
    data = message.SerializeToString()
    if not data:
        yield pb.Frame(data=b"", last=True)
        return
    for start in range(0, len(data), frame_bytes):
        end = start + frame_bytes
        yield pb.Frame(data=data[start:end], last=end >= len(data))


def frames_size(frames: list[pb.Frame]) -> int:
    return sum(len(f.data) for f in frames)


async def read_message(frames: AsyncIterator[pb.Frame], message_type: type[M], max_bytes: int) -> tuple[M, int]:
    """Read one framed message; returns it and its size in bytes.

    Raises ProtocolError(TOO_LARGE) as soon as the running total passes `max_bytes`, and
    BAD_REQUEST for a stream that ends without a last frame or does not parse.
    """
    parts: list[bytes] = []
    total = 0
    complete = False
    # Read the stream to its end even after the last frame: closing it early makes the other
    # side's pending end-of-stream write fail (BrokenPipeError) on hivemind's p2p streams.
    async for frame in frames:
        if complete:
            raise ProtocolError(pb.BAD_REQUEST, "frames after the last frame")
        total += len(frame.data)
        if total > max_bytes:
            raise ProtocolError(pb.TOO_LARGE, f"message exceeds {max_bytes} bytes")
        parts.append(frame.data)
        complete = frame.last
    if not complete:
        raise ProtocolError(pb.BAD_REQUEST, "stream ended before the last frame")
    message = message_type()
    try:
        message.ParseFromString(b"".join(parts))
    except DecodeError as e:
        raise ProtocolError(pb.BAD_REQUEST, f"unparsable {message_type.__name__}: {e}") from None
    return message, total
