"""Members that fail rounds sit out the next groups for a growing time (peer/averaging/exclusion.py;
issue 43, point 8): the pure rules, and real Averagers in one event loop (loopback RPC, in-memory
DHT) with one member that votes "failed" every round or withholds its part."""
from __future__ import annotations

import asyncio

import pytest

from swarmgrad.peer.averaging import outcome
from swarmgrad.peer.averaging.exclusion import (FORGIVE_ROUNDS, MAX_EXCLUSION_ROUNDS, Standing, after_round, blame,
                                                excluded)

from test_averaging_inprocess import PEERS, deltas, group, manifest, run_all

pytestmark = [pytest.mark.timeout(60)]


def test_blame_counts_only_what_the_member_saw_itself() -> None:
    a, b, c, me = "a", "b", "c", "me"
    members = (a, b, c, me)
    # a part failed: the member whose contribution never reached our part withheld it
    assert blame(me=me, members=members, contributed={b, c, me}, part_failed=True, silent_reducers={b}) == {a}
    # our part had everything: a reducer that never answered is blamed, one that refused is not passed
    assert blame(me=me, members=members, contributed=set(members), part_failed=True, silent_reducers={b}) == {b}
    assert blame(me=me, members=members, contributed=set(members), part_failed=True) == frozenset()
    # nothing failed of itself: whoever voted failed, or did not vote, is blamed
    assert blame(me=me, members=members, contributed=set(members), part_failed=False, failed_votes={c},
                 missing_votes={a}) == {a, c}
    # a failed vote after a part failed is a reaction to that failure, not a fault of its own
    assert blame(me=me, members=members, contributed=set(members), part_failed=True, failed_votes={c}) == frozenset()
    assert me not in blame(me=me, members=members, contributed=set(), part_failed=True)
    # a reducer that refused our part as of another round: the members disagree about the round (we
    # may be the one behind, grouped by registrations written before the others went on), not a fault
    assert blame(me=me, members=members, contributed={b, c, me}, part_failed=True, silent_reducers={b},
                 wrong_round=True) == frozenset()


def test_exclusion_grows_with_strikes_and_is_forgiven_by_completed_rounds() -> None:
    s = after_round({}, 10, blamed={"x"})
    assert excluded(s, 11) == {"x"} and excluded(s, 12) == frozenset()  # one round out after a first failure
    s = after_round(s, 12, blamed={"x"})
    assert excluded(s, 14) == {"x"} and excluded(s, 15) == frozenset()  # then two, four, ...
    s = after_round(s, 15, blamed={"x"})
    assert s["x"] == Standing(3, 19, 0)
    for r in range(20, 20 + 40):
        s = after_round(s, r, blamed={"y"})
    assert s["y"].until == 59 + MAX_EXCLUSION_ROUNDS  # bounded: a lost cause is tried again now and then
    # an honest member that failed once is back after one round, and forgotten after FORGIVE_ROUNDS
    h = after_round({}, 0, blamed={"h"})
    for r in range(2, 2 + FORGIVE_ROUNDS):
        h = after_round(h, r, completed_with={"h", "me"})
    assert h == {}


@pytest.mark.inprocess
def test_a_member_that_votes_failed_every_round_is_left_out(monkeypatch) -> None:
    """On main, a member that completes the exchange and then votes "failed" fails every round of
    its stage: here the honest members complete round 1 without it."""
    real_agree = outcome.agree
    liar = PEERS[2]

    async def agree(board, stage, round_no, members, group_hash, me, digest, *args, **kwargs):
        if me == liar:
            await board.post_check(stage, round_no, me, outcome.vote(group_hash, None))
            return outcome.Outcome(False, "voted failed on purpose")
        return await real_agree(board, stage, round_no, members, group_hash, me, digest, *args, **kwargs)
    monkeypatch.setattr(outcome, "agree", agree)

    async def main() -> None:
        _, _, avgs = await group(3, manifest(robust=0))
        first = await run_all(avgs, [deltas(i) for i in range(3)], [1.0, 1.0, 1.0], round_no=0)
        assert not any(r.complete for r in first)
        assert [r.blamed for r in first[:2]] == [(liar,), (liar,)]
        second = await run_all(avgs, [deltas(i) for i in range(3)], [1.0, 1.0, 1.0], round_no=1)
        assert [r.complete for r in second] == [True, True, False], [r.reason for r in second]
        assert second[0].group == tuple(sorted(PEERS[:2]))
    asyncio.run(main())


@pytest.mark.inprocess
def test_a_member_that_withholds_its_part_is_left_out() -> None:
    """On main, a member that registers but never sends its part fails every round of its stage."""
    async def main() -> None:
        _, _, avgs = await group(3, manifest(robust=0))
        withholder = avgs[2]

        async def withhold(*args, **kwargs):
            await asyncio.sleep(3600)
        withholder._send_part = withhold  # type: ignore[method-assign]
        first = await run_all(avgs, [deltas(i) for i in range(3)], [1.0, 1.0, 1.0], round_no=0)
        assert not any(r.complete for r in first)
        assert [r.blamed for r in first[:2]] == [(PEERS[2],), (PEERS[2],)]
        second = await run_all(avgs, [deltas(i) for i in range(3)], [1.0, 1.0, 1.0], round_no=1)
        assert [r.complete for r in second[:2]] == [True, True], [r.reason for r in second]
    asyncio.run(main())


@pytest.mark.inprocess
def test_members_whose_exclusions_differ_do_not_blame_each_other() -> None:
    """One member excludes a third and the other does not: their groups differ, the round fails for
    both, and each one's part reached the other under the other group's hash: neither withheld
    anything, so neither is blamed (or they would exclude each other and split the stage)."""
    from swarmgrad.peer.averaging.exclusion import after_round as strike

    async def main() -> None:
        _, _, avgs = await group(3, manifest(robust=0))
        avgs[0].standings = strike({}, -1, blamed={PEERS[2]})  # avgs[0] leaves PEERS[2] out of round 0
        results = await run_all(avgs, [deltas(i) for i in range(3)], [1.0, 1.0, 1.0], round_no=0)
        assert not results[0].complete and not results[1].complete
        assert PEERS[1] not in results[0].blamed and PEERS[0] not in results[1].blamed, \
            [(r.reason, r.blamed) for r in results]
    asyncio.run(main())
