"""A replica that joins a running stage downloads its state and averages in its next round: real
peers in one event loop (tests/support/swarm.py)."""
from __future__ import annotations

import time

import pytest

from support.swarm import InProcessSwarm, step_manifest

pytestmark = pytest.mark.timeout(120)


def test_late_joiner_receives_state_and_joins_next_round(inprocess) -> None:
    """Replaces the real-process tests/test_swarm.py::test_late_joiner_receives_state_and_joins_next_round
    (every assertion kept; rounds of 2 inner steps instead of 4 s of wall clock)."""
    async def scenario() -> None:
        async with InProcessSwarm(step_manifest(2)) as swarm:
            swarm.start(0)
            old = swarm.start(1)
            await swarm.wait_for(old, lambda e: e["event"] == "round" and e["complete"] and e["samples"] > 0, 30,
                                 "a trained round on stage 1")
            joiner = swarm.start(1)
            loaded = await swarm.wait_for(joiner, lambda e: e["event"] == "state_loaded", 30, "state download")
            assert loaded["source"] == old.peer_id == old.events("started")[0]["peer"]
            # the state it received is the replica's θ_global as of the round it had completed
            old_digests = {e["digest"] for e in old.events("round") if e["complete"]} | \
                          {e["digest"] for e in old.events("online")}
            assert loaded["digest"] in old_digests
            # it takes part in the next round (or, if it came online too close to a boundary for the
            # others to see it, the one after): same group, same θ_global afterwards
            await swarm.wait_round(joiner, 30, "the joiner's first round", complete=True)
            joined = joiner.events("round")[:2]
            full = [e for e in joined if e["complete"] and e["group_size"] == 2]
            assert full, joined
            same = await swarm.wait_round(old, 30, "the old replica's event for the same round", round=full[0]["round"])
            assert same["digest"] == full[0]["digest"], (same, full[0])
            started = time.monotonic()
            await swarm.stop(joiner, timeout=20)  # as SIGTERM: a clean exit
            assert time.monotonic() - started < 15
            assert joiner.events("stopped")

    inprocess(scenario)
