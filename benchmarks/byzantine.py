"""A hostile replica in a real swarm: what robust averaging leaves of its attack.

Four peer processes train the whole model data-parallel (one stage, four replicas, H-step rounds,
so every run trains the same number of samples). One of them is hostile (`--byzantine`, a
testing aid): it sends 100 x its honest pseudo-gradient (`scale`) or Gaussian noise of 10 x its
RMS (`random`) in every round. Runs, side by side:

- clean: four honest replicas;
- scale, random: one hostile replica, robust averaging on (centered clipping from 3 members,
  the default);
- scale, plain mean: the same attack with robust averaging off (`robust_min_members = 0`), to
  show what the guard prevents;
- takeover: four honest replicas, and a stranger (a fresh id that never trained, writing into
  the DHT through the benchmark's bootstrap node) that announces and registers the stage's
  applied rounds + 1 under a digest of its own every round, with 10^9 samples (issue 43, point 1);
- sybil: four honest replicas and 16 fresh ids announcing ONLINE records one round ahead at
  round 2^30 with top throughput; half register every round (one round ahead, 10^9 samples)
  and all vote among themselves (docs/trust.md). Both attacks start once the honest replicas have
  averaged a round (a running swarm: before that nobody has a voice, docs/trust.md).

It prints the honest replicas' final validation bits/byte for each run and its ratio to the
clean run (the issue's goal: within 2 %), the replicas' digest agreement, the mean group size,
the re-syncs and the largest round the honest replicas reached (a forged state or claim that
moved their clocks shows here).

    python -m benchmarks.byzantine             # 6 runs, about 12 minutes on 2 cores
    python -m benchmarks.byzantine --quick     # clean, scale, takeover, sybil; 5 rounds of H = 5, about 6 minutes
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable

import hivemind
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.validation import DHTRecord

from benchmarks.harness.report import Report, add_common_args, seed_or
from swarmgrad.peer.cli.launcher import LocalSwarm, small_manifest
from swarmgrad.peer.manifest import dumps
from swarmgrad.peer.averaging.group import group_hash
from swarmgrad.peer.averaging.outcome import vote
from swarmgrad.peer.net.dht_view import SwarmView
from swarmgrad.peer.net.identity import peer_id_of
from swarmgrad.peer.net.record_signing import MAGIC, SignedRecordValidator, signed_message, subkey_bytes
from swarmgrad.peer.records import ONLINE, PeerRecord


class ForgingValidator(SignedRecordValidator):
    """The stranger's DHT validator: it signs a record for any of its many keys (a fresh Ed25519
    key is free), exactly as each of those ids' own peer would. Honest peers' validators accept
    such records: the signature is the subject's."""

    def __init__(self, keys: list[Ed25519PrivateKey]):
        super().__init__()
        self._forged = {subkey_bytes(peer_id_of(k)): k.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()) for k in keys}

    def sign_value(self, record: DHTRecord) -> bytes:
        raw = self._forged.get(record.subkey)
        if raw is None:
            return record.value
        return record.value + MAGIC + Ed25519PrivateKey.from_private_bytes(raw).sign(signed_message(record))


class Stranger:
    """Fresh ids writing what any stranger can write, from a thread of the benchmark: every
    0.3 s it reads the stage's honest records and, for each id, announces an ONLINE record one
    applied round ahead, and (for `registering` of them) registers the next six rounds with 10^9
    samples and votes among the forgers. `writes` counts the passes."""

    def __init__(self, dht: hivemind.DHT, m, ids: list[str], registering: int, round_claim: int | None,
                 ready: Callable[[], bool]):
        self.views = []
        for peer_id in ids:
            view = SwarmView(dht, m.run_id, m.hash, m.stages.count, m.timeouts.dht, m.timeouts.announce_ttl)
            view._peer_id = peer_id  # the forging validator signs for it
            self.views.append(view)
        self.registering = registering
        self.round_claim = round_claim
        self.manifest_hash = m.hash
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self.writes = 0
        self.ready = ready
        """The attack starts once this says so: after the honest replicas' first averaged round
        (before it nobody has a voice, and majorities count ids: docs/trust.md)."""

    def __enter__(self) -> "Stranger":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    async def _run(self) -> None:
        forged = {v.peer_id for v in self.views}
        group = group_hash(tuple(sorted(v.peer_id for v in self.views[:self.registering])))
        while not self._stop.is_set() and not self.ready():
            await asyncio.sleep(0.3)
        while not self._stop.is_set():
            try:
                honest = [r for r in await self.views[0].stage_records(0) if r.peer_id not in forged]
                if honest:
                    claim = max(r.applied_rounds for r in honest) + 1
                    now = max(r.round for r in honest)
                    await asyncio.gather(*(view.announce(PeerRecord(
                        peer_id=view.peer_id, stage=0, state=ONLINE, throughput=1e6,
                        round=now if self.round_claim is None else self.round_claim, applied_rounds=claim,
                        digest="e" * 24, manifest_hash=self.manifest_hash, driver=False)) for view in self.views))
                    await asyncio.gather(*(store for view in self.views[:self.registering] for r in range(now, now + 6)
                                           for store in (view.register_round(0, r, view.peer_id, {
                                               "digest": "e" * 24, "applied_rounds": claim, "weight": 1e9}),
                                               view.post_check(0, r, view.peer_id, vote(group, "f" * 24)))))
                    self.writes += 1
            except Exception as e:  # the DHT may refuse or time out: a stranger just tries again
                print(f"stranger: {type(e).__name__}: {e}", file=sys.stderr)
            await asyncio.sleep(0.3)


def run(name: str, workdir: Path, rounds: int, byzantine: str | None, robust: bool, h: int, seed: int = 1,
        forgers: int = 0, registering: int = 0, round_claim: int | None = None) -> dict:
    m = small_manifest(run_id=f"byz-{name}", seed=seed, stages={"count": 1}, rounds={"inner_steps": h, "round_seconds": 0.0},
                       averaging={"robust_min_members": 3 if robust else 0},
                       data={"max_bytes": 300_000, "eval_every": 0, "eval_batches": 8})
    path = workdir / f"{name}.toml"
    path.write_text(dumps(m))
    # a bootstrap node of our own, so that the four peers start together (with H-step rounds a
    # peer that started first would train rounds alone)
    # (with forgers, the bootstrap node is the stranger's: it signs for the fresh ids)
    keys = [Ed25519PrivateKey.generate() for _ in range(forgers)]
    bootstrap = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                             record_validators=[ForgingValidator(keys) if keys else SignedRecordValidator()])
    with LocalSwarm(path, workdir / name) as swarm:
        swarm.initial_peers = [str(a) for a in bootstrap.get_visible_maddrs()]
        honest = [swarm.start(0, "--max-rounds", str(rounds), "--data-seed", str(i)) for i in (0, 1, 2)]
        bad = swarm.start(0, "--max-rounds", str(rounds), "--data-seed", "3",
                          *(("--byzantine", byzantine) if byzantine else ()))
        if not byzantine:
            honest.append(bad)  # the fourth replica is honest too: the stranger attacks from outside
        finals = []
        averaged = lambda: any(e["complete"] and e["group_size"] >= 2 for p in honest for e in p.events("round"))  # noqa: E731
        stranger = Stranger(bootstrap, m, [peer_id_of(k) for k in keys], registering, round_claim, averaged) \
            if keys else None
        with stranger or contextlib.nullcontext():
            exited = 0
            for peer in honest:
                try:
                    final = swarm.wait_for(peer, lambda e: e["event"] == "eval" and e.get("final"),
                                           60 * rounds + 300, "final eval")
                except RuntimeError as e:  # an attack that works can make an honest peer give up
                    print(f"{name}: {e}".splitlines()[0], file=sys.stderr)
                    exited += 1
                    continue
                finals.append(final["val_loss"])
        digests = {}
        for peer in honest + [bad]:
            for e in peer.events("round"):
                if e["complete"]:
                    digests.setdefault(e["round"], set()).add(e["digest"])
        samples = [sum(e["samples"] for e in p.events("round")) for p in honest]
        groups = [e["group_size"] for p in honest for e in p.events("round")]
        resyncs = sum(len(p.events("resynced")) for p in honest)
        max_round = max((e["round"] for p in honest for e in p.events("round")), default=0)
        complete = [e["complete"] for p in honest for e in p.events("round")]
        swarm_samples = max((e["swarm_samples"] for p in honest for e in p.events("round")), default=0)
    bootstrap.shutdown()
    return {"run": name, "val": sum(finals) / len(finals) if finals else float("nan"), "vals": finals,
            "exited": exited, "samples": samples,
            "agree": all(len(d) == 1 for d in digests.values()), "rounds": len(digests),
            "mean_group": sum(groups) / max(1, len(groups)), "resyncs": resyncs, "max_round": max_round,
            "complete": sum(complete) / max(1, len(complete)), "swarm_samples": swarm_samples,
            "forgers": forgers, "stranger_writes": stranger.writes if stranger else 0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, quick="a smoke run: clean, scale, takeover and sybil, 5 rounds of H = 5",
                    seed="the manifest's seed: weights and data (default 1)")
    parser.add_argument("--rounds", type=int, default=None, help="default 12 (5 with --quick)")
    parser.add_argument("--inner-steps", type=int, default=None, help="default 10 (5 with --quick)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--cases", default=None,
                        help="comma-separated runs to make (clean, scale, random, scale-plain-mean, takeover, sybil); "
                             "the first is the baseline of 'vs clean'")
    args = parser.parse_args()
    rounds = args.rounds or (5 if args.quick else 12)
    inner_steps = args.inner_steps or (5 if args.quick else 10)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="swarmgrad-byzantine-"))
    workdir.mkdir(parents=True, exist_ok=True)
    # (name, --byzantine, robust averaging, fresh ids, of them registering, their records' round)
    configs = [("clean", None, True, 0, 0, None), ("scale", "scale", True, 0, 0, None),
               ("random", "random", True, 0, 0, None), ("scale-plain-mean", "scale", False, 0, 0, None),
               ("takeover", None, True, 1, 1, None), ("sybil", None, True, 16, 8, 2 ** 30)]
    if args.cases:
        wanted = args.cases.split(",")
        configs = sorted((c for c in configs if c[0] in wanted), key=lambda c: wanted.index(c[0]))
    elif args.quick:
        configs = [c for c in configs if c[0] in ("clean", "scale", "takeover", "sybil")]
    results = []
    for name, mode, robust, forgers, registering, round_claim in configs:
        r = run(name, workdir, rounds, mode, robust, inner_steps, seed_or(args, 1), forgers, registering,
                round_claim)
        results.append(r)
        print(json.dumps(r), flush=True)
    clean = results[0]["val"]
    report = Report("A hostile replica against robust averaging", args.out)
    print()
    report.table(["run", "honest val bits/byte", "vs clean", "samples/replica", "group", "complete", "re-syncs",
                  "max round", "swarm samples", "digests agree", "honest peers exited"],
                 [[r["run"], f"{r['val']:.3f}", f"{r['val'] / clean - 1:+.2%}", min(r["samples"] or [0]),
                   f"{r['mean_group']:.2f}", f"{r['complete']:.0%}", r["resyncs"], r["max_round"],
                   r["swarm_samples"], r["agree"], r["exited"]] for r in results])
    report.results = {"rounds": rounds, "inner_steps": inner_steps, "runs": results}
    report.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
