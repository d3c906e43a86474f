"""The last replica of a stage dies: a peer that takes the empty stage restores it from a backup
held by a peer of another stage (peer/state/backup.py), instead of starting it again from the seed."""
from __future__ import annotations

import signal
import time

import pytest

from swarmgrad.peer.cli.launcher import LocalSwarm

from conftest import small_manifest

pytestmark = pytest.mark.timeout(300)


UNTRAINED_BITS = 8.0
"""log2(256): a byte model that knows nothing."""


def complete_rounds(peer, stage: int) -> list[dict]:
    return [e for e in peer.events("round") if e["stage"] == stage and e["complete"] and e["samples"] > 0]


def test_empty_stage_is_restored_from_a_backup(local_swarm) -> None:
    # every round's push (no pacing): the check below counts the rounds a restore may lose
    m = small_manifest(averaging={"backup_link_share": 1.0})
    swarm: LocalSwarm = local_swarm(m)
    driver = swarm.start_first(0)
    victim = swarm.start(1)
    second = swarm.start(0)  # a second stage-0 replica: two peers that can hold stage 1's backup
    # one driver per round evaluates (data.evaluators), in turn: the swarm's figures are both drivers'
    evals = lambda: [e for p in (driver, second) for e in p.events("eval") if e["val_loss"] is not None]  # noqa: E731
    swarm.wait_for(victim, lambda e: len(complete_rounds(victim, 1)) >= 3, 150, "3 trained rounds on stage 1")
    trained = max(e["applied_rounds"] for e in complete_rounds(victim, 1))
    pushes = victim.events("backup")
    assert pushes and all(p["bytes"] > 0 and p["holders"] for p in pushes), pushes
    first_eval = min(evals(), key=lambda e: e["time"])
    victim.kill_group(signal.SIGKILL)
    killed_at = time.time()
    before = sorted((e for e in evals() if e["time"] < killed_at), key=lambda e: e["time"])

    refill = swarm.start(1)
    restored = swarm.wait_for(refill, lambda e: e["event"] in ("state_restored", "state_initialised", "state_loaded"),
                              90, "the refill's state")
    assert restored["event"] == "state_restored", f"stage 1 was not restored from a backup: {restored}"
    assert restored["applied_rounds"] >= trained - 1, (restored, trained)  # at most the push of one round lost
    assert restored["source"] != victim.name
    # the stage trains on, and the swarm's validation loss does not jump back to an untrained model's.
    # Three rounds, not two: once, on a loaded machine, the evaluation after two rounds was +0.62
    # bits/byte above the last one before the kill (the refill starts with fresh AdamW moments: a
    # backup is θ_global and the outer momentum, and Adam's first steps move every weight by
    # about the lr), so the check waits a round longer before it compares.
    swarm.wait_for(refill, lambda e: len(complete_rounds(refill, 1)) >= 3, 90, "rounds after the restore")
    after = sorted((e for e in evals() if e["time"] > restored["time"]), key=lambda e: e["time"])
    assert after, "a driver evaluated after the restore"
    # against an untrained byte model's ~8 bits/byte, not the first evaluation that succeeded: on a
    # slow machine that one came after rounds of training (6.19), and the run's few rounds then
    # failed a bound set from it (5.26 against 5.19) although nothing jumped back
    assert after[-1]["val_loss"] < UNTRAINED_BITS - 1.0, (first_eval, after[-1])
    assert after[-1]["val_loss"] < before[-1]["val_loss"] + 0.5, (before[-1], after[-1])
    assert driver.alive
