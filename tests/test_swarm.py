"""Swarm behaviour with real peer processes talking through hivemind on 127.0.0.1."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict

import pytest

from swarmgrad.peer.cli.launcher import LocalSwarm, PeerProcess

from conftest import small_manifest

pytestmark = pytest.mark.timeout(240)


def complete_rounds(peers: list[PeerProcess], stage: int) -> dict[int, list[dict]]:
    by_round: dict[int, list[dict]] = defaultdict(list)
    for peer in peers:
        for e in peer.events("round"):
            if e["stage"] == stage and e["complete"]:
                by_round[e["round"]].append(e)
    return by_round


def assert_replicas_agree(peers: list[PeerProcess], stage: int) -> None:
    """Every replica that completed a round holds the same θ_global (and outer momentum) after it."""
    for rnd, events in complete_rounds(peers, stage).items():
        digests = {e["digest"] for e in events}
        assert len(digests) == 1, f"stage {stage} round {rnd}: replicas disagree: {digests}"


def round_history(peers: list[PeerProcess], stage: int) -> str:
    """Each replica's life and rounds on `stage`, for a failure message (CI keeps no peer logs)."""
    lines = []
    for peer in peers:
        if peer.stage != stage:
            continue
        life = [f"{e['event']}@{e['time'] % 1000:.1f}" for e in peer.events()
                if e["event"] in ("started", "state_initialised", "state_loaded", "online", "stopped")]
        rounds = [f"r{e['round']}:{'ok' if e['complete'] else 'INCOMPLETE ' + e['reason']}/g{e['group_size']}"
                  f"@{e['time'] % 1000:.1f}" for e in peer.events("round") if e["stage"] == stage]
        lines.append(f"  {peer.name}: {' '.join(life)}\n    {' '.join(rounds)}")
    return "\n".join(lines)


def test_four_peers_train_and_replicas_stay_identical(local_swarm) -> None:
    manifest = small_manifest()
    swarm: LocalSwarm = local_swarm(manifest)
    # 6 rounds so that a replica slowed at start-up on 2 busy cores still shares 3 with its partner.
    # Stage 1 serves until the drivers' records say they left (their final evaluations pass through
    # it); --linger only bounds that wait, and 15 s ran out once before a slowed driver's final eval
    first = swarm.start_first(0, "--max-rounds", "6", "--linger", "60")
    for stage in (1, 0, 1):
        swarm.start(stage, "--max-rounds", "6", "--linger", "60")
    # the swarm is visible to an outside client while it runs
    swarm.wait_for(first, lambda e: e["event"] == "round" and e["round"] >= 2 and e["complete"], 120, "round 2")
    status = subprocess.run([sys.executable, "-m", "swarmgrad.peer.cli", "status", "--initial-peers",
                             *swarm.initial_peers, "--manifest", str(swarm.manifest)],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert "run test-run" in status.stdout
    for peer in swarm.peers:
        peer_id = peer.events("started")[0]["peer"]
        assert peer_id in status.stdout, status.stdout
    assert "stage 0: 2 replica(s)" in status.stdout and "stage 1: 2 replica(s)" in status.stdout
    assert status.stdout.count(" pinned ") == 4 and "is empty" not in status.stdout, status.stdout  # --stage N each
    # pinned peers skip the every-stage benchmark but still announce a measured rate from the start
    expected = {p.name: p.events("started")[0]["expected_rate"] for p in swarm.peers}
    assert all(rate > 0 for rate in expected.values()), expected

    codes = swarm.wait_exit(150)
    assert codes == [0, 0, 0, 0], "\n".join(p.log_tail() for p in swarm.peers)
    for stage in (0, 1):
        assert_replicas_agree(swarm.peers, stage)
        full = [r for r, events in complete_rounds(swarm.peers, stage).items()
                if len(events) == 2 and all(e["group_size"] == 2 for e in events)]
        assert len(full) >= 3, (f"stage {stage}: too few rounds averaged by both replicas: {full}\n"
                                + round_history(swarm.peers, stage))
    drivers = [p for p in swarm.peers if p.stage == 0]
    evals = sorted((e for d in drivers for e in d.events("eval") if e["val_loss"] is not None), key=lambda e: e["time"])
    assert evals[0]["val_loss"] > 7.0, "an untrained byte model scores about 8 bits/byte"
    finals = [e for e in evals if e["final"]]
    assert len(finals) == 2, f"each driver evaluates once more after its last round: {evals}"
    for final in finals:
        assert final["val_loss"] < evals[0]["val_loss"] - 1.5, f"validation loss did not go down: {evals}"
    # between start and end, one driver per round evaluates (data.evaluators 1): both hold θ_global
    # bit for bit, so a second would score the same model again
    full0 = {r for r, events in complete_rounds(swarm.peers, 0).items()
             if len(events) == 2 and all(e["group_size"] == 2 for e in events)}
    due = Counter(e["after_round"] for e in evals if e["after_round"] in full0)
    assert due and max(due.values()) == 1, (due, evals)
    # a driver's round weights are the samples it trained on
    samples = [e["samples"] for p in drivers for e in p.events("round")]
    assert sum(samples) > 0
    for peer in swarm.peers:
        stopped = peer.events("stopped")
        assert stopped and stopped[0]["bytes_sent"] > 0


def test_replica_killed_mid_round_swarm_keeps_training(local_swarm) -> None:
    manifest = small_manifest()
    swarm: LocalSwarm = local_swarm(manifest)
    driver = swarm.start_first(0, "--linger", "5")
    victim = swarm.start(1)
    survivor = swarm.start(1)
    swarm.wait_for(survivor, lambda e: e["event"] == "round" and e["complete"] and e["group_size"] == 2, 120,
                   "a round averaged by both stage-1 replicas")
    # SIGKILL in the middle of the next round's inner steps: microbatches are in flight to it
    time.sleep(1.5)
    victim.kill_group(signal.SIGKILL)
    killed_at = time.time()
    completed_before = len(driver.events("round"))
    swarm.wait_for(survivor, lambda e: e["event"] == "round" and e["time"] > killed_at + 1 and e["complete"]
                   and e["group_size"] == 1, 90, "a round completed by the survivor alone")
    swarm.wait_for(driver, lambda e: e["event"] == "round" and e["time"] > killed_at + 1 and e["complete"]
                   and e["samples"] > 0, 60, "a driver round with trained samples after the kill")
    retries = driver.events("retry")
    assert retries, "the driver never re-sent a microbatch after the replica died"
    victim_id = victim.events("started")[0]["peer"]
    assert any(r["failed_peer"] == victim_id for r in retries)
    assert not driver.events("lost"), "a microbatch was given up instead of re-routed"
    assert len(driver.events("round")) > completed_before
    assert_replicas_agree(swarm.peers, 1)
    # the survivor and the driver still shut down cleanly
    for peer in (driver, survivor):
        peer.signal(signal.SIGTERM)
    for peer in (driver, survivor):
        assert peer.proc.wait(20) == 0, peer.log_tail()
