"""A public run joined by its name alone, across network namespaces (two hosts on a veth pair): the
owner starts it with `--owner-key` on its default listen address (every interface) and prints the
address others dial; from the other host `swarmgrad runs` lists it as NAME@FINGERPRINT, and `swarmgrad
peer --run NAME` fetches, verifies and caches its manifest, and (the run names a BPE tokenizer file the
joiner does not have) fetches the tokenizer from the owner's peer, checks it against the signed
sha256 and caches it, joins and trains with the owner.
Skipped without root (namespaces need CAP_NET_ADMIN); out of `make test` (~30-40 s of peers):
`make test-slow` runs it."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.harness import netns
from swarmgrad.peer.cli.launcher import small_manifest
from swarmgrad.peer.manifest import dumps
from swarmgrad.peer.text.tokenizer import train_bpe

ROOT = Path(__file__).resolve().parent.parent
WHY = netns.why_unavailable()

pytestmark = [
    pytest.mark.skipif(WHY is not None, reason=f"no network namespaces: {WHY}"),
    pytest.mark.skipif(not os.environ.get("SWARMGRAD_SLOW_TESTS"),
                       reason="namespaces and peers (~30-40 s): set SWARMGRAD_SLOW_TESTS=1 or run `make test-slow`"),
    pytest.mark.timeout(180),
]


def _start(endpoint: netns.Endpoint, log: Path, *argv: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([*endpoint.exec_prefix(), sys.executable, "-m", "swarmgrad.peer.cli", *argv],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)


def _wait_for_line(log: Path, pattern: str, proc: subprocess.Popen, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text())
        if found:
            return found
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} in {log.name}:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def test_a_public_run_is_joined_by_its_name_from_another_host(spawned_peers: Path) -> None:
    tmp = spawned_peers
    netns.remove_stale()
    manifest, key = tmp / "run.toml", tmp / "owner.key"
    # a tokenized run: the manifest names tok.json beside it, a file the joiner (started elsewhere) lacks;
    # the corpus is the joiner's own data (here the same absolute path: one filesystem)
    words = "the swarm trains one model over slow links and every stage averages its part".split()
    docs = [" ".join(words[(i * 7 + j) % len(words)] for j in range(8 + i % 30)) + "." for i in range(300)]
    (tmp / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = train_bpe(docs, 300, tmp / "tok.json")
    run_manifest = small_manifest(run_id="netns-public", rounds={"max_rounds": 3}, model={"vocab_size": tok.vocab_size},
                                  data={"source": "jsonl", "paths": [str(tmp / "corpus.jsonl")], "max_bytes": 0,
                                        "tokenizer": str(tok.path), "tokenizer_sha256": tok.sha256,
                                        "val_fraction": 0.1, "shard_mb": 0.005})
    toml = re.sub(r'(?m)^base_dir = ".*"\n', "", dumps(run_manifest))
    manifest.write_text(re.sub(r'(?m)^tokenizer = ".*"$', 'tokenizer = "tok.json"', toml))
    subprocess.run([sys.executable, "-m", "swarmgrad.peer.cli", "keygen", "--out", str(key)], check=True,
                   capture_output=True, cwd=ROOT)
    procs: list[subprocess.Popen] = []
    with netns.WanNet("pubjoin", 2, subnet=243) as net:
        host_a, host_b = net.endpoints
        try:
            owner = _start(host_a, tmp / "owner.log", "peer", "--manifest", str(manifest), "--owner-key", str(key),
                           "--stage", "0", "--linger", "5", "--events", str(tmp / "owner.jsonl"))
            procs.append(owner)
            # the default listen address is every interface; the owner prints the one host B can dial
            addr = _wait_for_line(tmp / "owner.log", rf"visible at (/ip4/{re.escape(host_a.address)}/tcp/\d+/p2p/\w+)",
                                  owner, 60).group(1)
            run = _wait_for_line(tmp / "owner.log", r"public run (netns-public@[a-z2-7]{16})", owner, 5).group(1)
            assert "/ip4/0.0.0.0" not in (tmp / "owner.log").read_text()
            listing = subprocess.run([*host_b.exec_prefix(), sys.executable, "-m", "swarmgrad.peer.cli", "runs",
                                      "--initial-peers", addr, "--json"], capture_output=True, text=True, timeout=60,
                                     cwd=ROOT)
            assert listing.returncode == 0, listing.stderr
            assert [r["run"] for r in json.loads(listing.stdout)["runs"]] == [run], listing.stdout
            joiner = _start(host_b, tmp / "joiner.log", "peer", "--run", "netns-public", "--initial-peers", addr,
                            "--cache-dir", str(tmp / "cache"), "--linger", "5", "--events", str(tmp / "joiner.jsonl"))
            procs.append(joiner)
            codes = [p.wait(120) for p in (joiner, owner)]
            logs = "\n".join(f"--- {n}\n{(tmp / n).read_text()[-2000:]}" for n in ("owner.log", "joiner.log"))
            assert codes == [0, 0], logs
        finally:
            for p in procs:
                _stop(p)
    joined = (tmp / "joiner.log").read_text()
    assert f"run {run}: manifest" in joined and "(verified)" in joined
    assert (tmp / "cache" / f"{run}.manifest").exists()
    cached = tmp / "cache" / f"{run}.tokenizer.json"
    assert f"run {run}: tokenizer {cached} (sha256 {tok.sha256[:12]}" in joined, joined[-2000:]
    assert cached.read_bytes() == (tmp / "tok.json").read_bytes()
    rounds = [json.loads(line) for line in (tmp / "joiner.jsonl").read_text().splitlines()]
    trained = [e for e in rounds if e.get("event") == "round" and e.get("stage") == 1 and e.get("samples", 0) > 0]
    assert trained, f"the joiner trained nothing\n{joined[-2000:]}"
