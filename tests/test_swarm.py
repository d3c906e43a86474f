"""Swarm behaviour with real peer processes talking through hivemind on 127.0.0.1.

One swarm of four peers (two drivers on stage 0, two replicas of stage 1, a run until stopped)
serves the module's tests, in the order they are written, each checking one thing while it runs:
an outside client lists every peer; a driver's /metrics move; a stage-1 replica is SIGKILLed
mid-round and the swarm trains on (the only test that harms the swarm, so it comes after those that
read it); then, once validation dropped and each stage averaged rounds with both replicas, the
test stops every live peer with SIGTERM: each exits 0, and the replicas of each stage agreed after
every round. Each test waits for what it needs, so any one of them also runs alone (`-k`).

The run is not bounded by --max-rounds: its 4 s rounds go on in wall-clock time while the tests
take theirs, and on a loaded machine (a `swarmgrad status` process alone took 25-40 s at load 10-13)
a bounded run of 11 rounds had ended before the kill's survivor trained alone. A run that ends
after --max-rounds (each driver's final evaluation, every peer exiting 0 by itself) is checked in
real processes by tests/test_llama_processes.py, whose rounds count steps.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.error
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Callable

import pytest

from swarmgrad.peer.cli.launcher import LocalSwarm, PeerProcess

from conftest import small_manifest
from support.metrics_page import Samples, scrape, value

pytestmark = pytest.mark.timeout(240)

FULL_ROUNDS = 3
"""Rounds each stage averages with both replicas before the run is stopped (stage 1's before the kill)."""
LOSS_DROP = 1.5
"""Bits/byte that a driver's validation loss falls from the first evaluation before the run is stopped."""


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


def full_rounds(peers: list[PeerProcess], stage: int) -> list[int]:
    """Rounds of `stage` that both of its replicas completed, averaged together."""
    return sorted(r for r, events in complete_rounds(peers, stage).items()
                  if len(events) == 2 and all(e["group_size"] == 2 for e in events))


def wait_until(condition: Callable[[], bool], timeout: float, what: str, peers: list[PeerProcess]) -> None:
    """Poll `condition` (it reads the peers' event logs) until it holds; fail after `timeout` s, or at
    once when one of `peers` exited."""
    deadline = time.monotonic() + timeout
    while not condition():
        dead = [p for p in peers if not p.alive]
        if dead or time.monotonic() > deadline:
            cause = f"{dead[0].name} exited" if dead else f"not within {timeout:.0f}s"
            pytest.fail(f"{what}: {cause}\n" + "\n".join(p.log_tail(15) for p in peers))
        time.sleep(0.2)


@dataclass
class FourPeers:
    swarm: LocalSwarm
    watched: PeerProcess
    """The first driver: it serves /metrics on `metrics_port`."""
    metrics_port: int
    alone: Samples
    """The watched driver's /metrics before any other peer started."""
    victim: PeerProcess
    survivor: PeerProcess
    """The two replicas of stage 1; the victim is SIGKILLed mid-round."""
    killed: bool = False

    @property
    def drivers(self) -> list[PeerProcess]:
        return [p for p in self.swarm.peers if p.stage == 0]


@pytest.fixture(scope="module")
def four_peers(module_swarm: Callable) -> FourPeers:
    swarm: LocalSwarm = module_swarm(small_manifest())
    until_stopped = ("--max-rounds", "0")  # the last test stops the run (SIGTERM) once it has what it checks
    watched = swarm.start_first(0, *until_stopped, "--metrics-port", "0")
    port = watched.events("started")[0]["metrics_port"]
    assert isinstance(port, int) and port > 0
    alone = scrape(port)
    victim = swarm.start(1, *until_stopped)
    swarm.start(0, *until_stopped)
    survivor = swarm.start(1, *until_stopped)
    return FourPeers(swarm, watched, port, alone, victim, survivor)


def test_an_outside_client_lists_every_peer(four_peers: FourPeers) -> None:
    swarm = four_peers.swarm
    swarm.wait_for(four_peers.watched, lambda e: e["event"] == "round" and e["round"] >= 2 and e["complete"], 120,
                   "round 2")
    for peer in swarm.peers:  # the first one's rounds may begin before the others are up
        swarm.wait_for(peer, lambda e: e["event"] == "online", 120, "online")
    status = subprocess.run([sys.executable, "-m", "swarmgrad.peer.cli", "status", "--initial-peers",
                             *swarm.initial_peers, "--manifest", str(swarm.manifest)],
                            capture_output=True, text=True, timeout=120)  # a hang, not a slow start: 33 s at load 18
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


def test_live_peer_metrics_move(four_peers: FourPeers) -> None:
    """The first driver serves /metrics on a free port. Its rounds, activation and averaging bytes
    and samples move between two scrapes with a whole round between them: the round after the one
    the first scrape saw may have exchanged its parts before that scrape (its event comes after the
    vote and the outer step), so the check waits for the one after it."""
    swarm, watched, port = four_peers.swarm, four_peers.watched, four_peers.metrics_port
    before = four_peers.alone  # alone in the swarm: nothing trained, nothing sent down the pipeline
    assert value(before, "swarmgrad_round", stage="0") is None
    assert value(before, "swarmgrad_bytes_sent_total", kind="activations") == 0

    first = swarm.wait_for(watched, lambda e: e["event"] == "round" and e["samples"] > 0, 90, "a trained round")
    early = scrape(port)
    seen = value(early, "swarmgrad_round", stage="0")
    assert seen is not None and seen >= first["round"]
    assert value(early, "swarmgrad_samples_per_second", stage="0") > 0
    swarm.wait_for(watched, lambda e: e["event"] == "round" and e["round"] > seen + 1 and e["complete"]
                   and e["group_size"] == 2 and e["samples"] > 0, 60, "a later round averaged by both drivers")
    reported = sum(e["bytes_sent"] for e in watched.events("round"))  # read before the scrape: no newer round
    late = scrape(port)

    def grew(name: str, **labels: str) -> bool:
        before, after = value(early, name, **labels) or 0, value(late, name, **labels) or 0
        if after <= before:  # say which figures did not move, for a failure that a rerun would hide
            print(f"{name}{labels}: {before} at round {seen}, {after} at round {value(late, 'swarmgrad_round', stage='0')}")
        return after > before

    assert grew("swarmgrad_round", stage="0")
    assert grew("swarmgrad_samples_total", stage="0")
    assert value(late, "swarmgrad_samples_per_second", stage="0") > 0
    assert grew("swarmgrad_bytes_sent_total", kind="activations")
    assert grew("swarmgrad_bytes_received_total", kind="gradients")
    assert grew("swarmgrad_bytes_sent_total", kind="averaging")
    assert grew("swarmgrad_bytes_received_total", kind="averaging")
    assert value(late, "swarmgrad_group_size", stage="0") >= 1
    assert value(late, "swarmgrad_rounds_total", stage="0", result="complete") >= 1
    # the Prometheus byte counts are the ones the events report
    assert sum(v for (name, _), v in late.items() if name == "swarmgrad_bytes_sent_total") >= reported > 0


def test_replica_killed_mid_round_swarm_keeps_training(four_peers: FourPeers) -> None:
    swarm, victim, survivor = four_peers.swarm, four_peers.victim, four_peers.survivor
    drivers = four_peers.drivers
    # first the rounds that the run's end asks stage 1 to have averaged with both replicas
    wait_until(lambda: len(full_rounds([victim, survivor], 1)) >= FULL_ROUNDS, 150,
               f"{FULL_ROUNDS} rounds averaged by both stage-1 replicas", swarm.peers)
    # mid-round: both stage-1 replicas and the drivers are past that round's averaging, so the
    # drivers are training the next one and microbatches are in flight to the victim
    last = full_rounds([victim, survivor], 1)[-1]
    for driver in drivers:
        swarm.wait_for(driver, lambda e: e["event"] == "round" and e["round"] >= last, 30,
                       f"the drivers' round {last}")
    victim.kill_group(signal.SIGKILL)
    four_peers.killed = True
    killed_at = time.time()
    completed_before = [len(d.events("round")) for d in drivers]
    swarm.wait_for(survivor, lambda e: e["event"] == "round" and e["time"] > killed_at + 1 and e["complete"]
                   and e["group_size"] == 1, 90, "a round completed by the survivor alone")
    for driver in drivers:
        swarm.wait_for(driver, lambda e: e["event"] == "round" and e["time"] > killed_at + 1 and e["complete"]
                       and e["samples"] > 0, 60, "a driver round with trained samples after the kill")
    retries = [r for d in drivers for r in d.events("retry")]
    assert retries, "no driver re-sent a microbatch after the replica died"
    victim_id = victim.events("started")[0]["peer"]
    assert any(r["failed_peer"] == victim_id for r in retries)
    for driver, before in zip(drivers, completed_before):
        assert not driver.events("lost"), "a microbatch was given up instead of re-routed"
        assert len(driver.events("round")) > before
    assert_replicas_agree(swarm.peers, 1)


def driver_evals(drivers: list[PeerProcess]) -> list[dict]:
    return sorted((e for d in drivers for e in d.events("eval") if e["val_loss"] is not None), key=lambda e: e["time"])


def test_four_peers_train_and_replicas_stay_identical(four_peers: FourPeers) -> None:
    """Once validation dropped and each stage averaged rounds with both replicas, every peer still
    running (the survivor and the drivers after the kill too) is stopped with SIGTERM and exits 0,
    and what the whole run did is checked."""
    swarm = four_peers.swarm
    drivers = four_peers.drivers
    live = [p for p in swarm.peers if p.alive]

    def trained() -> bool:
        evals = driver_evals(drivers)
        return (all(len(full_rounds(swarm.peers, stage)) >= FULL_ROUNDS for stage in (0, 1))
                and len(evals) >= 2 and evals[-1]["val_loss"] < evals[0]["val_loss"] - LOSS_DROP)
    # a deadline for a hang only: at 4 s a round, a loaded machine trains fewer steps in each
    wait_until(trained, 150, f"validation {LOSS_DROP} bits/byte down and {FULL_ROUNDS} rounds averaged by both "
               "replicas of each stage", live)
    for peer in live:
        peer.signal(signal.SIGTERM)
    codes = dict(zip((p.name for p in swarm.peers), swarm.wait_exit(60)))
    expected = {p.name: -signal.SIGKILL if p is four_peers.victim and four_peers.killed else 0 for p in swarm.peers}
    assert codes == expected, "\n".join(p.log_tail() for p in swarm.peers)
    with pytest.raises(urllib.error.URLError):  # a clean stop also stops the metrics server
        scrape(four_peers.metrics_port)
    for stage in (0, 1):
        assert_replicas_agree(swarm.peers, stage)
        full = full_rounds(swarm.peers, stage)
        assert len(full) >= FULL_ROUNDS, (f"stage {stage}: too few rounds averaged by both replicas: {full}\n"
                                          + round_history(swarm.peers, stage))
    evals = driver_evals(drivers)
    assert evals[0]["val_loss"] > 7.0, "an untrained byte model scores about 8 bits/byte"
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - LOSS_DROP, f"validation loss did not go down: {evals}"
    # between start and end, one driver per round evaluates (data.evaluators 1): both hold θ_global
    # bit for bit, so a second would score the same model again
    full0 = set(full_rounds(swarm.peers, 0))
    due = Counter(e["after_round"] for e in evals if e["after_round"] in full0)
    assert due and max(due.values()) == 1, (due, evals)
    # a driver's round weights are the samples it trained on
    samples = [e["samples"] for p in drivers for e in p.events("round")]
    assert sum(samples) > 0
    for peer in swarm.peers:
        if codes[peer.name] == 0:
            stopped = peer.events("stopped")
            assert stopped and stopped[0]["bytes_sent"] > 0
