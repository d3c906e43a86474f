"""A public run's tokenizer file, served by every peer of the run and fetched by a joiner that lacks
it, so that a run with a tokenizer is joinable by its name alone (docs/public-runs.md).

The owner's signed manifest pins the file's sha256 (signed_manifest.py), so no peer is trusted for
the bytes: a joiner asks the run's peers one after another (those its stage records name, then those
that publish its manifest), takes the file a chunk of CHUNK_BYTES at a time under the deadline
`timeouts.tokenizer` per chunk, and keeps it only if the whole hashes to the signed digest; a file
that does not is refused in one line and the next peer is asked. At most MAX_SOURCES peers are
asked, each for at most MAX_TOKENIZER_BYTES within WHOLE_FILE_CHUNKS chunk deadlines, so a swarm of
forgers costs a joiner a bounded amount of time and memory. The verified file is cached beside the
run's cached manifest (resolve.py) and the joiner's `data.tokenizer` points at it; the run's hash
does not change (the path is not hashed, the digest is).

A peer serves the file it started with: its bytes are read once, when it starts (after the
manifest's own check of them, text/run_data.run_tokenizer), and a request for another digest is
refused WRONG_RUN. The handler sits in the run's own namespace, behind a private run's gate like
every other.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

from swarmgrad.peer.manifest import Manifest
from swarmgrad.peer.net.deadline import within
from swarmgrad.peer.net.dht_view import SwarmView
from swarmgrad.peer.net.errors import NETWORK_FAILURES, RPCFailed
from swarmgrad.peer.net.rpc import FramedRPC, Traffic
from swarmgrad.peer.public.directory import RunDirectory
from swarmgrad.peer.public.resolve import load_cached_tokenizer, save_tokenizer
from swarmgrad.peer.public.signed_manifest import PublishedManifest
from swarmgrad.peer.records import JOINING, ONLINE
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.framing import ProtocolError
from swarmgrad.protocol.responses import validate_tokenizer_chunk
from swarmgrad.protocol.validation import RunIdentity, envelope, validate_tokenizer_request

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
"""Bytes of the file one answer carries: a chunk crosses a slow link well within its deadline."""
MAX_TOKENIZER_BYTES = 64 << 20
"""The largest tokenizer file served or taken (a Hugging Face tokenizer.json of a 128k vocabulary
is about 10 MB)."""
MAX_SOURCES = 8
"""Peers a joiner asks before it gives up."""
WHOLE_FILE_CHUNKS = 4
"""A peer's whole file must arrive within this many chunk deadlines (4 x timeouts.tokenizer: 120 s
by default, 64 MiB over a 5 Mbit/s link), so a peer that drips its chunks just inside their deadline
holds a joiner for that long at most, not once per chunk."""
MESSAGE_BYTES = CHUNK_BYTES + (64 << 10)
"""A message's limit on this namespace: a chunk and its framing; requests are tiny."""
METHOD = "chunk"


class TokenizerUnavailable(Exception):
    """No peer of the run served the signed file; the message is one line saying what each did."""


def namespace(run_id: str) -> str:
    return f"swarmgrad/{run_id}/tokenizer"


@dataclass(frozen=True)
class TokenizerFile:
    """The bytes a peer serves and their sha256."""
    data: bytes
    sha256: str

    @classmethod
    def read(cls, path: str | Path) -> "TokenizerFile":
        """Blocking I/O (call it off the event loop). Raises ValueError for a file over
        MAX_TOKENIZER_BYTES, OSError for one that cannot be read."""
        data = Path(path).read_bytes()
        if len(data) > MAX_TOKENIZER_BYTES:
            raise ValueError(f"{path} has {len(data)} bytes; at most {MAX_TOKENIZER_BYTES} are served")
        return cls(data, hashlib.sha256(data).hexdigest())


class TokenizerServer:
    """The handler of `chunk` requests for one run's tokenizer file."""

    def __init__(self, identity: RunIdentity, file: TokenizerFile):
        self.identity = identity
        self.file = file
        self.served = 0
        """Chunks answered (for tests and the log)."""

    async def handle(self, req: pb.TokenizerRequest, caller: Any) -> pb.TokenizerResponse:
        size = len(self.file.data)
        offset = validate_tokenizer_request(req, self.identity, self.file.sha256, size)
        self.served += 1
        return pb.TokenizerResponse(status=pb.OK, total_bytes=size, offset=offset,
                                    data=self.file.data[offset:offset + CHUNK_BYTES])


def _refusal(status: int, reason: str) -> pb.TokenizerResponse:
    return pb.TokenizerResponse(status=status, reason=reason)


async def serve_tokenizer(p2p: Any, manifest: Manifest, traffic: Traffic,
                          gate: Callable[[Any], Any] | None = None) -> FramedRPC | None:
    """Serve the manifest's tokenizer file (`data.tokenizer`), if it names one, under the run's
    namespace; the FramedRPC to remove its handlers with at shutdown, or None when there is nothing
    to serve (a byte-level run, or a file this peer cannot read or serve: logged, the peer trains on)."""
    path = manifest.data.tokenizer
    if not path:
        return None
    try:
        file = await asyncio.get_running_loop().run_in_executor(None, TokenizerFile.read, path)
    except (OSError, ValueError) as e:
        logger.warning("not serving the run's tokenizer file: %s", e)
        return None
    server = TokenizerServer(RunIdentity(manifest.run_id, manifest.hash), file)
    rpc = FramedRPC(p2p, namespace(manifest.run_id), traffic, MESSAGE_BYTES,
                    read_timeout=manifest.timeouts.tokenizer, gate=gate)
    await rpc.add_handler(METHOD, pb.TokenizerRequest, server.handle, _refusal)
    return rpc


async def fetch_from(rpc: FramedRPC, peer: str, identity: RunIdentity, sha256: str, timeout: float) -> bytes:
    """The file `peer` serves for `sha256`, every chunk within `timeout`. Raises RPCFailed for a
    call that failed, a refusal or a malformed answer; the bytes are not checked here."""
    got = bytearray()
    total: int | None = None
    while total is None or len(got) < total:
        request = pb.TokenizerRequest(envelope=envelope(identity, 0), sha256=sha256, offset=len(got))
        resp = await rpc.call(peer, METHOD, request, pb.TokenizerResponse, timeout)
        try:
            chunk = validate_tokenizer_chunk(resp, len(got), MAX_TOKENIZER_BYTES, CHUNK_BYTES)
        except ProtocolError as e:
            raise RPCFailed(f"a malformed answer: {e.reason}") from None
        if chunk.status != pb.OK:
            raise RPCFailed(f"refused: {pb.Status.Name(chunk.status)} {chunk.reason}")
        if total is not None and chunk.total_bytes != total:
            raise RPCFailed(f"the file's size changed from {total} to {chunk.total_bytes} bytes")
        total = chunk.total_bytes
        got += chunk.data
    return bytes(got)


async def fetch_tokenizer(rpc: FramedRPC, peers: Sequence[str], identity: RunIdentity, sha256: str,
                          timeout: float, say: Callable[[str], None] = logger.warning) -> bytes:
    """The file whose sha256 is `sha256` from the first of `peers` (at most MAX_SOURCES) that serves
    it. A peer whose bytes hash otherwise is refused with one line through `say`, and so is one whose
    call fails; then the next is asked. Raises TokenizerUnavailable when none served it."""
    tried: list[str] = []
    for peer in list(dict.fromkeys(peers))[:MAX_SOURCES]:
        who = peer[-8:]
        try:
            data = await within(fetch_from(rpc, peer, identity, sha256, timeout), WHOLE_FILE_CHUNKS * timeout)
        except NETWORK_FAILURES as e:
            why = str(e) or f"the file did not arrive within {WHOLE_FILE_CHUNKS * timeout:g}s"
            say(f"tokenizer from peer ...{who}: {why}; asking the next peer")
            tried.append(f"...{who}: failed")
            continue
        digest = hashlib.sha256(data).hexdigest()
        if digest != sha256:
            say(f"refused the tokenizer from peer ...{who}: its sha256 is {digest[:12]}..., the owner signed "
                f"{sha256[:12]}... (forged or corrupted); asking the next peer")
            tried.append(f"...{who}: forged")
            continue
        return data
    if not tried:
        raise TokenizerUnavailable("no peer of the run was found to serve its tokenizer file")
    raise TokenizerUnavailable(f"no peer of the run served its signed tokenizer file (asked {', '.join(tried)})")


async def run_peers(directory: RunDirectory, published: PublishedManifest, timeout: float) -> list[str]:
    """Peers to ask for the run's file, best first: those whose stage records announce the run's
    manifest as online or joining (a peer refuses to start without the file), then those that
    publish its manifest. Anyone can write either, which is why the bytes are checked."""
    m = published.manifest
    view = SwarmView(directory.dht, m.run_id, m.hash, m.stages.count, timeout, ttl=m.timeouts.announce_ttl)
    me = str(directory.dht.peer_id)
    records, publishers = await asyncio.gather(view.swarm(), directory.publishers(m.run_id))
    live = [r.peer_id for recs in records.values() for r in recs if r.state in (ONLINE, JOINING)]
    return [p for p in dict.fromkeys(live + publishers) if p != me]


async def provide_tokenizer(directory: RunDirectory, rpc: Callable[[], Awaitable[FramedRPC]],
                            published: PublishedManifest, cache_dir: Path,
                            say: Callable[[str], None] = logger.warning) -> PublishedManifest:
    """`published`, its `data.tokenizer` pointing at the verified file in the cache: the cached one
    if its bytes are the signed ones, else the one fetched from the run's peers (and cached) through
    the FramedRPC `rpc()` makes (asked for only then). A run that names no tokenizer is returned as it
    is. Raises TokenizerUnavailable, OSError (the cache)."""
    m, sha256 = published.manifest, published.tokenizer_sha256
    if not m.data.tokenizer or sha256 is None:
        return published
    path = load_cached_tokenizer(cache_dir, published.run_id, sha256)
    if path is None:
        timeout = m.timeouts.tokenizer
        try:
            peers = await within(run_peers(directory, published, timeout), 2 * timeout)
        except NETWORK_FAILURES as e:
            raise TokenizerUnavailable(f"could not read who serves the run: {e or type(e).__name__}") from None
        data = await fetch_tokenizer(await rpc(), peers, RunIdentity(m.run_id, m.hash), sha256, timeout, say)
        path = save_tokenizer(cache_dir, published.run_id, data)
    manifest = dataclasses.replace(m, data=dataclasses.replace(m.data, tokenizer=str(path)))
    assert manifest.hash == m.hash  # the path is not hashed: the run is the same
    return dataclasses.replace(published, manifest=manifest)
