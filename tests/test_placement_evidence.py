"""Placement counts only what has evidence (peer/placement/evidence.py; issue 43, point 7): forged
stage records can neither block the refill of an empty stage nor plan a stage's one real replica
away. Pure functions and the daemon's Rebalancer over a scripted view, no network."""
from __future__ import annotations

import asyncio

import pytest
from types import SimpleNamespace

from swarmgrad.peer.averaging.group import group_hash
from swarmgrad.peer.placement import rebalancer as R
from swarmgrad.peer.placement.evidence import (WorkSeen, bound_claims, completed_voters, likely_round,
                                               one_record_per_id)
from swarmgrad.peer.placement.plan import LEAVING, ONLINE, JOINING, Snapshot, SnapshotReplica
from swarmgrad.peer.records import PeerRecord

ROUND = 5
"""The deciding replica's round: it reads the votes of rounds ROUND - 1 and ROUND - 2."""


def rec(pid: str, stage: int, state: str = ONLINE, rate: float = 1.0, moving: bool = False) -> PeerRecord:
    return PeerRecord(peer_id=pid, stage=stage, state=state, throughput=rate, round=ROUND, applied_rounds=ROUND,
                      digest=f"d{stage}", manifest_hash="h", driver=stage == 0, moving=moving)


def completed(*members: str, digest: str = "mean") -> tuple[dict[str, str], dict[str, dict]]:
    """The votes and registrations of a round in which `members` averaged and all applied it."""
    ids = tuple(sorted(members))
    return ({p: f"{group_hash(ids)}:{digest}" for p in ids},
            {p: {"digest": "theta", "applied_rounds": ROUND - 1, "weight": 1.0} for p in ids})


class ScriptedSwarm:
    """What a SwarmView answers the rebalancer: one view of the stages, and per stage the votes and
    registrations of round ROUND - 1."""

    def __init__(self, view: dict[int, list[PeerRecord]], rounds: dict[int, tuple[dict, dict]]):
        self.view, self.rounds = view, rounds

    async def swarm(self) -> dict[int, list[PeerRecord]]:
        return self.view

    async def round_checks(self, stage: int, round_no: int) -> dict[str, str]:
        return dict(self.rounds[stage][0]) if stage in self.rounds and round_no == ROUND - 1 else {}

    async def round_registrations(self, stage: int, round_no: int) -> dict[str, dict]:
        return dict(self.rounds[stage][1]) if stage in self.rounds and round_no == ROUND - 1 else {}


def decide(swarm: ScriptedSwarm, me: str, stage: int, n_stages: int):
    costs = [SimpleNamespace(cost=1.0, memory_bytes=0, state_bytes=0)] * n_stages  # what from_records reads
    reb = R.Rebalancer(swarm=swarm, peer_id=me, costs=costs, bench_rates=(1.0,) * n_stages, memory=0,
                       interval_s=10.0, seed=0)
    return asyncio.run(reb.decide(stage, 1.0, ROUND))


def test_one_id_leaving_under_every_stage_does_not_stop_an_empty_stage_being_refilled() -> None:
    """Stage 0 is empty; stages 1 and 2 have two replicas each, which completed their last round.
    One forged id writes LEAVING under every stage, so on today's code every stage "has a mover"
    and no replica may leave one: stage 0 is never refilled. Its records name several stages (it
    counts in none), and a LEAVING record without work on its stage marks no mover."""
    forger = "forger"
    view = {0: [rec(forger, 0, LEAVING)], 1: [rec("a", 1), rec("b", 1), rec(forger, 1, LEAVING)],
            2: [rec("c", 2), rec("d", 2), rec(forger, 2, LEAVING)]}
    swarm = ScriptedSwarm(view, {1: completed("a", "b"), 2: completed("c", "d")})
    snap, decision = decide(swarm, "a", 1, 3)
    assert snap.has_mover == (False, False, False)
    assert set(snap.fill_plan(ROUND).values()) == {0}
    decisions = [decide(swarm, p, s, 3)[1] for p, s in (("a", 1), ("b", 1), ("c", 2), ("d", 2))]
    fills = [d for d in decisions if d is not None]
    assert [(d.target, d.reason) for d in fills] == [(0, "fill-empty")]
    # one forged id per stage, each LEAVING under one stage only: no work there, no mover either
    view = {0: [], 1: [rec("a", 1), rec("b", 1), rec("f1", 1, LEAVING)],
            2: [rec("c", 2), rec("d", 2), rec("f2", 2, ONLINE, moving=True)]}
    snap, _ = decide(ScriptedSwarm(view, {1: completed("a", "b"), 2: completed("c", "d")}), "a", 1, 3)
    assert snap.has_mover == (False, False, False) and snap.fill_plan(ROUND)


def test_a_forged_top_throughput_does_not_plan_a_stages_one_real_replica_away() -> None:
    """Stage 1's one real replica ("real") serves beside a forged record claiming a huge throughput;
    stage 0 (two replicas that completed their last round) is the bottleneck. On today's code the
    plan sends "real" to stage 0, leaving stage 1 to the forged record alone. A replica leaves a
    stage only while a proven one stays, and an unproven claim counts at most as a proven rate."""
    view = {0: [rec("a", 0), rec("b", 0)], 1: [rec("real", 1), rec("forged", 1, rate=1e6)]}
    snap, decision = decide(ScriptedSwarm(view, {0: completed("a", "b")}), "real", 1, 2)
    assert decision is None
    # the claim bounded by the largest proven rate (1.0), and the stage's unproven records (the lone
    # real replica's and the claim) together by one such replica
    assert snap.capacities == (2.0, 1.0)
    assert snap.move_plan(ROUND) == {}


def test_replicas_that_do_work_still_move_to_the_bottleneck() -> None:
    """The evidence rules keep placement working: with stage 1's replicas all proven, one moves to
    the bottleneck as before, and a proven replica's mover mark still blocks its stage."""
    view = {0: [rec("a", 0)], 1: [rec("b", 1), rec("c", 1), rec("e", 1)]}
    rounds = {1: completed("b", "c", "e")}
    moves = [decide(ScriptedSwarm(view, rounds), p, 1, 2)[1] for p in ("b", "c", "e")]
    assert [(d.source, d.target) for d in moves if d is not None] == [(1, 0)]
    view[1] = [rec("b", 1), rec("c", 1, moving=True), rec("e", 1)]
    snap, _ = decide(ScriptedSwarm(view, rounds), "b", 1, 2)
    assert snap.has_mover == (False, True) and snap.move_plan(ROUND) == {}


def test_completed_voters_are_the_members_of_a_group_that_all_voted_one_digest() -> None:
    votes, regs = completed("a", "b", "c")
    assert completed_voters(votes, regs) == {"a", "b", "c"}
    assert completed_voters(votes) == {"a", "b", "c"}
    failed = dict(votes, c=votes["c"].split(":")[0] + ":failed")  # one failed: nobody applied
    assert completed_voters(failed, regs) == frozenset()
    assert completed_voters({"a": votes["a"]}, regs) == frozenset()  # the others' votes not (yet) read
    # two ids vote a group of their own beside the real one: without registrations it looks
    # complete; the registrations of the round's voters name one group, which is neither
    sybils = {"s1": f"{group_hash(('s1', 's2'))}:mean", "s2": f"{group_hash(('s1', 's2'))}:mean"}
    assert completed_voters(sybils) == {"s1", "s2"}
    assert completed_voters(sybils, {"s1": regs["a"], "s2": regs["a"]}) == {"s1", "s2"}  # alone: they are the group
    both = {**votes, **sybils}
    assert completed_voters(both, {**regs, "s1": regs["a"], "s2": regs["a"]}) == frozenset()
    # a late registrant (no vote) does not spoil the group
    assert completed_voters(votes, {**regs, "late": regs["a"]}) == {"a", "b", "c"}


def test_work_seen_remembers_a_window_of_rounds() -> None:
    work = WorkSeen(window=3)
    assert not work.seen_any and work.proven(10) == frozenset()
    work.observe(1, 10, ["a", "b"])
    assert work.seen_any and work.settled(1, 10) and not work.settled(1, 9)
    assert work.proven(12) == {("a", 1), ("b", 1)}
    assert work.proven(14) == frozenset() and work.seen_any  # aged out; claims still do not count


def test_one_record_per_id_keeps_only_a_moves_pair() -> None:
    view = {0: [rec("m", 0, moving=True), rec("x", 0), rec("y", 0)], 1: [rec("m", 1, JOINING), rec("x", 1)],
            2: [rec("y", 2, LEAVING), rec("z", 2)]}
    kept = one_record_per_id(view)
    assert {s: [r.peer_id for r in rs] for s, rs in kept.items()} == {0: ["m", "y"], 1: ["m"], 2: ["y", "z"]}
    # y: LEAVING on 2 and ONLINE on 0 is a move's pair; x claims two live stages: neither counts
    two_leaving = {0: [rec("f", 0, LEAVING)], 1: [rec("f", 1, LEAVING)]}
    assert one_record_per_id(two_leaving) == {0: [], 1: []}


def test_bound_claims_caps_unproven_rates_by_the_largest_proven_one() -> None:
    s = Snapshot(((SnapshotReplica("a", ONLINE, 2.0), SnapshotReplica("f", ONLINE, 50.0, proven=False)),
                  (SnapshotReplica("g", JOINING, 9.0, proven=False),)), (1.0, 2.0))
    b = bound_claims(s)
    assert [r.rate for r in b.stages[0]] == [2.0, 2.0] and [r.rate for r in b.stages[1]] == [1.0]
    unproven = Snapshot(((SnapshotReplica("f", ONLINE, 50.0, proven=False),),), (1.0,))
    assert bound_claims(unproven) == unproven  # nothing shown: nothing to bound by


def test_bound_claims_per_stage_keeps_a_flood_of_records_to_one_top_replica() -> None:
    """Per record, n forged records add n top replicas to a stage; per stage, they share one."""
    flood = tuple(SnapshotReplica(f"f{i}", ONLINE, 50.0, proven=False) for i in range(10))
    s = Snapshot(((SnapshotReplica("a", ONLINE, 2.0), SnapshotReplica("b", ONLINE, 1.0)) + flood,
                  (SnapshotReplica("c", ONLINE, 1.0), SnapshotReplica("j", JOINING, 0.5, proven=False))), (1.0, 1.0))
    assert bound_claims(s).capacities == (3.0 + 10 * 2.0, 1.5)
    per_stage = bound_claims(s, stage_share=0.0)
    assert per_stage.capacities == pytest.approx((3.0 + 2.0, 1.5))  # a joiner below the bound is untouched
    assert all(r.rate == pytest.approx(0.2) for r in per_stage.stages[0][2:])  # scaled alike
    assert bound_claims(s, stage_share=1.0).capacities == pytest.approx((3.0 + 3.0, 1.5))  # or k x proven


def test_forged_records_beside_a_served_stage_do_not_plan_its_replicas_away() -> None:
    """Issue 43's "where peers move": stage 1 has two proven replicas and ten fresh ids claiming a
    huge rate beside them. Bounded per record, stage 1 looks six times better served than stage 0
    and the rebalancer's plan sends one of its real replicas to stage 0; bounded per stage (the
    daemon's ``snapshot_from_view``) it looks a replica better served, and nobody moves."""
    view = {0: [rec("a", 0), rec("b", 0)], 1: [rec("c", 1), rec("d", 1)] + [rec(f"f{i}", 1, rate=1e6) for i in range(10)]}
    swarm = ScriptedSwarm(view, {0: completed("a", "b"), 1: completed("c", "d")})
    costs = [SimpleNamespace(cost=1.0, memory_bytes=0, state_bytes=0)] * 2
    work = WorkSeen()
    asyncio.run(R.read_work(swarm, work, 2, ROUND))
    snap = R.snapshot_from_view(view, costs, work, ROUND)
    assert snap.capacities == pytest.approx((2.0, 3.0))
    assert snap.move_plan(salt=0) == {}
    per_record = bound_claims(Snapshot.from_records(view, costs, proven=work.proven(ROUND)))
    assert per_record.capacities == pytest.approx((2.0, 12.0))
    assert set(per_record.move_plan(salt=0)) <= {"c", "d"} and per_record.move_plan(salt=0)


def test_a_forged_record_is_never_planned_to_fill_an_empty_stage() -> None:
    """A plan naming a fresh id's record as the mover moves nobody: forged records rated at the
    bound, beside a served stage, would win the fill of an empty stage on paper for some salts, and
    that stage would stay empty. Only proven replicas are candidates (``Snapshot.candidates``)."""
    served = tuple(SnapshotReplica(p, ONLINE, 1.0) for p in ("a", "b", "c"))
    forged = tuple(SnapshotReplica(f"f{i}", ONLINE, 1e6, proven=False) for i in range(5))
    snap = bound_claims(Snapshot((served + forged, ()), (1.0, 1.0)), stage_share=0.0)
    for salt in range(50):
        assert set(snap.fill_plan(salt)) <= {"a", "b", "c"} and snap.fill_plan(salt)
        assert set(snap.move_plan(salt)) <= {"a", "b", "c"}


def test_a_newcomer_is_not_steered_away_by_a_forged_throughput() -> None:
    """What peer/node/peer.py `_choose_stage` does: read the last rounds' votes at the round the
    records say, then choose from what they prove. Stage 1's one real replica serves beside a
    forged record claiming a huge throughput; stage 0 has three replicas that completed their last
    round. Taking the records at their word the newcomer joins stage 0; bounded, stage 1 (2
    against 3) is where it raises the swarm's throughput."""
    from swarmgrad.peer.placement.rules import PeerFigures, choose_stage_for_newcomer
    view = {0: [rec("a", 0), rec("b", 0), rec("c", 0)], 1: [rec("real", 1), rec("forged", 1, rate=1e6)]}
    swarm = ScriptedSwarm(view, {0: completed("a", "b", "c")})
    costs = [SimpleNamespace(cost=1.0, memory_bytes=0, state_bytes=0)] * 2
    me = PeerFigures("new", (1.0, 1.0), 0, 1e9, 3600.0)
    assert choose_stage_for_newcomer(R.snapshot_from_view(view, costs), me) == 0  # every claim believed
    work, round_no = WorkSeen(), likely_round(view)
    assert round_no == ROUND
    asyncio.run(R.read_work(swarm, work, 2, round_no))
    assert choose_stage_for_newcomer(R.snapshot_from_view(view, costs, work, round_no), me) == 1


def test_forged_leaving_records_over_the_dht_block_no_refill() -> None:
    """The first attack through the real SwarmView over an in-memory DHT (signed subkeys, record
    parsing, TTL clamps): the forger writes its own LEAVING record under every stage, the honest
    replicas' records, registrations and votes are what their peers would write."""
    from swarmgrad.peer.averaging.outcome import vote
    from swarmgrad.peer.placement.cost import stage_costs
    from conftest import small_manifest
    from support.dht import MemoryDHT, announce, swarm_view
    from support.swarm import peer_ids

    m = small_manifest(stages={"count": 3}, model={"n_layers": 3})
    a, b, c, d, forger = ids = peer_ids(5, "placement-evidence")
    dht = MemoryDHT()
    views = {p: swarm_view(dht, p, m) for p in ids}

    async def main():
        for stage, members in ((1, (a, b)), (2, (c, d))):
            for p in members:
                await announce(views[p], stage, round_no=ROUND)
                await views[p].register_round(stage, ROUND - 1, p, {"digest": "theta", "applied_rounds": 3,
                                                                    "weight": 1.0})
            for p in members:
                await views[p].post_check(stage, ROUND - 1, p, vote(group_hash(tuple(sorted(members))), "mean"))
        for stage in range(3):
            await announce(views[forger], stage, state=LEAVING, round_no=ROUND)
        reb = R.Rebalancer(swarm=views[a], peer_id=a, costs=stage_costs(m), bench_rates=(1.0,) * 3, memory=0,
                           interval_s=10.0, seed=0)
        return await reb.decide(1, 1.0, ROUND)
    snap, _ = asyncio.run(main())
    assert snap.has_mover == (False, False, False)
    assert set(snap.fill_plan(ROUND).values()) == {0}


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def rebalancers(swarm: ScriptedSwarm, peers: dict[str, int], n_stages: int, clock: Clock, window: float = 100.0):
    """One daemon Rebalancer per peer (peer id -> its stage), each with its own memory of the stages."""
    costs = [SimpleNamespace(cost=1.0, memory_bytes=0, state_bytes=0)] * n_stages
    return {p: R.Rebalancer(swarm=swarm, peer_id=p, costs=costs, bench_rates=(1.0,) * n_stages, memory=0,
                            interval_s=10.0, seed=0, unserved_after=window, clock=clock) for p in peers}


def check(rebs: dict, peers: dict[str, int], trained: int) -> dict:
    """Every peer's check at the clock's time, its replica having trained `trained` microbatches ever."""
    return {p: asyncio.run(reb.decide(peers[p], 1.0, ROUND, trained)) for p, reb in rebs.items()}


def test_forged_live_records_hold_an_empty_stage_for_one_window_whatever_their_ids() -> None:
    """Stage 0 has nobody serving it, only forged ONLINE records; stages 1 and 2 have two replicas
    each that completed their last round, and nothing trains (the pipeline lacks stage 0). On
    today's code the forged records make stage 0 look occupied for as long as they are renewed, and
    it is never refilled. Now they hold it for one window (no evidence that it is served: no
    proven replica there, no training anywhere), counted per stage: fresh ids taking over from the
    first ones renew nothing. Then one replica fills it, as if the stage were empty."""
    view = {0: [rec("f1", 0)], 1: [rec("a", 1), rec("b", 1)], 2: [rec("c", 2), rec("d", 2)]}
    swarm, clock = ScriptedSwarm(view, {1: completed("a", "b"), 2: completed("c", "d")}), Clock()
    peers = {"a": 1, "b": 1, "c": 2, "d": 2}
    rebs = rebalancers(swarm, peers, 3, clock)
    for t, forgers in ((0.0, ["f1"]), (60.0, ["f1", "f2"]), (90.0, ["f3"])):
        clock.now = t
        view[0] = [rec(f, 0) for f in forgers]
        out = check(rebs, peers, trained=7)
        assert all(snap.empty_stages == () and d is None for snap, d in out.values()), (t, out)
    clock.now = 130.0
    view[0] = [rec("f4", 0), rec("f5", 0, JOINING)]  # fresh ids again: the stage's window has passed
    out = check(rebs, peers, trained=7)
    assert all(snap.empty_stages == (0,) for snap, _ in out.values())
    fills = [(p, d.target, d.reason) for p, (_, d) in out.items() if d is not None]
    assert len(fills) == 1 and fills[0][1:] == (0, "fill-empty"), fills


def test_a_stage_of_one_replica_is_served_while_the_pipeline_trains() -> None:
    """A lone replica never votes, so it is never proven. It keeps its stage while this peer's own
    replica trains (an inner step needs every stage): no fill of its stage, however long. When
    nothing has trained for a window, its stage counts as empty (a forged record, or a replica that
    hung) and is filled; the filler's record there (it is proven on the stage it leaves) then holds
    the stage, so nobody fills it a second time."""
    view = {0: [rec("a", 0), rec("b", 0)], 1: [rec("lone", 1, rate=2.0)]}  # balanced: 2 samples/s each
    swarm, clock = ScriptedSwarm(view, {0: completed("a", "b")}), Clock()
    peers = {"a": 0, "b": 0}
    rebs = rebalancers(swarm, peers, 2, clock)
    for n, t in enumerate((0.0, 80.0, 160.0, 240.0, 320.0)):
        clock.now = t
        out = check(rebs, peers, trained=n)  # each check: one more microbatch trained
        assert all(snap.empty_stages == () and d is None for snap, d in out.values()), (t, out)
    clock.now = 440.0  # nothing trained since 320 s
    out = check(rebs, peers, trained=4)
    fills = [(p, d.target) for p, (_, d) in out.items() if d is not None]
    assert [t for _, t in fills] == [1], fills
    mover = fills[0][0]
    view[0] = [rec(p, 0, moving=p == mover) for p in ("a", "b")]
    view[1] = [rec("lone", 1), rec(mover, 1, JOINING)]
    clock.now = 460.0
    out = check(rebs, peers, trained=4)
    assert all(snap.empty_stages == () for snap, _ in out.values())
    assert all(d is None for p, (_, d) in out.items() if p != mover), out
    # the move done, the pipeline trains again: nobody moves back or on (no oscillation)
    stay = next(p for p in peers if p != mover)
    view[0], view[1] = [rec(stay, 0)], [rec("lone", 1, rate=2.0), rec(mover, 1)]
    for n, t in enumerate((500.0, 600.0, 700.0, 800.0), start=5):
        clock.now = t
        out = check(rebs, {stay: 0, mover: 1}, trained=n)
        assert all(snap.empty_stages == () and d is None for snap, d in out.values()), (t, out)


def test_stage_service_counts_a_window_per_stage() -> None:
    from swarmgrad.peer.placement.evidence import StageService, unserved_after, vacate_unserved
    from swarmgrad.peer.manifest import TimeoutsConfig

    service = StageService(3, now=0.0)
    service.observe(50.0, {1}, trained=False)
    assert service.unserved(120.0, 100.0) == {0, 2}
    service.observe(130.0, (), trained=True)  # this peer trained: every stage was served
    assert service.unserved(200.0, 100.0) == frozenset()
    assert unserved_after(TimeoutsConfig()) == 240.0
    view = {0: [rec("f", 0), rec("m", 0, JOINING), rec("gone", 0, LEAVING)], 1: [rec("m", 1, moving=True)]}
    kept = vacate_unserved(view, frozenset({("m", 1)}), {0})
    assert [r.peer_id for r in kept[0]] == ["m", "gone"] and [r.peer_id for r in kept[1]] == ["m"]
    assert vacate_unserved(view, frozenset(), ()) == view


def test_a_stage_held_only_by_a_forged_record_is_refilled_by_real_peers(inprocess) -> None:
    """The wiring, with real peers in one event loop (tests/support/swarm.py): stage 2's replica
    stops and three fresh ids keep ONLINE records under stage 2 alive (each one's claimed
    throughput bounded by a proven rate: together they make stage 2 look served); stage 1's two
    replicas (rebalancing on) completed rounds together. Nothing trains once stage 2 is gone. On
    today's code the forged records hold stage 2 for as long as they are renewed; now, one window
    (evidence.unserved_after: 2 x (2 s + 0 s) + 4 x 1 s here) after their last trained microbatch,
    one of them moves to stage 2."""
    from support.hostile import Forgers
    from support.swarm import InProcessSwarm, step_manifest

    m = step_manifest(2, stages={"count": 3}, model={"n_layers": 3},
                      timeouts={"rebalance_check": 1.0, "state_download": 2.0, "join_hold": 0.0, "move": 5.0})

    async def scenario() -> None:
        async with InProcessSwarm(m) as swarm:
            swarm.start(0), swarm.start(0)  # stages 0 and 1 alike: no bottleneck move
            a, b = swarm.start(1, rebalance="on"), swarm.start(1, rebalance="on")
            last = swarm.start(2)
            await swarm.until(lambda: any(e["complete"] and e["group_size"] == 2 for e in a.events("round")), 60,
                              "a complete round of stage 1's pair")
            forger = Forgers(swarm, 3, "squatter")  # three: stage 2 is no bottleneck either
            await forger.announce(2, applied_rounds=0, digest="f" * 24, round_no=0)
            await swarm.stop(last)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 60
            while not any(r.stage == 2 for p in (a, b) for r in p.peer.replicas):
                assert loop.time() < deadline, f"nobody refilled stage 2\n{swarm.history()}"
                await forger.announce(2, applied_rounds=0, digest="f" * 24, round_no=0)
                await asyncio.sleep(0.5)
            assert a.alive and b.alive

    inprocess(scenario, timeout=110)
