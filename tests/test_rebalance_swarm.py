"""Unequal peers placed by the policy in a real swarm: 6 peer processes, 3 stages, speeds
[1, 1, 1, 1, 3, 3] (four with --slowdown 3), all started on stage 0 with rebalancing on.

Slow: about 4 minutes on 2 cores, so it runs only with SWARMGRAD_SLOW_TESTS=1 (`make test-slow`).
On a shared 2-core machine the six processes contend for the cores, so measured rates are noisy;
the assertions are on the policy's own view of the swarm (the announced rates), not on wall time.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter

import pytest

from swarmgrad.peer.cli.launcher import LocalSwarm

from conftest import small_manifest

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not os.environ.get("SWARMGRAD_SLOW_TESTS"),
                                 reason="slow (~4 min): set SWARMGRAD_SLOW_TESTS=1 or run `make test-slow`")]

SPEEDS = [3, 3, 3, 3, 1, 1]  # --slowdown per peer: four at speed 1, two at speed 3
SETTLE_S = 150.0
QUIET_ROUNDS = 5


def status_json(swarm: LocalSwarm) -> dict:
    out = subprocess.run([sys.executable, "-m", "swarmgrad.peer.cli", "status", "--initial-peers",
                          *swarm.initial_peers, "--manifest", str(swarm.manifest), "--json"],
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_six_unequal_peers_reach_a_good_placement_and_stop_moving(local_swarm) -> None:
    m = small_manifest(model={"d_model": 32, "n_layers": 3, "n_heads": 2, "seq_len": 32}, stages={"count": 3},
                       timeouts={"rebalance_check": 3.0})
    swarm: LocalSwarm = local_swarm(m)
    flags = ("--rebalance", "on", "--rate-clock", "cpu")  # six peers on 2 cores: each measures itself
    swarm.start_first(0, *flags, "--slowdown", str(SPEEDS[0]))
    for f in SPEEDS[1:]:
        swarm.start(0, *flags, "--slowdown", str(f))
    time.sleep(SETTLE_S)
    status = status_json(swarm)
    moves = [e for p in swarm.peers for e in p.events("moved")]
    assert moves, "all peers started on stage 0: someone must have moved"
    counts = Counter(int(s) for s, recs in status["stages"].items() for r in recs if r["state"] == "online")
    assert all(counts[s] >= 1 for s in range(3)), f"a stage is empty: {counts}"
    # "reaches": announced rates swing by a third on two shared cores, so one snapshot can dip
    # below while the assignment is right; the best of a few looks a round apart must not
    looks = [status]
    while len(looks) < 4 and not looks[-1]["throughput"] >= 0.85 * looks[-1]["reachable"]:
        time.sleep(m.rounds.round_seconds)
        looks.append(status_json(swarm))
    assert max(x["throughput"] / x["reachable"] for x in looks) >= 0.85, looks
    # then quiet: no move during the last QUIET_ROUNDS rounds
    last_move = max(e["time"] for e in moves)
    quiet_until = last_move + QUIET_ROUNDS * m.rounds.round_seconds
    time.sleep(max(0.0, quiet_until - time.time()) + 1.0)
    later = [e for p in swarm.peers for e in p.events("moved") if e["time"] > last_move]
    assert not later, f"moved again within {QUIET_ROUNDS} rounds of settling: {later}"
    for p in swarm.peers:
        assert p.alive, p.log_tail()
    # one round runner per replica: a moved peer reports each round of its new stage once
    for p in swarm.peers:
        seen = Counter((e["stage"], e["round"]) for e in p.events("round"))
        assert max(seen.values(), default=1) == 1, f"{p.name} reported a round twice: {seen.most_common(3)}"
    # replicas still agree and training goes on
    by_round: dict[tuple[int, int], set[str]] = {}
    for p in swarm.peers:
        for e in p.events("round"):
            if e["complete"]:
                by_round.setdefault((e["stage"], e["round"]), set()).add(e["digest"])
    assert all(len(d) == 1 for d in by_round.values()), "replicas of a stage disagree after a round"
    # and the loss falls: the last stage's train loss, early rounds against the latest ones
    losses = sorted((e["time"], e["train_loss"]) for p in swarm.peers for e in p.events("round")
                    if e["stage"] == 2 and e["train_loss"] is not None)
    assert len(losses) >= 6, losses
    early = sum(x for _, x in losses[:3]) / 3
    late = sum(x for _, x in losses[-3:]) / 3
    assert late < early, f"the loss did not fall: {early:.3f} -> {late:.3f}"
