"""Messages over libp2p streams: serialise, cut into frames, reassemble with a size limit.

hivemind's unary RPCs go through the p2p daemon's persistent connection, capped at 4 MiB;
its protobuf streams read each message's 8-byte length prefix and then that many bytes before
any check of ours could run, so a remote could make us buffer up to 2**64 bytes. We frame
every message ourselves on a raw stream instead: each frame is an 8-byte big-endian length
followed by a serialised `Frame`. The reader refuses a length over the frame limit before it
reads the frame, counts frames, and refuses a message whose running total passes its limit,
so what a remote makes us hold is bounded by limits we chose, whatever it sends.
"""
from __future__ import annotations

import asyncio
from typing import Callable, Iterator, TypeVar

from google.protobuf.message import DecodeError, Message

from swarmgrad.protocol import wire_pb2 as pb

FRAME_BYTES = 1 << 20
"""1 MiB frames: well under the daemon's limits, large enough that per-frame overhead is noise."""
FRAME_OVERHEAD = 16
"""Bytes a serialised Frame adds around its data (field tags, a varint length, the last flag)."""
MAX_FRAME_BYTES = FRAME_BYTES + FRAME_OVERHEAD
"""The largest serialised Frame a reader accepts; a length prefix above it is refused unread."""
HEADER_BYTES = 8
"""Length prefix of each frame on a stream: big-endian, the size hivemind uses for its own."""
PARSE_OFF_LOOP_BYTES = 4 << 20
"""Messages at least this large are parsed in a worker thread so the event loop keeps serving."""
MAX_REASON_CHARS = 1000
"""A refusal's reason as another peer wrote it is cut to this length before we log or keep it."""

M = TypeVar("M", bound=Message)


def status_name(code: int) -> str:
    """The wire name of a Status code, or `UNKNOWN_STATUS_<code>` for a number this build lacks.

    proto3 keeps enum values it does not know (a response may carry status 99), and
    `pb.Status.Name` raises ValueError for them: never call it on a number from the network."""
    try:
        return pb.Status.Name(code)
    except (ValueError, TypeError):
        return f"UNKNOWN_STATUS_{code}"


def is_known_status(code: int) -> bool:
    return isinstance(code, int) and code in pb.Status.values()


STREAM_ENDED = "stream ended before the last frame"
"""The reason of a message cut short: the sender stopped, or the stream was reset."""


class ProtocolError(Exception):
    """A message refused at the boundary; `status` is a wire Status code, `reason` says why."""

    def __init__(self, status: int, reason: str):
        super().__init__(f"{status_name(status)}: {reason}")
        self.status = status
        self.reason = reason


def max_frames_for(max_bytes: int, frame_bytes: int = FRAME_BYTES) -> int:
    """Frames a reader accepts for one message of at most `max_bytes`.

    An honest sender cuts a message into ceil(size / frame_bytes) frames (one for an empty
    message); twice that plus a few leaves room for other frame sizes, and stops a remote
    from keeping a reader busy with endless empty frames."""
    return 2 * -(-max(0, max_bytes) // frame_bytes) + 4


def to_frames(message: Message, frame_bytes: int = FRAME_BYTES) -> Iterator[pb.Frame]:
    """`message` serialised and cut into frames of `frame_bytes` (the last one flagged); an empty
    message is one empty last frame."""
    data = message.SerializeToString()
    if not data:
        yield pb.Frame(data=b"", last=True)
        return
    for start in range(0, len(data), frame_bytes):
        end = start + frame_bytes
        yield pb.Frame(data=data[start:end], last=end >= len(data))


def parse_bytes(data: bytes, message_type: type[M]) -> M:
    """Parse `data` as `message_type`; any parser failure is ProtocolError(BAD_REQUEST)."""
    message = message_type()
    try:
        message.ParseFromString(data)
    except DecodeError as e:  # protobuf's one error for bytes that do not parse, whatever they are
        raise ProtocolError(pb.BAD_REQUEST, f"unparsable {message_type.__name__}: {type(e).__name__}: {e}") from None
    return message


async def parse_message(data: bytes, message_type: type[M]) -> M:
    """Parse `data`; large messages in a worker thread. Raises ProtocolError(BAD_REQUEST)."""
    if len(data) >= PARSE_OFF_LOOP_BYTES:
        return await asyncio.to_thread(parse_bytes, data, message_type)
    return parse_bytes(data, message_type)


def encode_stream(message: Message, frame_bytes: int = FRAME_BYTES) -> tuple[list[bytes], int]:
    """The bytes to write for `message` on a raw stream (one chunk per frame) and its size."""
    chunks, size = [], 0
    for frame in to_frames(message, frame_bytes):
        body = frame.SerializeToString()
        chunks.append(len(body).to_bytes(HEADER_BYTES, "big") + body)
        size += len(frame.data)
    return chunks, size


async def write_chunks(writer: asyncio.StreamWriter, chunks: list[bytes]) -> None:
    """Write pre-encoded frames, waiting for the transport after each (backpressure)."""
    for chunk in chunks:
        writer.write(chunk)
        await writer.drain()


async def read_stream_message(reader: asyncio.StreamReader, message_type: type[M], max_bytes: int, *,
                              max_frames: int | None = None, max_frame_bytes: int = MAX_FRAME_BYTES,
                              reserve: Callable[[int], None] | None = None) -> tuple[M, int]:
    """Read one framed message from a raw stream; returns it and its size in bytes.

    Every frame's length prefix is checked against `max_frame_bytes` before a byte of the frame
    is read, the frame count against `max_frames` (default `max_frames_for(max_bytes)`) and the
    running total against `max_bytes`, so memory held is at most max_bytes + max_frame_bytes.
    `reserve(n)` is called before n more bytes are read and may raise ProtocolError (a budget
    shared by several streams). The stream is left unread after the last frame (the server
    drains it: FramedRPC._drain). Raises ProtocolError: TOO_LARGE for a limit passed,
    BAD_REQUEST for an unparsable frame or message or a stream that ends early. The caller
    bounds the time (a remote may send nothing at all).
    """
    limit = max_frames_for(max_bytes) if max_frames is None else max_frames
    parts: list[bytes] = []
    total = count = 0
    try:
        while True:
            count += 1
            if count > limit:
                raise ProtocolError(pb.TOO_LARGE, f"more than {limit} frames in one message")
            length = int.from_bytes(await reader.readexactly(HEADER_BYTES), "big")
            if length > max_frame_bytes:
                raise ProtocolError(pb.TOO_LARGE, f"frame of {length} bytes exceeds {max_frame_bytes}")
            if reserve is not None:
                reserve(length)
            frame = parse_bytes(await reader.readexactly(length), pb.Frame) if length else pb.Frame()
            total += len(frame.data)
            if total > max_bytes:
                raise ProtocolError(pb.TOO_LARGE, f"message exceeds {max_bytes} bytes")
            parts.append(frame.data)
            if frame.last:
                break
    except asyncio.IncompleteReadError:
        raise ProtocolError(pb.BAD_REQUEST, STREAM_ENDED) from None
    return await parse_message(b"".join(parts), message_type), total


async def discard(reader: asyncio.StreamReader, max_bytes: int, chunk: int = 1 << 16) -> int:
    """Read and drop at most `max_bytes` (until end of stream); returns how many were dropped."""
    dropped = 0
    while dropped < max_bytes:
        data = await reader.read(min(chunk, max_bytes - dropped))
        if not data:
            break
        dropped += len(data)
    return dropped
