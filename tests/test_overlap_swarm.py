"""Overlapped rounds with real peers in one event loop (tests/support/swarm.py): two whole-model
replicas average in the background and still hold one θ_global after every round; a joiner
takes a state between rounds (never one whose averaging is in flight) and averages with them,
every replica's noise-corrected AdamW (inner.swarm_second_moment) follows the group's size, and
with rounds.overlap_steps = 1 a replica waits for each mean after one step of the next round."""
from __future__ import annotations

import pytest

from support.swarm import InProcessSwarm, LinkSpec, assert_replicas_agree, complete_rounds, step_manifest

pytestmark = pytest.mark.timeout(120)

LAN = LinkSpec(delay=0.005)
"""5 ms each way: a mean takes a few round trips, longer than one inner step of this tiny model."""


def test_overlapped_replicas_agree_after_every_round_and_a_joiner_fits_in(inprocess) -> None:
    """Replaces the real-process version of this test (every assertion kept; rounds of 3 inner
    steps instead of 2.5 s of wall clock, links of 5 ms instead of p2pd on 127.0.0.1)."""
    manifest = step_manifest(3, stages={"count": 1}, rounds={"overlap": True, "overlap_steps": 1},
                             inner={"lr": 3e-3, "microbatch_size": 4, "microbatches_per_step": 2,
                                    "swarm_second_moment": True})

    async def scenario() -> None:
        async with InProcessSwarm(manifest, link=LAN) as swarm:
            first = swarm.start(0, max_rounds=14, linger=5.0)
            # the first opens the swarm (a process's start takes the others seconds): it initialises the stage
            await swarm.wait_for(first, lambda e: e["event"] == "online", 30, "the first replica online")
            second = swarm.start(0, max_rounds=14, linger=5.0)
            await swarm.wait_for(second, lambda e: e["event"] == "online", 30, "the second replica online")
            joiner = swarm.start(0, max_rounds=4, linger=5.0)
            await swarm.wait_exit(40)
            history = swarm.history()
            peers = swarm.peers
            assert all(p.events("stopped") for p in peers), history
            assert_replicas_agree(peers, 0)
            rounds = complete_rounds(peers, 0)
            overlapped = [r for r, events in rounds.items() if len(events) >= 2 and all(e["overlapped"] for e in events)]
            assert len(overlapped) >= 2, f"too few overlapped rounds averaged together: {sorted(rounds)}\n{history}"
            # a mean takes longer than one step of this tiny model: the bound made replicas wait
            waits = [e["mean_wait_s"] for p in peers for e in p.events("round") if e["overlapped"]]
            assert all(w >= 0 for w in waits) and any(w > 0 for w in waits), waits
            for peer in peers:
                events = peer.events("round")
                assert all(0.0 <= e["utilisation"] <= 1.0 for e in events)
                assert not events[-1]["overlapped"], "the last round of a bounded run waits for its mean"
                assert any(e["utilisation"] > 0 for e in events)
                for e in (e for e in events if e["complete"] and e["group_size"] >= 2):  # where averaging_s went
                    phases = [e["matchmaking_s"], e["exchange_s"], e["vote_s"]]
                    assert all(x is not None and x >= 0 for x in phases), e
            # the joiner downloaded a committed state (a round's result, not one being replaced) and then
            # averaged with the others: same group, same θ_global (assert_replicas_agree)
            loaded = joiner.events("state_loaded")
            assert loaded, history
            old = {e["digest"] for p in (first, second) for e in p.events("round") if e["complete"]} | \
                  {e["digest"] for p in (first, second) for e in p.events("online")}
            assert loaded[0]["digest"] in old
            joined = [e for e in joiner.events("round") if e["complete"] and e["group_size"] >= 2]
            assert joined, history
            # the first replica scores the seed before it trains; the joiner does not score again the θ its
            # donors scored: it drives at once (its first evaluation comes with a round)
            assert first.events("driving")[0]["evaluated_at_start"] is True
            assert joiner.events("driving")[0]["evaluated_at_start"] is False
            first_round = joiner.events("round")[0]["time"]
            assert not [e for e in joiner.events("eval") if e["time"] < first_round], joiner.events("eval")
            # SwarmAdamW's M: the size of the replica's last complete group (its first guess: the stage's
            # ONLINE replicas), so after a round of three every member corrects for three
            for peer in peers:
                events = peer.events("round")
                assert all(e["moment_replicas"] >= 1 for e in events), history
                for before, after in zip(events, events[1:]):
                    if before["complete"]:
                        assert after["moment_replicas"] == before["group_size"], history
            assert any(e["moment_replicas"] == 3 for p in peers for e in p.events("round")), history

    inprocess(scenario)
