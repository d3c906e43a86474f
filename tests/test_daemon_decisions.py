"""The daemon's small decisions and its round clock, tested without a network."""
from __future__ import annotations

import asyncio
from typing import Any

from swarmgrad.peer import decisions
from swarmgrad.peer.clock import RoundClock
from swarmgrad.peer.manifest import RoundsConfig
from swarmgrad.peer.records import JOINING, LEAVING
from support.records import rec




def ended(**kw: Any) -> bool:
    base = dict(round_no=3, seen=-1, counts_steps=False, inner_steps=0, steps_per_round=0, now=100.0, wall_end=None,
                drivers_min_round=None)
    return decisions.round_ended(**{**base, **kw})


def test_round_ends_on_each_condition_and_not_before() -> None:
    assert not ended()
    assert ended(seen=4) and not ended(seen=3)
    assert ended(counts_steps=True, inner_steps=5, steps_per_round=5)
    assert not ended(counts_steps=True, inner_steps=4, steps_per_round=5)
    assert not ended(counts_steps=False, inner_steps=9, steps_per_round=5)  # later stages follow the drivers
    assert ended(wall_end=100.0) and not ended(wall_end=100.5)
    assert ended(drivers_min_round=4) and not ended(drivers_min_round=3)


def test_drivers_min_round_ignores_non_drivers_and_offline() -> None:
    recs = [rec("a", stage=0, round_no=5, driver=True), rec("b", stage=0, round_no=2, driver=True, state=LEAVING),
            rec("c", stage=0, round_no=1, driver=False)]
    assert decisions.drivers_min_round(recs) == 5
    assert decisions.drivers_min_round([]) is None
    assert decisions.drivers_gone([rec("b", state=LEAVING)]) and not decisions.drivers_gone(recs)


def test_a_join_download_is_superseded_when_its_donors_applied_a_round_since() -> None:
    # the state arrived with 3 applied rounds; the donors finished round 3 while it travelled
    assert decisions.join_superseded([rec("a", applied=4, digest="x"), rec("b", applied=4, digest="x")], "me", 3)
    assert not decisions.join_superseded([rec("a", applied=3), rec("b", applied=3)], "me", 3)  # still current
    assert not decisions.join_superseded([rec("me", applied=9), rec("a", applied=3)], "me", 3)  # our own record
    # only donors count: a minority digest's (or a leaving replica's) claim does not trigger a download
    assert not decisions.join_superseded([rec("a", applied=3), rec("b", applied=3), rec("c", applied=9, digest="z")],
                                      "me", 3)
    assert not decisions.join_superseded([rec("a", applied=3), rec("b", applied=5, state=LEAVING)], "me", 3)


def test_a_boundary_holds_for_downloaders_until_they_serve_our_state_or_their_hold_runs_out() -> None:
    served = {"j": 100.0, "r": 100.0, "done": 90.0, "late": 60.0, "gone": 100.0, "left": 100.0, "mover": 100.0}
    records = [rec("me", digest="ours"), rec("j", state=JOINING, digest="seed"),
               rec("r", digest="old"),  # ONLINE but re-syncing: not yet on our state
               rec("done", digest="ours"), rec("late", state=JOINING), rec("left", state=LEAVING),
               rec("mover", state=JOINING, digest="ours")]
    waiting, settled = decisions.join_hold(served, records, "ours", now=105.0, hold=30.0)
    assert waiting == ["j", "mover", "r"]
    # serving our state, its record gone, or LEAVING: forgotten; "late" ran out: neither
    assert settled == ["done", "gone", "left"]
    assert decisions.join_hold(served, records, "ours", now=131.0, hold=30.0)[0] == []
    assert decisions.join_hold(served, records, "ours", now=105.0, hold=0.0)[0] == []
    assert decisions.join_hold({}, records, "ours", now=105.0, hold=30.0) == ([], [])
    # a joiner killed mid-download: its JOINING record outlives it, its connection does not
    assert decisions.join_hold(served, records, "ours", now=105.0, hold=30.0, connected={"j", "r"}) == (
        ["j", "r"], ["done", "gone", "late", "left", "mover"])
    # a joiner's first requests can reach us before its JOINING record does: not gone while that
    # record may still be on its way (unannounced), gone after, or once its connection is
    assert "gone" in decisions.join_hold(served, records, "ours", now=105.0, hold=30.0, unannounced=10.0)[0]
    assert "gone" in decisions.join_hold(served, records, "ours", now=111.0, hold=30.0, unannounced=10.0)[1]
    assert "gone" in decisions.join_hold(served, records, "ours", now=105.0, hold=30.0, unannounced=10.0,
                                         connected={"j"})[1]


def test_a_group_member_that_applied_the_round_already_finished_it_without_us() -> None:
    regs = {"me": {"applied_rounds": 4}, "a": {"applied_rounds": 4}, "b": {"applied_rounds": 4}}
    # a finished round 4 in a group without us (its record announces 5); b is still matching with us
    recs = [rec("me", applied=4), rec("a", applied=5), rec("b", applied=4)]
    assert decisions.finished_without_us(regs, recs, "me", ["a", "b", "me"]) == ["a"]
    assert decisions.finished_without_us(regs, recs, "me", ["b", "me"]) == []  # a is not in our group
    # a record that lags its registration (announced before the round) is not a finished round
    assert decisions.finished_without_us(regs, [rec("a", applied=3), rec("b", applied=4)], "me", ["a", "b", "me"]) == []
    # our own record, and members without a record (expired, or not read yet), say nothing
    assert decisions.finished_without_us(regs, [rec("me", applied=9)], "me", ["a", "b", "me"]) == []


def test_join_donors_follow_the_majority_not_the_biggest_claim() -> None:
    recs = [rec("a", applied=5, digest="x"), rec("b", applied=5, digest="x"), rec("liar", applied=10**9, digest="y"),
            rec("me", applied=0, digest="z"), rec("j", state=JOINING, digest="y")]
    assert decisions.join_donors(recs, "me") == ["a", "b"]
    assert decisions.join_donors([rec("me")], "me") == []
    # a tie between digests decides nothing (issue 43, point 3: it went to the higher claim)
    assert decisions.join_donors([rec("a", applied=3, digest="x"), rec("b", applied=4, digest="y")], "me") == []


def test_resync_donors_are_newer_and_agree() -> None:
    recs = [rec("a", applied=6, digest="n"), rec("b", applied=6, digest="n"), rec("c", applied=9, digest="evil"),
            rec("old", applied=4, digest="o"), rec("me", applied=5, digest="m")]
    assert decisions.resync_donors(recs, "me", 5, group=("a", "b", "c", "me"), stale=False) == ["a", "b"]
    # a stale member takes any group member's state, still by majority
    recs2 = [rec("a", applied=5, digest="g"), rec("b", applied=5, digest="g"), rec("me", applied=5, digest="m")]
    assert decisions.resync_donors(recs2, "me", 5, group=("a", "b"), stale=True) == ["a", "b"]
    assert decisions.resync_donors(recs2, "me", 5, group=("a", "b"), stale=False) == []


def test_resync_settles_when_every_other_member_moved_on() -> None:
    recs = [rec("a", round_no=4), rec("b", round_no=3)]
    assert not decisions.resync_settled(recs, ["a", "b"], 3)
    assert decisions.resync_settled([rec("a", round_no=4), rec("b", round_no=5)], ["a", "b"], 3)
    assert decisions.resync_settled([], [], 3)
    # a member that abandoned the round (it failed it too) or whose vote never came is not waited for
    assert decisions.resync_settled(recs, ["a", "b"], 3, abandoned=["b"])
    assert decisions.resync_settled([rec("a", round_no=4)], ["a", "b"], 3, silent=["b"])
    assert not decisions.resync_settled(recs, ["a", "b"], 3, abandoned=["x"], silent=["y"])


def test_eval_due() -> None:
    kw = dict(is_driver=True, driving=True, evaluating=False, eval_every=3, finished=False)
    assert [decisions.eval_due(rounds_done=r, **kw) for r in range(7)] == [False, False, False, True, False, False, True]
    assert not decisions.eval_due(rounds_done=3, **{**kw, "evaluating": True})
    assert not decisions.eval_due(rounds_done=3, **{**kw, "finished": True})
    assert not decisions.eval_due(rounds_done=3, **{**kw, "eval_every": 0})
    assert not decisions.eval_due(rounds_done=3, **{**kw, "driving": False})


def test_one_evaluator_per_round_chosen_alike_by_every_member_and_rotating() -> None:
    group = tuple(f"peer{i}" for i in range(5))
    for round_no in range(40):
        chosen = [p for p in group if decisions.evaluates(me=p, group=group, run_id="r", round_no=round_no, evaluators=1)]
        assert len(chosen) == 1
        # the members' order in the group does not change the choice
        assert chosen == [p for p in reversed(group)
                          if decisions.evaluates(me=p, group=tuple(reversed(group)), run_id="r", round_no=round_no,
                                              evaluators=1)]
    picks = {next(p for p in group if decisions.evaluates(me=p, group=group, run_id="r", round_no=r, evaluators=1))
             for r in range(40)}
    assert len(picks) >= 4, "the cost rotates among the drivers"
    two = [p for p in group if decisions.evaluates(me=p, group=group, run_id="r", round_no=7, evaluators=2)]
    assert len(two) == 2
    assert all(decisions.evaluates(me=p, group=group, run_id="r", round_no=7, evaluators=0) for p in group)
    assert all(decisions.evaluates(me=p, group=group, run_id="r", round_no=7, evaluators=9) for p in group)


def test_a_driver_outside_the_group_evaluates_its_own_state() -> None:
    # an incomplete round has no group: this driver's θ_global may not be the others'
    assert decisions.evaluates(me="a", group=(), run_id="r", round_no=3, evaluators=1)
    assert decisions.evaluates(me="a", group=("b", "c"), run_id="r", round_no=3, evaluators=1)


# --------------------------------------------------------------------------- the round clock

def test_clock_observe_wakes_and_never_goes_back() -> None:
    async def main() -> None:
        clock = RoundClock(RoundsConfig(round_seconds=0.0, inner_steps=5), counts_steps=False, max_rounds=0, epoch=None)
        assert not clock.observe(0)
        waiter = asyncio.create_task(clock.wait_change(5.0))
        await asyncio.sleep(0)
        assert clock.observe(2) and clock.seen == 2
        await asyncio.wait_for(waiter, 1.0)  # woken, not timed out
        assert clock.next_round(0.0) == 2
        clock.advance(2)
        clock.adopt(1, 0.0)
        assert clock.current == 2, "a downloaded state never moves the round backwards"
        clock.adopt(7, 0.0)
        assert clock.current == 7
    asyncio.run(main())


def test_clock_wall_rounds() -> None:
    clock = RoundClock(RoundsConfig(round_seconds=10.0), counts_steps=True, max_rounds=0, epoch=1000.0)
    assert clock.wall_round(999.0) == 0 and clock.wall_round(1035.0) == 3
    assert clock.wall_end(3) == 1040.0
    assert clock.next_round(1035.0) == 3
    clock.adopt(0, 1052.0)
    assert clock.current == 5
    assert not clock.counts_steps  # no H configured: nothing to count


def test_clock_counts_from_the_first_trained_round_and_finishes() -> None:
    clock = RoundClock(RoundsConfig(inner_steps=4, round_seconds=0.0), counts_steps=True, max_rounds=2, epoch=None)
    assert clock.steps_complete(4) and not clock.steps_complete(3)
    clock.count(False)
    clock.count(False)
    assert clock.rounds_done == 0 and not clock.finished
    clock.count(True)
    clock.count(False)  # once counting, every round counts
    assert clock.rounds_done == 2 and clock.finished
    assert not clock.steps_complete(4), "after the last round the worker must not pause itself"


def test_matchmaking_patience_grows_with_step_rounds_only() -> None:
    assert decisions.matchmaking_patience(5.0, 100.0, step_rounds=False) == 5.0
    assert decisions.matchmaking_patience(5.0, None, step_rounds=True) == 5.0
    assert decisions.matchmaking_patience(5.0, 100.0, step_rounds=True) == 50.0
    assert decisions.matchmaking_patience(5.0, 4.0, step_rounds=True) == 5.0
    assert decisions.matchmaking_patience(5.0, 1e9, step_rounds=True) == 600.0


def test_link_meter_learns_from_big_transfers_only() -> None:
    from swarmgrad.peer.net.rpc import LinkMeter
    meter = LinkMeter(min_bytes=1 << 20, alpha=0.5)
    assert meter.estimate(10e6) == 10e6  # nothing measured yet: the default
    meter.observe(4096, 0.001)  # a microbatch: latency-bound, says nothing about the link
    meter.observe(8 << 20, 0.0)  # no duration: ignored
    assert meter.estimate(10e6) == 10e6 and meter.samples == 0
    meter.observe(64 << 20, 2.0)
    assert meter.estimate(10e6) == (64 << 20) / 2.0
    meter.observe(64 << 20, 8.0)
    assert meter.estimate(10e6) == 0.5 * (64 << 20) / 2.0 + 0.5 * (64 << 20) / 8.0


def test_nobody_applied_from_the_outcome_votes() -> None:
    g = "g1"  # our group's hash; the votes are "<group hash>:<digest or failed>"
    # we voted failed (or never voted a digest): nobody in our group could see all digests
    assert decisions.nobody_applied({}, "a", g, False)
    assert decisions.nobody_applied({"a": "g1:failed", "b": "g1:d1", "c": "g1:d1"}, "a", g, False)
    # we voted a digest: only a failed vote under our hash proves nobody applied
    assert not decisions.nobody_applied({"a": "g1:d1", "b": "g1:d1"}, "a", g, True)
    assert not decisions.nobody_applied({"a": "g1:d1", "b": "g1:d1", "c": "g1:d1"}, "a", g, True)
    assert decisions.nobody_applied({"a": "g1:d1", "b": "g1:d1", "c": "g1:failed"}, "a", g, True)
    # replicas whose group excluded us (another hash) voted a digest: they may have applied it
    # (seen in a soak: our group of 3, theirs of 2, both completed their votes)
    assert not decisions.nobody_applied({"a": "g1:failed", "b": "g2:d1", "c": "g2:d1"}, "a", g, False)
    assert decisions.nobody_applied({"a": "g1:failed", "b": "g2:failed"}, "a", g, False)
    # our θ_global was not the group's reference: the group may well have applied it
    assert not decisions.nobody_applied({}, "a", None, False)


def test_a_resumed_swarm_clock_goes_on_at_the_checkpoint_round() -> None:
    from swarmgrad.peer.clock import resume_epoch
    now = 1_000_000.0
    clock = RoundClock(RoundsConfig(round_seconds=4.0), counts_steps=True, max_rounds=0,
                       epoch=resume_epoch(now, 10, 4.0))
    assert clock.wall_round(now) == 10 and clock.wall_end(10) == now + 4.0
    clock.adopt(10, now)  # the restored state's round: no wait of ten rounds for the clock
    assert clock.current == 10
    assert resume_epoch(now, 0, 4.0) == now and resume_epoch(now, -3, 4.0) == now
