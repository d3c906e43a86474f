"""The pipeline end to end with real peers in one event loop (tests/support/swarm.py): the
adaptive window (the driver sizes its window from what it measured, reports the bottleneck every
round, and the pipeline trains) and lookahead on every stage. No timing is asserted."""
from __future__ import annotations

import logging

import pytest

from conftest import small_manifest
from support.swarm import InProcessSwarm, step_manifest

pytestmark = pytest.mark.timeout(120)

CAP = 6


def test_two_stage_pipeline_with_the_adaptive_window_trains(inprocess, caplog: pytest.LogCaptureFixture) -> None:
    """Replaces the real-process version of this test (every assertion kept; rounds of 4 inner
    steps instead of 4 s of wall clock; the driver's log is the captured log of this process)."""
    caplog.set_level(logging.INFO, logger="swarmgrad.peer.pipeline.driving_loop")
    manifest = step_manifest(4, pipeline={"max_in_flight": CAP}, inner={"microbatches_per_step": CAP})

    async def scenario() -> None:
        async with InProcessSwarm(manifest) as swarm:
            driver = swarm.start(0, max_rounds=4, linger=60.0)
            swarm.start(1, max_rounds=4, linger=60.0)
            await swarm.wait_exit(40)

            reports = driver.events("pipeline")
            assert len(reports) >= 3, swarm.history()
            for r in reports:
                assert 1 <= r["window"] <= CAP and r["max_in_flight"] == CAP
                assert r["window_limited_by"] in ("need", "cap", "memory")
                assert r["bottleneck"] in ("link", "compute")
                assert 0.0 <= r["link_util"] <= 1.0 and 0.0 <= r["compute_util"] <= 1.0
                assert r["bottleneck"] == ("link" if r["link_util"] > r["compute_util"] else "compute")
                assert 0.0 <= r["step_gap_share"] <= 1.0
                assert 0.0 < r["core_share"] <= 1.0  # a CPU device: the share of a core its compute thread got
            # exact steps: the uplink waits between one step's last request and the next one's first
            assert max(r["step_gap_share"] for r in reports) > 0
            last = reports[-1]
            # sized from measurements, not the cap's default: trips were observed and a trip length known
            assert last["samples"] > 0 and last["window_needed"] is not None and last["trip_s"] > 0
            assert last["local_compute_s"] > 0 and last["remote_s"] > 0
            assert "stage 0 pipeline: window" in caplog.text

            rounds = [e for e in driver.events("round") if e["complete"]]
            assert len(rounds) >= 3 and sum(e["samples"] > 0 for e in rounds) >= 2  # the first may precede driving
            evals = sorted((e for e in driver.events("eval") if e["val_loss"] is not None), key=lambda e: e["time"])
            assert evals[0]["val_loss"] > 7.0, "an untrained byte model scores about 8 bits/byte"
            assert evals[-1]["final"] and evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.5, evals
            assert driver.events("eval")[-1]["lost"] == 0

    inprocess(scenario)


def test_three_stage_pipeline_with_lookahead_trains_every_microbatch_once(inprocess) -> None:
    """pipeline.lookahead on every stage (peer/compute/lookahead.py), over wall-clock rounds (so rounds end
    with microbatches ahead in flight): the next step's microbatches run ahead, every microbatch is
    trained on once at every stage, and the pipeline learns. Replaces the real-process version
    (every assertion kept). Rounds of 2 s instead of 4 s, and the outer step a plain copy of the
    round's result (outer lr 1, no momentum): in half the training time the loss must still fall
    by 0.5, and the default outer momentum's swings on a lone replica per stage are noise here."""
    manifest = small_manifest(model={"n_layers": 3}, stages={"count": 3}, rounds={"round_seconds": 2.0},
                              pipeline={"max_in_flight": 4, "lookahead": True}, inner={"microbatches_per_step": 2},
                              outer={"lr": 1.0, "momentum": 0.0, "nesterov": False})

    async def scenario() -> None:
        async with InProcessSwarm(manifest) as swarm:
            driver = swarm.start(0, max_rounds=4, linger=60.0)
            later = [swarm.start(s, max_rounds=4, linger=60.0) for s in (1, 2)]
            await swarm.wait_exit(40)

            reports = driver.events("pipeline")
            assert any(r["ahead_share"] > 0 for r in reports), reports
            assert all(0.0 <= r["ahead_share"] <= 1.0 for r in reports)
            for peer in later:
                rounds = peer.events("round")
                committed = [c for e in rounds for c in e["committed"]]
                assert committed and len(committed) == len(set(committed)), f"{peer.name}: a microbatch trained twice"
                assert rounds[-1]["uncommitted"] == 0, swarm.history()
            evals = sorted((e for e in driver.events("eval") if e["val_loss"] is not None), key=lambda e: e["time"])
            assert evals[-1]["final"] and evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.5, evals
            assert driver.events("eval")[-1]["lost"] == 0

    inprocess(scenario)
