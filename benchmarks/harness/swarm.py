"""The swarm benchmarks' runner: the demo's swarm of real peer processes (`LocalSwarm.start_swarm`,
what `swarmgrad demo` starts) run to the end, and the figures its JSON-lines events give.

A swarm always runs inside `LocalSwarm` as a context manager, so every peer's process group (peer,
DHT child, p2pd) is stopped whatever happens; a failed run prints the failing peer's log tail and
exits non-zero (`SwarmFailed`).
"""
from __future__ import annotations

import math
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from benchmarks.harness import REPO
from swarmgrad.peer.cli.launcher import LocalSwarm, PeerProcess, stop_on_signals
from swarmgrad.peer.manifest import Manifest, dumps

DEFAULT_MANIFEST = REPO / "peer" / "defaults" / "tiny-gpt.toml"
"""The byte-level GPT demo's manifest (`swarmgrad demo` ran it until the embedded default became the
tiny Llama of peer/defaults/tiny-llama.toml; the swarm benchmarks' figures are on it)."""


class SwarmFailed(RuntimeError):
    """A peer exited non-zero, the run did not end in time, or its events lack what a summary needs."""


@dataclass
class SwarmRun:
    manifest: Manifest
    peers: list[PeerProcess]
    wall_s: float
    workdir: Path

    @property
    def drivers(self) -> list[PeerProcess]:
        return [p for p in self.peers if p.stage == 0]

    def events(self, kind: str, peers: Sequence[PeerProcess] | None = None) -> list[dict[str, Any]]:
        return [e for p in (self.peers if peers is None else peers) for e in p.events(kind)]

    # figures -------------------------------------------------------------------------------------
    @property
    def samples(self) -> int:
        """Samples trained by the drivers (sum of stage-0 round events' `samples`)."""
        return sum(e["samples"] for e in self.events("round", self.drivers))

    @property
    def bytes_sent(self) -> int:
        """Everything every peer sent (pipeline + averaging + state), from the `stopped` events."""
        return sum(e["bytes_sent"] for e in self.events("stopped"))

    @property
    def avg_bytes_sent(self) -> int:
        """Bytes every peer sent during its rounds' averaging (round events' `avg_bytes_sent`)."""
        return sum(e["avg_bytes_sent"] for e in self.events("round"))

    def final_val_loss(self) -> float:
        """Mean of the drivers' final validation losses (bits/byte)."""
        finals = [e["val_loss"] for e in self.events("eval", self.drivers)
                  if e.get("final") and e.get("val_loss") is not None]
        return sum(finals) / len(finals) if finals else math.nan

    def first_val_loss(self) -> float:
        evals = sorted((e for e in self.events("eval", self.drivers) if e.get("val_loss") is not None),
                       key=lambda e: e["time"])
        return evals[0]["val_loss"] if evals else math.nan

    def replica_agreement(self) -> tuple[bool, int, int]:
        """(every complete round left a stage's replicas with one digest, rounds that every replica
        completed, all (stage, round) pairs seen)."""
        complete: dict[tuple[int, int], list[str]] = defaultdict(list)
        seen: set[tuple[int, int]] = set()
        for e in self.events("round"):
            key = (e["stage"], e["round"])
            seen.add(key)
            if e["complete"]:
                complete[key].append(e["digest"])
        agree = all(len(set(d)) == 1 for d in complete.values())
        per_stage = defaultdict(int)
        for p in self.peers:
            per_stage[p.stage] += 1
        full = sum(1 for (stage, _), d in complete.items() if len(d) == per_stage[stage])
        return agree, full, len(seen)


def run_swarm(manifest: Manifest, workdir: Path, rounds: int, replicas: int = 2, budget_s: float = 600.0,
              label: str = "swarm", progress: bool = True, final_eval_s: float = 150.0) -> SwarmRun:
    """The demo's swarm: `stages.count` x `replicas` peers on 127.0.0.1, each with `--max-rounds rounds`,
    run until every peer has exited. Raises SwarmFailed (with the failing peers' log tails) otherwise,
    also when a driver has no final eval `final_eval_s` after its last round."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "manifest.toml"
    path.write_text(dumps(manifest))
    started = time.monotonic()
    with stop_on_signals(), LocalSwarm(path, workdir) as swarm:
        swarm.start_swarm(manifest.stages.count, replicas, "--max-rounds", str(rounds))
        _wait_all(swarm, budget_s, label, progress, rounds, final_eval_s)
    run = SwarmRun(manifest, swarm.peers, time.monotonic() - started, workdir)
    missing = [p for p in run.drivers if not any(e.get("final") for e in p.events("eval"))]
    if not run.events("round", run.drivers) or missing:
        detail = "\n".join(f"--- {p.name} (stage {p.stage}) log tail ---\n{p.log_tail()}" for p in (missing or run.drivers))
        raise SwarmFailed(f"{label}: drivers ended without round events or a final eval\n{detail}")
    return run


def _wait_all(swarm: LocalSwarm, budget_s: float, label: str, progress: bool, rounds: int,
              final_eval_s: float) -> None:
    deadline = time.monotonic() + budget_s
    reported: dict[str, int] = {}
    while time.monotonic() < deadline:
        if progress:
            for p in swarm.peers:
                if p.stage != 0:
                    continue
                seen = p.events("round")
                for e in seen[reported.get(p.name, 0):]:
                    print(f"  [{label}] {p.name} round {e['round']}: {e['samples']} samples, "
                          f"{'ok' if e['complete'] else 'INCOMPLETE: ' + str(e['reason'])}", flush=True)
                reported[p.name] = len(seen)
        failed = [p for p in swarm.peers if not p.alive and p.proc.returncode != 0]
        if failed:
            raise SwarmFailed(f"{label}: " + "\n".join(
                f"{p.name} (stage {p.stage}) exited with code {p.proc.returncode}; log tail:\n{p.log_tail()}"
                for p in failed))
        if all(not p.alive for p in swarm.peers):
            return
        for p in swarm.peers:
            if p.stage != 0 or not p.alive:
                continue
            done = p.events("round")
            if len(done) >= rounds and not any(e.get("final") for e in p.events("eval")) \
                    and time.time() - done[-1]["time"] > final_eval_s:
                raise SwarmFailed(
                    f"{label}: {p.name} (stage 0) finished its {rounds} rounds but has no final eval "
                    f"{final_eval_s:.0f}s later. With rounds.inner_steps > 0 this is the daemon's race: after the "
                    "last round the driver keeps training and its worker pauses itself after H more inner steps, "
                    f"so the final eval waits forever. Log tail:\n{p.log_tail()}")
        time.sleep(0.5)
    alive = [p for p in swarm.peers if p.alive]
    raise SwarmFailed(f"{label}: {len(alive)} peer(s) still running after {budget_s:.0f}s:\n" + "\n".join(
        f"--- {p.name} (stage {p.stage}) log tail ---\n{p.log_tail()}" for p in alive))


def fail(e: SwarmFailed) -> None:
    print(f"\nFAILED: {e}", file=sys.stderr, flush=True)
    sys.exit(1)
