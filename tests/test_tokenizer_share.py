"""A public run's tokenizer file, served by its peers and fetched by a joiner that lacks it
(peer/public/tokenizer_share.py): over the in-memory DHT (tests/support/dht.py) and the loopback
transport under the real FramedRPC (tests/support/transport.py), in chunks, checked against the
owner-signed sha256 (a forged file is refused in one line and the next peer asked), cached beside
the run's manifest; the wire's checks of both messages; a real in-process Peer serving it; and the
command line's side: the owner's paths, a joiner without the run's data."""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import re
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from support.dht import MemoryDHT, announce, swarm_view
from support.transport import LoopbackNet
from swarmgrad.peer.cli.launcher import small_manifest
from swarmgrad.peer.manifest import dumps
from swarmgrad.peer.net.errors import RPCFailed
from swarmgrad.peer.net.identity import peer_id_of
from swarmgrad.peer.net.rpc import FramedRPC, Traffic
from swarmgrad.peer.public.directory import RunDirectory
from swarmgrad.peer.public.resolve import tokenizer_cache_file
from swarmgrad.peer.public.run_name import RunName, fingerprint
from swarmgrad.peer.public.signed_manifest import PublishedManifest, sign, verify
from swarmgrad.peer.public.tokenizer_share import (CHUNK_BYTES, MAX_TOKENIZER_BYTES, MESSAGE_BYTES, METHOD,
                                                   TokenizerFile, TokenizerServer, TokenizerUnavailable,
                                                   fetch_from, namespace, provide_tokenizer, serve_tokenizer)
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.framing import ProtocolError
from swarmgrad.protocol.responses import validate_tokenizer_chunk
from swarmgrad.protocol.validation import RunIdentity, envelope, validate_tokenizer_request

pytestmark = pytest.mark.timeout(60)

OWNER = Ed25519PrivateKey.generate()
FILE = os.urandom(2 * CHUNK_BYTES + 12345)  # three chunks; the share never parses the file
SHA = hashlib.sha256(FILE).hexdigest()


def _published() -> PublishedManifest:
    """A signed run whose manifest names `tok.json` (relative: a joiner has no such file) and pins it."""
    m = small_manifest(run_id="tok-public", model={"vocab_size": 300},
                       data={"source": "jsonl", "paths": ["corpus.jsonl"], "tokenizer": "tok.json",
                             "tokenizer_sha256": SHA, "max_bytes": 0})
    toml = re.sub(r'(?m)^(tokenizer|base_dir) = ".*"\n', "", dumps(m))
    toml = toml.replace("[data]\n", '[data]\ntokenizer = "tok.json"\n')
    return verify(sign(OWNER, toml, tokenizer_sha256=SHA), RunName("tok-public", fingerprint(OWNER)))


def _id() -> str:
    return peer_id_of(Ed25519PrivateKey.generate())


async def _serve(net: LoopbackNet, memory: MemoryDHT, m, stage: int, file: TokenizerFile | None) -> str:
    """A peer of the run on stage `stage`, serving `file` (None: announced, but gone from the net)."""
    peer = _id()
    await announce(swarm_view(memory, peer, m), stage)
    if file is not None:
        rpc = FramedRPC(net.node(peer), namespace(m.run_id), Traffic(), MESSAGE_BYTES)
        await rpc.add_handler(METHOD, pb.TokenizerRequest, TokenizerServer(RunIdentity(m.run_id, m.hash), file).handle,
                              lambda s, r: pb.TokenizerResponse(status=s, reason=r))
    return peer


def test_a_joiner_fetches_verifies_and_caches_the_tokenizer_and_refuses_a_forged_one(tmp_path: Path) -> None:
    published = _published()
    m = published.manifest
    assert published.tokenizer_sha256 == SHA and not Path(m.data.tokenizer).exists()

    async def main() -> None:
        memory, net = MemoryDHT(), LoopbackNet()
        try:
            # asked in the order of the stage records: a forger, a peer that is gone, then an honest one
            forged = TokenizerFile(FILE[:-1] + bytes([FILE[-1] ^ 1]), SHA)  # claims the signed digest
            await _serve(net, memory, m, 0, forged)
            await _serve(net, memory, m, 0, None)
            # the honest peer serves what Peer serves: the manifest's file, read when it starts
            owner_file = tmp_path / "owner" / "tok.json"
            owner_file.parent.mkdir()
            owner_file.write_bytes(FILE)
            honest = _id()
            await announce(swarm_view(memory, honest, m), 1)
            served = await serve_tokenizer(net.node(honest), dataclasses.replace(
                m, data=dataclasses.replace(m.data, tokenizer=str(owner_file))), Traffic())
            assert served is not None
            joiner = _id()
            directory = RunDirectory(memory.node(joiner), 5.0)
            calls = []
            client = FramedRPC(net.node(joiner), namespace(m.run_id), Traffic(), MESSAGE_BYTES)

            async def rpc() -> FramedRPC:
                calls.append(1)
                return client

            lines: list[str] = []
            cache = tmp_path / "cache"
            joined = await provide_tokenizer(directory, rpc, published, cache, say=lines.append)
            path = tokenizer_cache_file(cache, published.run_id)
            assert joined.manifest.data.tokenizer == str(path) and path.read_bytes() == FILE
            assert joined.manifest.hash == m.hash and joined.blob == published.blob  # the same run
            refused = [line for line in lines if "refused the tokenizer" in line]
            assert len(refused) == 1 and "forged or corrupted" in refused[0] and "\n" not in refused[0], lines
            assert len(lines) == 2, lines  # the forger's refusal, the gone peer's failure
            # a cache hit asks nobody; a cache file altered on disk is fetched again
            again = await provide_tokenizer(directory, rpc, published, cache, say=lines.append)
            assert again.manifest.data.tokenizer == str(path) and len(calls) == 1
            path.write_bytes(b"{}")
            await provide_tokenizer(directory, rpc, published, cache, say=lines.append)
            assert path.read_bytes() == FILE and len(calls) == 2
            # with only forgers left, the joiner gives up in one line
            net.kill(honest)
            path.unlink()
            with pytest.raises(TokenizerUnavailable, match=r"no peer of the run served its signed tokenizer file "
                                                           r"\(asked ") as gave_up:
                await provide_tokenizer(directory, rpc, published, cache, say=lines.append)
            assert str(gave_up.value).count(": forged") == 1 and str(gave_up.value).count(": failed") == 2
            assert not path.exists()
        finally:
            await net.close()
    asyncio.run(main())


def test_a_run_without_a_tokenizer_asks_nobody(tmp_path: Path) -> None:
    published = verify(sign(OWNER, dumps(small_manifest(run_id="bytes-public"))),
                       RunName("bytes-public", fingerprint(OWNER)))

    async def never() -> FramedRPC:
        raise AssertionError("a byte-level run fetches nothing")

    assert asyncio.run(provide_tokenizer(None, never, published, tmp_path)) is published  # type: ignore[arg-type]
    assert not list(tmp_path.iterdir())


def test_a_server_refuses_another_digest_and_a_caller_refuses_a_malformed_chunk() -> None:
    m = _published().manifest
    identity = RunIdentity(m.run_id, m.hash)

    def request(**kw: object) -> pb.TokenizerRequest:
        fields = {"envelope": envelope(identity, 0), "sha256": SHA, "offset": 0, **kw}
        return pb.TokenizerRequest(**fields)  # type: ignore[arg-type]

    assert validate_tokenizer_request(request(offset=5), identity, SHA, len(FILE)) == 5
    for req, status, why in ((request(sha256="0" * 64), pb.WRONG_RUN, "this peer's tokenizer"),
                             (request(sha256="xyz"), pb.BAD_REQUEST, "64 lowercase hex"),
                             (request(offset=len(FILE) + 1), pb.BAD_REQUEST, "past the file"),
                             (request(envelope=envelope(RunIdentity(m.run_id, "other"), 0)), pb.WRONG_RUN, "hash")):
        with pytest.raises(ProtocolError, match=why) as e:
            validate_tokenizer_request(req, identity, SHA, len(FILE))
        assert e.value.status == status

    def chunk(**kw: object) -> pb.TokenizerResponse:
        return pb.TokenizerResponse(**{"status": pb.OK, "total_bytes": 10, "offset": 0, "data": b"x" * 4, **kw})

    assert validate_tokenizer_chunk(chunk(), 0, 100, 4).data == b"xxxx"
    assert validate_tokenizer_chunk(chunk(status=pb.WRONG_RUN, reason="no"), 0, 100, 4).status == pb.WRONG_RUN
    assert validate_tokenizer_chunk(chunk(offset=10, data=b""), 10, 100, 4).data == b""  # the end
    for resp, off, why in ((chunk(offset=4), 0, "starts at byte 4"), (chunk(total_bytes=101), 0, "at most 100"),
                           (chunk(data=b"x" * 5), 0, "chunks of"), (chunk(data=b""), 0, "chunks of"),
                           (chunk(offset=8, data=b"xxx"), 8, "chunks of"), (chunk(status=99), 0, "unknown status")):
        with pytest.raises(ProtocolError, match=why):
            validate_tokenizer_chunk(resp, off, 100, 4)

    async def main() -> None:  # over the wire: a refusal is a failed call, with its reason
        net = LoopbackNet()
        try:
            server, caller = _id(), _id()
            rpc = FramedRPC(net.node(server), namespace(m.run_id), Traffic(), MESSAGE_BYTES)
            server_of = TokenizerServer(identity, TokenizerFile(FILE, SHA))
            await rpc.add_handler(METHOD, pb.TokenizerRequest, server_of.handle,
                                  lambda s, r: pb.TokenizerResponse(status=s, reason=r))
            client = FramedRPC(net.node(caller), namespace(m.run_id), Traffic(), MESSAGE_BYTES)
            assert await fetch_from(client, server, identity, SHA, 5.0) == FILE
            with pytest.raises(RPCFailed, match="refused: WRONG_RUN"):
                await fetch_from(client, server, identity, "0" * 64, 5.0)
        finally:
            await net.close()
    asyncio.run(main())


def test_a_file_over_the_limit_is_not_served(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(MAX_TOKENIZER_BYTES + 1)
    with pytest.raises(ValueError, match="at most"):
        TokenizerFile.read(big)
    m = small_manifest()
    assert asyncio.run(serve_tokenizer(None, m, Traffic())) is None  # byte-level: nothing to serve


def test_a_peer_of_a_tokenized_run_serves_its_file_while_it_runs(tmp_path: Path, inprocess,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The real Peer (tests/support/swarm.py): it serves the manifest's file from its start and
    stops serving when it stops."""
    pytest.importorskip("tokenizers", reason="the BPE tokenizer needs the tokenizers library")
    import swarmgrad.peer.node.peer as node_peer
    monkeypatch.setattr(node_peer, "stage_rate", lambda *a: 100.0)  # a pinned peer's benchmark: not the point here
    from types import SimpleNamespace

    from support.swarm import InProcessSwarm, step_manifest
    from swarmgrad.peer.public.tokenizer_share import fetch_tokenizer, run_peers
    from swarmgrad.peer.text.tokenizer import train_bpe

    docs = [f"document {i} of a small corpus for a tokenizer." for i in range(50)]
    (tmp_path / "corpus.jsonl").write_text("".join(f'{{"text": "{d}"}}\n' for d in docs))
    tok = train_bpe(docs, 280, tmp_path / "tok.json")
    manifest = step_manifest(2, model={"vocab_size": tok.vocab_size},
                             data={"source": "jsonl", "paths": [str(tmp_path / "corpus.jsonl")], "max_bytes": 0,
                                   "tokenizer": str(tok.path), "tokenizer_sha256": tok.sha256})

    async def scenario() -> None:
        async with InProcessSwarm(manifest) as swarm:
            peer = swarm.start(1)
            await swarm.wait_for(peer, lambda e: e["event"] == "started", 30, "the peer's start")
            client = FramedRPC(swarm.client(), namespace(manifest.run_id), Traffic(), MESSAGE_BYTES)
            directory = RunDirectory(swarm.dht.node(str(client.p2p.peer_id)), 5.0)
            peers: list[str] = []
            for _ in range(50):  # its record lands once it joined
                peers = await run_peers(directory, SimpleNamespace(manifest=manifest), 5.0)  # type: ignore[arg-type]
                if peers:
                    break
                await asyncio.sleep(0.1)
            assert peers == [peer.peer_id]
            identity = RunIdentity(manifest.run_id, manifest.hash)
            assert await fetch_tokenizer(client, peers, identity, tok.sha256, 5.0) == tok.path.read_bytes()
            await swarm.stop(peer)
            with pytest.raises(TokenizerUnavailable):
                await fetch_tokenizer(client, peers, identity, tok.sha256, 5.0, say=lambda line: None)

    inprocess(scenario)


def test_a_peer_that_drips_its_chunks_is_given_up_on_after_a_few_chunk_deadlines(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import swarmgrad.peer.public.tokenizer_share as share
    from swarmgrad.peer.public.tokenizer_share import fetch_tokenizer
    monkeypatch.setattr(share, "CHUNK_BYTES", 1000)
    data = os.urandom(6000)
    sha = hashlib.sha256(data).hexdigest()
    identity = RunIdentity("drip", "hash")

    async def main() -> None:
        net = LoopbackNet()
        try:
            dripper, honest, caller = _id(), _id(), _id()
            for peer, delay in ((dripper, 0.4), (honest, 0.0)):
                server = TokenizerServer(identity, TokenizerFile(data, sha))

                async def handle(req: pb.TokenizerRequest, who: object, server: TokenizerServer = server,
                                 delay: float = delay) -> pb.TokenizerResponse:
                    await asyncio.sleep(delay)  # each chunk inside its deadline (0.5 s), the whole not
                    return await server.handle(req, who)
                rpc = FramedRPC(net.node(peer), namespace("drip"), Traffic(), MESSAGE_BYTES)
                await rpc.add_handler(METHOD, pb.TokenizerRequest, handle,
                                      lambda s, r: pb.TokenizerResponse(status=s, reason=r))
            client = FramedRPC(net.node(caller), namespace("drip"), Traffic(), MESSAGE_BYTES)
            lines: list[str] = []
            assert await fetch_tokenizer(client, [dripper, honest], identity, sha, 0.5, say=lines.append) == data
            assert len(lines) == 1 and "did not arrive within 2s" in lines[0], lines
        finally:
            await net.close()
    asyncio.run(main())


def test_the_owner_trains_with_paths_resolved_against_its_manifests_folder(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`--manifest run/run.toml --owner-key KEY` from another folder: the signed TOML alone would
    resolve tok.json against the working folder; the owner's peer uses the manifest's folder."""
    from swarmgrad.peer.cli.public import sign_own_run
    from swarmgrad.peer.net.identity import load_or_create
    run = tmp_path / "run"
    run.mkdir()
    (run / "tok.json").write_bytes(FILE)
    (run / "run.toml").write_text(_published().toml)
    load_or_create(tmp_path / "owner.key")
    monkeypatch.chdir(tmp_path)
    published = sign_own_run(str(run / "run.toml"), str(tmp_path / "owner.key"))
    assert published.manifest.data.tokenizer == str(run / "tok.json") and published.tokenizer_sha256 == SHA
    assert published.manifest.data.base_dir == str(run)
    assert published.manifest.hash == verify(published.blob, RunName("tok-public", published.fingerprint)).manifest.hash


def test_a_joiner_without_the_runs_data_is_told_before_it_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture) -> None:
    """The tokenizer comes from the swarm, the data does not: a joiner that would drive (stage 0)
    and lacks the files its data.paths name is refused in one line saying what to do."""
    import swarmgrad.peer.cli.public as public
    from swarmgrad.peer.cli import main
    from swarmgrad.peer.cli.public import missing_data
    published = _published()  # data.paths = ["corpus.jsonl"], relative to the joiner's working folder
    monkeypatch.chdir(tmp_path)
    assert "'corpus.jsonl' matches no file" in (missing_data(published.manifest) or "")
    assert missing_data(small_manifest()) is None  # stdlib: everywhere
    monkeypatch.setattr(public, "fetch_run", lambda *a: published)
    assert main.main(["peer", "--run", published.run_id, "--initial-peers", "/ip4/127.0.0.1/tcp/9/p2p/x"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lacks the run's training data" in err[0] and "--stage 1..1" in err[0], err
