"""Public runs (docs/public-runs.md): a run named NAME@FINGERPRINT, its owner-signed manifest, kept in
the DHT by every peer of the run, fetched, verified and cached by a joiner; the initial peers'
sources; the one line a command prints when no initial peer answers. Pure code, the in-memory DHT
of tests/support/dht.py, and one real process (the unreachable initial peer)."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.p2p import P2PDaemonError

from support.dht import MemoryDHT, announce, swarm_view
from swarmgrad.peer.cli.launcher import small_manifest
from swarmgrad.peer.cli.peer import _public_flags_conflict
from swarmgrad.peer.cli.runs import format_table
from swarmgrad.peer.cli.swarm_access import ENV_INITIAL_PEERS, initial_peers, unreachable_line
from swarmgrad.peer.manifest import ManifestError, dumps, loads
from swarmgrad.peer.net.errors import SwarmUnavailable
from swarmgrad.peer.net.identity import peer_id_of
from swarmgrad.peer.public.directory import RUNS_KEY, Publisher, RunDirectory, manifest_key
from swarmgrad.peer.public.resolve import RunNotFound, cache_file, choose, resolve
from swarmgrad.peer.public.run_name import FINGERPRINT_CHARS, RunName, fingerprint, is_public_run_id, parse
from swarmgrad.peer.public.signed_manifest import (MAX_BLOB_BYTES, ManifestRefused, public_manifest, sign,
                                                   tokenizer_digest, verify)

ROOT = Path(__file__).resolve().parent.parent
OWNER = Ed25519PrivateKey.generate()
SQUATTER = Ed25519PrivateKey.generate()
TOML = dumps(small_manifest(run_id="llama-public"))
DEAD_PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWGy1KgUuMX23UPCJDvF3HqUy7t3Sq8ueaRgEXZva3yCqx"


def owned(key: Ed25519PrivateKey = OWNER, name: str = "llama-public") -> RunName:
    return RunName(name, fingerprint(key))


# --- names ------------------------------------------------------------------------------------
def test_a_fingerprint_is_16_base32_characters_of_the_key_and_a_name_parses_both_ways() -> None:
    fp = fingerprint(OWNER)
    assert len(fp) == FINGERPRINT_CHARS and fp == fingerprint(peer_id_of(OWNER)) != fingerprint(SQUATTER)
    assert parse(f"run.1@{fp}") == RunName("run.1", fp) and str(parse(f"run.1@{fp}")) == f"run.1@{fp}"
    assert parse("run.1") == RunName("run.1") and is_public_run_id(f"run.1@{fp}") and not is_public_run_id("run.1")
    for bad in ("", "@" + fp, "run@", "run@SHORT", f"run@{fp}x", f"bad name@{fp}", f"run@{fp.upper()}"):
        with pytest.raises(ValueError):
            parse(bad)
    with pytest.raises(ManifestError):  # no hand-written manifest can take a public run's id
        loads(TOML.replace('run_id = "llama-public"', f'run_id = "llama-public@{fp}"'))


# --- signing and verifying ----------------------------------------------------------------------
def test_a_signed_manifest_verifies_and_trains_as_name_at_fingerprint() -> None:
    published = verify(sign(OWNER, TOML), owned())
    assert published.run_id == published.manifest.run_id == f"llama-public@{fingerprint(OWNER)}"
    assert published.owner_id == peer_id_of(OWNER) and published.toml == TOML
    assert published.toml_hash == loads(TOML).hash != published.manifest.hash  # the public id is in the hash
    assert dataclasses.replace(published.manifest, run_id="llama-public") == loads(TOML)  # nothing else changed
    assert verify(published.blob, RunName("llama-public")).run_id == published.run_id  # a bare name
    assert public_manifest(loads(TOML), fingerprint(OWNER)) == published.manifest
    with pytest.raises(ValueError, match="already a public run id"):
        public_manifest(published.manifest, fingerprint(OWNER))


def test_an_altered_manifest_is_refused() -> None:
    version, body, signature = msgpack.unpackb(sign(OWNER, TOML))
    altered = body.replace(b"round_seconds = 4.0", b"round_seconds = 0.5")
    assert altered != body
    with pytest.raises(ManifestRefused, match="altered or forged"):
        verify(msgpack.packb([version, altered, signature]), owned())
    with pytest.raises(ManifestRefused, match="altered or forged"):  # a signature of another body
        verify(msgpack.packb([version, body, msgpack.unpackb(sign(OWNER, TOML + "\n"))[2]]), owned())


def test_a_squatted_or_forged_name_is_refused() -> None:
    squat = sign(SQUATTER, TOML)  # the same NAME under another key
    with pytest.raises(ManifestRefused, match="signed by another key.*forged or squatted"):
        verify(squat, owned())
    assert verify(squat, RunName("llama-public")).run_id == f"llama-public@{fingerprint(SQUATTER)}"  # its own run
    with pytest.raises(ManifestRefused, match="not 'other'"):  # signed for another name
        verify(sign(OWNER, TOML), RunName("other", fingerprint(OWNER)))


@pytest.mark.parametrize("blob", [b"", b"\x00" * 10, msgpack.packb([2, b"{}", b"x" * 64]), msgpack.packb([1, b"[]", b"x" * 64]),
                                  msgpack.packb({"a": 1}), b"x" * (MAX_BLOB_BYTES + 1), "text", None])
def test_malformed_blobs_are_refused_with_a_reason(blob: object) -> None:
    with pytest.raises(ManifestRefused):
        verify(blob, owned())


def test_the_tokenizer_hook_signs_the_file_bytes(tmp_path: Path) -> None:
    (tmp_path / "tok.json").write_bytes(b'{"model": "bpe"}')
    m = SimpleNamespace(data=SimpleNamespace(tokenizer="tok.json", tokenizer_sha256=""))
    digest = tokenizer_digest(m, tmp_path)  # type: ignore[arg-type]
    assert digest is not None and len(digest) == 64
    assert tokenizer_digest(small_manifest(), tmp_path) is None  # byte-level: no tokenizer
    published = verify(sign(OWNER, TOML, tokenizer_sha256=digest), owned())
    assert published.tokenizer_sha256 == digest
    m.data.tokenizer_sha256 = "0" * 64
    with pytest.raises(ManifestRefused, match="tokenizer_sha256"):
        tokenizer_digest(m, tmp_path)  # type: ignore[arg-type]
    m.data.tokenizer = "missing.json"
    with pytest.raises(ManifestRefused, match="missing.json"):
        tokenizer_digest(m, tmp_path)  # type: ignore[arg-type]


# --- the DHT: publish, list, fetch ---------------------------------------------------------------
def _node(memory: MemoryDHT, key: Ed25519PrivateKey | None = None):
    return memory.node(peer_id_of(key or Ed25519PrivateKey.generate()))


def test_peers_keep_the_manifest_and_strangers_entries_are_refused() -> None:
    async def main() -> None:
        memory = MemoryDHT()
        published = verify(sign(OWNER, TOML), owned())
        owner, joiner, stranger, reader = (RunDirectory(_node(memory, k), 5.0) for k in (OWNER, None, None, None))
        assert await owner.publish(published)
        # the stranger lists the owner's run with an altered manifest, and a made-up run
        version, body, signature = msgpack.unpackb(published.blob)
        forged = msgpack.packb([version, body.replace(b"4.0", b"9.0"), signature])
        node = stranger.dht
        await node.store(manifest_key(published.run_id), forged, await _expiry(), subkey=node.peer_id,
                         return_future=True)
        await node.store(RUNS_KEY, {"run": f"fake@{fingerprint(SQUATTER)}"}, await _expiry(), subkey=node.peer_id,
                         return_future=True)
        await node.store(RUNS_KEY, {"run": "not a run id"}, await _expiry(), subkey=node.peer_id, return_future=True)
        found = await reader.manifest(published.run_id)
        assert found.published is not None and found.published.blob == published.blob
        assert any("altered or forged" in r for r in found.refusals)
        assert [f.published.run_id for f in await reader.runs()] == [published.run_id]  # the fake has no manifest
        # a joiner fetched it and publishes too: the manifest outlives the owner's peer
        assert await joiner.publish(verify((await reader.find(RunName("llama-public")))[0].published.blob, owned()))
        memory.forget(owner.dht.peer_id)
        assert (await reader.manifest(published.run_id)).published is not None
        memory.forget(joiner.dht.peer_id)
        gone = await reader.manifest(published.run_id)
        assert gone.published is None and gone.refusals  # only the forged entry is left
    asyncio.run(main())


async def _expiry() -> float:
    from hivemind.utils import get_dht_time
    return get_dht_time() + 60


def test_the_publisher_stores_again_until_stopped() -> None:
    async def main() -> None:
        memory = MemoryDHT()
        published = verify(sign(OWNER, TOML), owned())
        directory = RunDirectory(_node(memory, OWNER), 5.0)
        stop = asyncio.Event()
        task = asyncio.create_task(Publisher(directory, published, every=0.01).run(stop))
        for _ in range(4):  # two periods: two entries each
            await asyncio.wait_for(memory.next_store(), 5)
        stop.set()
        await asyncio.wait_for(task, 5)
        assert (await RunDirectory(_node(memory), 5.0).manifest(published.run_id)).published is not None
        memory.unreachable.add(directory.dht.peer_id)  # a failed store is logged, not fatal
        stop.clear()
        task = asyncio.create_task(Publisher(directory, published, every=0.01).run(stop))
        await asyncio.sleep(0.05)
        assert not task.done()
        stop.set()
        await asyncio.wait_for(task, 5)
    asyncio.run(main())


def test_a_run_summary_counts_its_peers_rounds_and_samples() -> None:
    async def main() -> None:
        memory = MemoryDHT()
        published = verify(sign(OWNER, TOML), owned())
        m = published.manifest
        for stage, round_no in ((0, 3), (1, 4), (1, 2)):
            key = Ed25519PrivateKey.generate()
            await announce(swarm_view(memory, peer_id_of(key), m), stage, round_no=round_no, driver=stage == 0)
        other = swarm_view(memory, peer_id_of(Ed25519PrivateKey.generate()), small_manifest())  # another run
        await announce(other, 0, round_no=99)
        summary = await RunDirectory(_node(memory), 5.0).summary(published, now=published.issued_at + 30)
        assert (summary.run, summary.stages, summary.peers_online, summary.last_round) == (published.run_id, 2, 3, 4)
        assert summary.model == "gpt d32 L2" and summary.params and summary.age_s == pytest.approx(30)
        table = format_table([summary])
        assert table.splitlines()[0].split() == ["RUN", "MODEL", "PARAMS", "STAGES", "PEERS", "SAMPLES", "ROUND", "AGE"]
        assert published.run_id in table and "30s" in table
    asyncio.run(main())


# --- choosing and caching ------------------------------------------------------------------------
def test_a_bare_name_picks_the_only_run_and_refuses_with_the_list_when_there_are_several(tmp_path: Path) -> None:
    async def main() -> None:
        memory = MemoryDHT()
        mine = verify(sign(OWNER, TOML), owned())
        theirs = verify(sign(SQUATTER, TOML), RunName("llama-public"))
        await RunDirectory(_node(memory, OWNER), 5.0).publish(mine)
        reader = RunDirectory(_node(memory), 5.0)
        assert (await resolve(reader, RunName("llama-public"), tmp_path)).run_id == mine.run_id
        assert cache_file(tmp_path, mine.run_id).read_bytes() == mine.blob
        await RunDirectory(_node(memory, SQUATTER), 5.0).publish(theirs)
        with pytest.raises(RunNotFound, match=f"2 runs are named 'llama-public': .*{mine.run_id}"):
            await resolve(reader, RunName("llama-public"), tmp_path)
        assert (await resolve(reader, parse(mine.run_id), tmp_path)).blob == mine.blob  # NAME@FP is one run
        with pytest.raises(RunNotFound, match="no peer of the swarm serves a public run nothing"):
            await resolve(reader, RunName("nothing"), tmp_path)
        # every peer gone: the cached manifest of NAME@FP still starts the run again
        memory.forget(peer_id_of(OWNER))
        assert (await resolve(reader, parse(mine.run_id), tmp_path)).blob == mine.blob
        cache_file(tmp_path, mine.run_id).write_bytes(mine.blob.replace(b"4.0", b"5.0"))  # edited on disk
        with pytest.raises(ManifestRefused, match="altered or forged"):
            await resolve(reader, parse(mine.run_id), tmp_path)
    asyncio.run(main())


def test_status_reads_a_public_runs_manifest_by_name() -> None:
    from swarmgrad.peer.cli.public import PublicRunError, published_over

    async def main() -> None:
        memory = MemoryDHT()
        mine = verify(sign(OWNER, TOML), owned())
        await RunDirectory(_node(memory, OWNER), 5.0).publish(mine)
        reader = _node(memory)
        assert (await published_over(reader, "llama-public", 5.0)).manifest == mine.manifest
        for run, why in (("nothing", "no peer of the swarm serves"), ("bad name", "a run name is"),
                         (f"llama-public@{fingerprint(SQUATTER)}", "no peer of the swarm serves")):
            with pytest.raises(PublicRunError, match=why):
                await published_over(reader, run, 5.0)
    asyncio.run(main())


def test_choose_refuses_when_every_entry_of_the_run_is_refused() -> None:
    from swarmgrad.peer.public.directory import Found
    with pytest.raises(ManifestRefused, match="refused the manifest of run x@.*: bad"):
        choose(RunName("x", "a" * 16), [Found("x@" + "a" * 16, None, ("bad",))], None)


# --- the command line ----------------------------------------------------------------------------
def test_initial_peers_come_from_the_flags_then_the_environment(tmp_path: Path) -> None:
    a, b, c = (f"/ip4/10.0.0.{i}/tcp/1/p2p/12D3KooWGy1KgUuMX23UPCJDvF3HqUy7t3Sq8ueaRgEXZva3yCqx" for i in (1, 2, 3))
    boot = tmp_path / "bootstrap"
    boot.write_text(f"# the run's entry points\n{b}\n\n  {c}  # a comment\n{a}\n")
    env = {ENV_INITIAL_PEERS: f"{c}, {a}\n{b}"}
    assert initial_peers([a], None, env) == [a]
    assert initial_peers([a], str(boot), env) == [a, b, c]  # both flags, each address once
    assert initial_peers([], str(boot), {}) == [b, c, a]
    assert initial_peers([], None, env) == [c, a, b]
    assert initial_peers([], None, {}) == []
    for flag, file in (([], str(tmp_path / "missing")), (["10.0.0.1:5"], None)):
        with pytest.raises(ValueError):
            initial_peers(flag, file, {})


def test_the_networks_failures_become_one_line_and_bugs_do_not() -> None:
    for error in (P2PDaemonError("Daemon failed to start: ... failed to connect to bootstrap peers\nmore"),
                  RuntimeError("DHTNode bootstrap failed: none of the initial_peers responded to a ping."),
                  SwarmUnavailable("reading swarmgrad/runs: no answer within 5s"), asyncio.TimeoutError()):
        line = unreachable_line(error, [DEAD_PEER])
        assert line is not None and "\n" not in line and DEAD_PEER in line, (error, line)
    assert unreachable_line(TypeError("a bug"), [DEAD_PEER]) is None
    assert unreachable_line(RuntimeError("p2pd runs as X"), [DEAD_PEER]) is None


def test_contradictory_run_flags_are_refused() -> None:
    def args(**kw: object) -> SimpleNamespace:
        return SimpleNamespace(**{"join": None, "coordinator": None, "run": None, "owner_key": None,
                                  "manifest": None, **kw})
    assert _public_flags_conflict(args(manifest="m.toml", owner_key="k")) is None
    assert _public_flags_conflict(args(run="x")) is None
    for bad in (args(join="inv", run="x"), args(run="x", manifest="m.toml"), args(owner_key="k"),
                args(coordinator="h:1", owner_key="k", manifest="m")):
        assert _public_flags_conflict(bad)


def test_an_initial_peer_that_does_not_answer_is_one_line_and_a_nonzero_exit(p2p_daemons: None) -> None:
    """The real p2pd, for `status` (today it printed hivemind's P2PDaemonError traceback); the
    initial peer from the environment. (`p2p_daemons`: the wire tier, whose tests run one at a
    time under `make test`, as this one's p2pd is started in a `swarmgrad status` process.)"""
    proc = subprocess.run([sys.executable, "-m", "swarmgrad.peer.cli", "status", "--run-id", "x"], capture_output=True,
                          text=True, timeout=90, cwd=ROOT, env={**os.environ, ENV_INITIAL_PEERS: DEAD_PEER})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [f"swarmgrad status: none of the initial peers answered "
                                                f"({DEAD_PEER}): no answer"], proc.stderr


def test_runs_says_so_in_one_line_too(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """`runs` (and `monitor`) reach the swarm through the same start_client_dht and run_swarm_command."""
    from swarmgrad.peer.cli import main, swarm_access

    def dead(peers: list[str], timeout: float, bootstrap_wait: float = 0.0) -> None:
        raise swarm_access.SwarmUnreachable(unreachable_line(
            RuntimeError("DHTNode bootstrap failed: none of the initial_peers responded to a ping."), peers))
    monkeypatch.setattr(swarm_access, "start_client_dht", dead)
    assert main.main(["runs", "--initial-peers", DEAD_PEER]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"swarmgrad runs: none of the initial peers answered ({DEAD_PEER}): no answer"]
    monkeypatch.undo()
    monkeypatch.delenv(ENV_INITIAL_PEERS, raising=False)
    assert main.main(["runs"]) == 1  # no initial peers at all: one line too
    assert "no initial peers: give --initial-peers, --bootstrap-file or $SWARMGRAD_INITIAL_PEERS" in capsys.readouterr().err


def test_the_owners_and_joiners_mistakes_are_one_line_before_anything_starts(tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture) -> None:
    from swarmgrad.peer.cli import main
    manifest = tmp_path / "run.toml"
    manifest.write_text(TOML)
    for argv, why in ((["--manifest", str(manifest), "--owner-key", str(tmp_path / "missing.key")],
                       "--owner-key .*missing.key: No such file"),
                      (["--run", "llama-public", "--manifest", str(manifest)], "leave --manifest out"),
                      (["--owner-key", "k"], "give it with --manifest PATH"),
                      (["--run", "x", "--bootstrap-file", str(tmp_path / "none")], "--bootstrap-file .*none")):
        assert main.main(["peer", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and re.search(why, err[0]), err
