"""Overlapped rounds with real peer processes through hivemind on 127.0.0.1: two whole-model
replicas average in the background and still hold one θ_global after every round; a joiner
takes a state between rounds (never one whose averaging is in flight) and averages with them,
every replica's noise-corrected AdamW (inner.swarm_second_moment) follows the group's size, and
with rounds.overlap_steps = 1 a replica waits for each mean after one step of the next round."""
from __future__ import annotations

import pytest

from swarmgrad.peer.cli.launcher import LocalSwarm

from conftest import small_manifest
from test_swarm import assert_replicas_agree, complete_rounds, round_history

pytestmark = pytest.mark.timeout(120)


def test_overlapped_replicas_agree_after_every_round_and_a_joiner_fits_in(local_swarm) -> None:
    manifest = small_manifest(stages={"count": 1}, rounds={"round_seconds": 2.5, "overlap": True, "overlap_steps": 1},
                              inner={"lr": 3e-3, "microbatch_size": 4, "microbatches_per_step": 2,
                                     "swarm_second_moment": True})
    swarm: LocalSwarm = local_swarm(manifest)
    # 14 rounds of 2.5 s: on two busy cores the joiner's start and state download took 14 s, and
    # with 10 rounds the first replica had finished before the joiner was online (no round of three)
    first = swarm.start_first(0, "--max-rounds", "14", "--linger", "5")
    second = swarm.start(0, "--max-rounds", "14", "--linger", "5")
    swarm.wait_for(second, lambda e: e["event"] == "online", 40, "the second replica online")
    joiner = swarm.start(0, "--max-rounds", "4", "--linger", "5")
    codes = swarm.wait_exit(100)
    history = round_history(swarm.peers, 0)
    assert codes == [0, 0, 0], history + "\n".join(p.log_tail() for p in swarm.peers)
    assert_replicas_agree(swarm.peers, 0)
    rounds = complete_rounds(swarm.peers, 0)
    overlapped = [r for r, events in rounds.items() if len(events) >= 2 and all(e["overlapped"] for e in events)]
    assert len(overlapped) >= 2, f"too few overlapped rounds averaged together: {sorted(rounds)}\n{history}"
    # a mean over hivemind takes longer than one step of this tiny model: the bound made replicas wait
    waits = [e["mean_wait_s"] for p in swarm.peers for e in p.events("round") if e["overlapped"]]
    assert all(w >= 0 for w in waits) and any(w > 0 for w in waits), waits
    for peer in swarm.peers:
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
    for peer in swarm.peers:
        events = [e for e in peer.events("round")]
        assert all(e["moment_replicas"] >= 1 for e in events), history
        for before, after in zip(events, events[1:]):
            if before["complete"]:
                assert after["moment_replicas"] == before["group_size"], history
    assert any(e["moment_replicas"] == 3 for p in swarm.peers for e in p.events("round")), history
