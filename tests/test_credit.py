"""Credit for work (peer/averaging/credit.py): only completed rounds count, each member at most what
the round could have carried, each round once; the leaderboard and its JSON round trip."""
from __future__ import annotations

import asyncio

from swarmgrad.peer.averaging.credit import (Ledger, RoundBounds, completed_rounds, manifest_bounds, scan_rounds,
                                             tokens_per_sample)
from swarmgrad.peer.averaging.group import group_hash
from swarmgrad.peer.averaging.outcome import vote
from swarmgrad.peer.manifest import loads

A, B, C, X, Y = "peerA", "peerB", "peerC", "sybilX", "sybilY"


def reg(weight: float, digest: str = "d0", applied: int = 3) -> dict:
    return {"digest": digest, "applied_rounds": applied, "weight": weight}


def votes_of(members: tuple[str, ...], digest: str | None = "mean1") -> dict[str, str]:
    h = group_hash(tuple(sorted(members)))
    return {p: vote(h, digest) for p in members}


def test_a_round_every_member_voted_alike_credits_each_its_weight() -> None:
    done = completed_rounds(1, 7, {A: reg(32), B: reg(24)}, votes_of((A, B)))
    assert len(done) == 1
    assert done[0].members == (A, B) and dict(done[0].credited) == {A: 32.0, B: 24.0}


def test_failed_differing_missing_or_solo_votes_credit_nothing() -> None:
    regs = {A: reg(32), B: reg(24)}
    failed = votes_of((A, B)) | {B: vote(group_hash((A, B)), None)}
    assert completed_rounds(0, 1, regs, failed) == []
    differing = votes_of((A, B)) | {B: vote(group_hash((A, B)), "other")}
    assert completed_rounds(0, 1, regs, differing) == []
    missing = {A: votes_of((A, B))[A]}  # B never voted: nobody applied
    assert completed_rounds(0, 1, regs, missing) == []
    assert completed_rounds(0, 1, {A: reg(32)}, votes_of((A,))) == []  # one member: no vote validates it


def test_a_group_hash_must_name_exactly_its_voters() -> None:
    """Two ids voting under the hash of a group of three (forged, or the third missing) complete nothing."""
    h = group_hash((A, B, C))
    assert completed_rounds(0, 1, {A: reg(8), B: reg(8), C: reg(8)}, {A: f"{h}:m", B: f"{h}:m"}) == []


def test_a_claimed_weight_is_bounded_by_the_round_and_by_the_others() -> None:
    regs = {A: reg(32), B: reg(1e12)}
    done = completed_rounds(0, 1, regs, votes_of((A, B)), RoundBounds(round_capacity=None, max_weight_ratio=8))
    assert done[0].credited[B] == 8 * 32 and done[0].credited[A] == 32
    done = completed_rounds(0, 1, regs, votes_of((A, B)), RoundBounds(round_capacity=100, max_weight_ratio=8))
    assert done[0].credited[B] == 100 and done[0].claimed[B] == 1e12
    observed = RoundBounds(bound=lambda peer, stage, w: 10.0 if peer == B else w)  # e.g. observed throughput
    assert completed_rounds(0, 1, regs, votes_of((A, B)), observed)[0].credited[B] == 10.0


def test_sybils_averaging_from_another_state_than_the_stages_are_not_credited() -> None:
    """Fresh ids that register and vote among themselves, from a state the stage's majority does
    not hold, earn nothing; the honest group of the same round is credited."""
    regs = {A: reg(32), B: reg(32), C: reg(32), X: reg(99, digest="forged"), Y: reg(99, digest="forged")}
    votes = votes_of((A, B, C)) | votes_of((X, Y), "whatever")
    done = completed_rounds(0, 4, regs, votes)
    assert [d.members for d in done] == [(A, B, C)]


def test_sybils_voting_a_group_of_their_own_at_the_stages_state_are_not_credited() -> None:
    """Fresh ids registered from the stage's own state, voting among themselves beside the group
    matchmaking formed: the round's registrations name one group of all five, so neither of the
    two is credited (the Sybils farm nothing; they can deny one round's credit)."""
    regs = {A: reg(32), B: reg(32), C: reg(32), X: reg(32), Y: reg(32)}
    assert completed_rounds(0, 4, regs, votes_of((A, B, C)) | votes_of((X, Y), "whatever")) == []
    late = {A: reg(32), B: reg(32), C: reg(32)}  # C registered after the group formed and voted nothing
    assert [d.members for d in completed_rounds(0, 4, late, votes_of((A, B)))] == [(A, B)]


def test_ledger_counts_each_round_once_and_ranks_by_samples_then_uptime() -> None:
    ledger = Ledger(tokens_per_sample=128)
    first = completed_rounds(0, 1, {A: reg(10), B: reg(20)}, votes_of((A, B)))[0]
    assert ledger.credit(first) and not ledger.credit(first)
    ledger.credit(completed_rounds(1, 1, {C: reg(10), A: reg(10)}, votes_of((A, C)))[0])
    ledger.seen([A, B, C, X], now=100.0)
    ledger.seen([A, C, X], now=130.0)
    ledger.seen([A, X], now=1000.0)  # a gap longer than max_gap_s counts max_gap_s
    rows = ledger.rows()
    assert [r["peer_id"] for r in rows] == [A, B, C]  # X only showed up: no row
    assert rows[0]["samples"] == 20 and rows[0]["rounds"] == 2 and rows[0]["stages"] == [0, 1]
    assert rows[0]["tokens"] == 20 * 128 and rows[0]["uptime_s"] == 30 + ledger.max_gap_s
    assert rows[1]["samples"] == 20 and rows[1]["uptime_s"] == 0  # B ties A on samples, less uptime
    assert ledger.totals() == {"samples": 50, "contributors": 3, "rounds": 2, "tokens": 50 * 128}
    again = Ledger.from_json(ledger.to_json())
    assert again.rows() == rows and not again.credit(first)


class Board:
    def __init__(self, rounds: dict[tuple[int, int], tuple[dict, dict]]):
        self.rounds = rounds
        self.reads: list[tuple[int, int]] = []

    async def round_registrations(self, stage: int, round_no: int) -> dict:
        return self.rounds.get((stage, round_no), ({}, {}))[0]

    async def round_checks(self, stage: int, round_no: int) -> dict:
        self.reads.append((stage, round_no))
        return self.rounds.get((stage, round_no), ({}, {}))[1]


def test_scan_reads_the_window_below_each_stages_round() -> None:
    board = Board({(0, 5): ({A: reg(4), B: reg(4)}, votes_of((A, B))),
                   (0, 6): ({A: reg(4), B: reg(4)}, votes_of((A, B))),
                   (0, 2): ({A: reg(4), B: reg(4)}, votes_of((A, B)))})  # outside the window
    ledger = Ledger()
    assert asyncio.run(scan_rounds(board, ledger, {0: 7}, lookback=3)) == 2
    assert sorted(board.reads) == [(0, 4), (0, 5), (0, 6)]
    assert asyncio.run(scan_rounds(board, ledger, {0: 7}, lookback=3)) == 0
    assert ledger.rows()[0]["samples"] == 8


def test_manifest_bounds() -> None:
    m = loads('run_id = "t"\n[rounds]\ninner_steps = 5\nround_seconds = 0\n'
                 '[inner]\nmicrobatch_size = 4\nmicrobatches_per_step = 2\n')
    bounds = manifest_bounds(m)
    assert bounds.round_capacity == 40 and bounds.max_weight_ratio == m.averaging.max_weight_ratio
    assert tokens_per_sample(m) == m.model.seq_len
