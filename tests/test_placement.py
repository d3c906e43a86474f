"""Placement policy and stage cost model: pure functions over snapshots, no network."""
from __future__ import annotations

import itertools
import random
from typing import Sequence

import pytest

from swarmgrad.peer.placement import plan as P
from swarmgrad.peer.manifest import from_dict, load
from swarmgrad.peer.placement.rules import (EMPTY_CHECK_SHARE, EMPTY_QUICK_CHECKS, NO_MARGIN, Confirmation, MoveDecision,
                                      PeerFigures, PlacementPolicy, check_interval, choose_stage_for_newcomer, estimate_rates,
                                      should_move)
from swarmgrad.peer.placement.optimum import fluid_bound, optimum
from swarmgrad.peer.placement.plan import JOINING, LEAVING, ONLINE, SnapshotReplica, Snapshot
from swarmgrad.peer.placement.cost import stage_costs

DEFAULT = "peer/defaults/tiny-gpt.toml"
GB = 10 ** 9


def brute_force_optimum(work: Sequence[float], costs: Sequence[float], fixed: Sequence[int] = ()) -> float:
    """The reference `optimum` is checked against: every assignment (S^N; ``fixed`` as in
    ``optimum``), so tiny cases only."""
    best = 0.0
    choices = [[fixed[i]] if i < len(fixed) and fixed[i] >= 0 else range(len(costs)) for i in range(len(work))]
    for assign in itertools.product(*choices):
        totals = [0.0] * len(costs)
        for w, s in zip(work, assign):
            totals[s] += w
        best = max(best, min(t / c for t, c in zip(totals, costs)))
    return best


def snap(stages: list[list[tuple[str, float]]], costs: tuple[float, ...] | None = None, **kw) -> Snapshot:
    costs = costs or (1.0,) * len(stages)
    return Snapshot(tuple(tuple(SnapshotReplica(pid, ONLINE, rate) for pid, rate in s) for s in stages), costs, **kw)


def figures(s: Snapshot, pid: str, stage: int, *, memory: int = 0, bandwidth: float = 1e9,
            tenure: float = 3600.0) -> PeerFigures:
    rate = next(r.rate for r in s.stages[stage] if r.peer_id == pid)
    return PeerFigures(pid, estimate_rates(rate, stage, s.costs), memory, bandwidth, tenure, warmup=0.0)


def decisions(s: Snapshot, policy: PlacementPolicy = PlacementPolicy(), salt: int = 0, **kw) -> list[MoveDecision]:
    out = []
    for stage, reps in enumerate(s.stages):
        for r in reps:
            d = should_move(s, figures(s, r.peer_id, stage, **kw), stage, salt=salt, policy=policy)
            if d is not None:
                out.append(d)
    return out


def random_snapshot(rng: random.Random, n_peers: int, n_stages: int) -> Snapshot:
    stages: list[list[SnapshotReplica]] = [[] for _ in range(n_stages)]
    for i in range(n_peers):
        state = rng.choice([ONLINE] * 8 + [JOINING, LEAVING])
        stages[rng.randrange(n_stages)].append(SnapshotReplica(f"p{i:03d}", state, rng.choice([0.5, 1, 1, 2, 3, 8]) * rng.uniform(0.9, 1.1)))
    costs = tuple(rng.uniform(0.6, 1.4) for _ in range(n_stages))
    return Snapshot(tuple(tuple(s) for s in stages), costs)


# --------------------------------------------------------------------------- stage cost

def test_gpt_stage_costs_match_the_built_model() -> None:
    from swarmgrad.peer.model import from_manifest
    m = load(DEFAULT)
    costs = stage_costs(m)
    model = from_manifest(m)
    for c in costs:
        assert c.params == sum(p.numel() for p in model.build_stage(c.stage).parameters())
        assert c.state_bytes == 8 * c.params  # θ_global + momentum, fp32
        mem = c.memory
        assert mem.adam == 2 * mem.weights and mem.theta_global == mem.momentum == mem.grads == mem.weights
        assert mem.eval_copy == mem.weights and mem.snapshot == 2 * mem.weights  # evaluations' module, θ+m committed
        assert c.memory_bytes == mem.total > 7 * mem.weights
    assert sum(c.cost for c in costs) == pytest.approx(len(costs))
    # SwarmAdamW keeps a third moment and the step's sum of squared gradients
    swarm = stage_costs(m.replace(inner={"swarm_second_moment": True, "microbatches_per_step": 2}))
    assert all(c.memory.adam == 4 * c.memory.weights for c in swarm)


def test_more_blocks_cost_more_and_in_flight_costs_memory() -> None:
    raw = {"run_id": "x", "model": {"d_model": 64, "n_layers": 5, "n_heads": 4, "seq_len": 64}, "stages": {"count": 3}}
    m = from_dict(raw)
    c = stage_costs(m)  # split 2, 2, 1
    assert c[0].cost > c[2].cost and c[1].cost > c[2].cost
    more = stage_costs(from_dict({**raw, "pipeline": {"max_in_flight": 8}}))
    assert more[1].memory.activations == 2 * c[1].memory.activations
    assert more[1].memory.weights == c[1].memory.weights
    assert c[1].memory.residual == c[1].memory.weights  # averaging.error_feedback's residual
    reducer = stage_costs(from_dict({**raw, "averaging": {"reducer_feedback": True}}))
    assert reducer[1].memory.residual == 2 * c[1].memory.weights  # and the reducer's


def test_entry_point_costs_fall_back_to_parameter_counts() -> None:
    from swarmgrad.peer.model import from_manifest
    m = from_dict({"run_id": "x", "model": {"kind": "entry_point", "entry_point": "swarmgrad.peer.model.examples:tiny_mlp"},
                   "stages": {"count": 2}})
    with pytest.raises(ValueError, match="StagedModel"):
        stage_costs(m)
    costs = stage_costs(m, from_manifest(m))
    assert all(c.method == "params" and c.params > 0 for c in costs)
    assert costs[0].cost / costs[1].cost == pytest.approx(costs[0].params / costs[1].params)


# --------------------------------------------------------------------------- optimum

def test_known_optimum() -> None:
    # Speeds [1,1,1,1,3,3] over three equal stages: {3}, {3}, {1,1,1,1} gives 3, nothing better.
    best = optimum([1, 1, 1, 1, 3, 3], [1, 1, 1])
    assert best.method == "exact" and best.throughput == pytest.approx(3.0)
    assert sorted(best.assignment).count(0) + sorted(best.assignment).count(1) + sorted(best.assignment).count(2) == 6
    assert fluid_bound([1, 1, 1, 1, 3, 3], [1, 1, 1]) == pytest.approx(10 / 3)
    assert optimum([1.0] * 20, [1.0, 1.0]).method == "bound"


def test_exact_matches_brute_force() -> None:
    rng = random.Random(5)
    for _ in range(40):
        n, s = rng.randint(2, 7), rng.randint(2, 3)
        work = [rng.choice([1, 2, 3, 5]) * rng.uniform(0.9, 1.1) for _ in range(n)]
        costs = [rng.uniform(0.7, 1.3) for _ in range(s)]
        exact = optimum(work, costs).throughput
        assert exact == pytest.approx(brute_force_optimum(work, costs), rel=1e-9)
        assert exact <= fluid_bound(work, costs) * (1 + 1e-9)


def test_optimum_keeps_pinned_peers_where_they_are() -> None:
    """What placement can reach when some replicas never move: the exact optimum searches only the
    free peers' stages (brute force agrees), and the bound also pours the free work over the
    pinned work, never below the exact value."""
    # two fast peers pinned to stage 1, two slow free ones: stage 0 gets at most 1 + 1
    best = optimum([5.0, 5.0, 1.0, 1.0], [1.0, 1.0], fixed=[1, 1, -1, -1])
    assert best.throughput == pytest.approx(2.0) and best.assignment == (1, 1, 0, 0)
    assert optimum([5.0, 5.0, 1.0, 1.0], [1.0, 1.0]).throughput == pytest.approx(6.0)  # free: {5, 1} each
    assert fluid_bound([5.0, 5.0, 1.0, 1.0], [1.0, 1.0], fixed=[1, 1, -1, -1]) == pytest.approx(2.0)
    # the water level: 3 free over stages pinned at 0, 1 and 6 (equal costs) reaches 2
    assert fluid_bound([1.0, 6.0, 3.0], [1.0, 1.0, 1.0], fixed=[1, 2, -1]) == pytest.approx(2.0)
    rng = random.Random(7)
    for _ in range(60):
        n, s = rng.randint(2, 7), rng.randint(2, 3)
        work = [rng.choice([1, 2, 3, 5]) * rng.uniform(0.9, 1.1) for _ in range(n)]
        costs = [rng.uniform(0.7, 1.3) for _ in range(s)]
        fixed = [rng.randrange(s) if rng.random() < 0.4 else -1 for _ in range(n)]
        exact = optimum(work, costs, fixed=fixed)
        assert exact.throughput == pytest.approx(brute_force_optimum(work, costs, fixed), rel=1e-9), (work, fixed)
        assert all(a == f for a, f in zip(exact.assignment, fixed) if f >= 0)
        assert exact.throughput <= fluid_bound(work, costs, fixed=fixed) * (1 + 1e-9)
        assert exact.throughput <= optimum(work, costs).throughput * (1 + 1e-9)
    # the snapshot passes its pinned replicas on
    snap_ = Snapshot(((SnapshotReplica("a", ONLINE, 1.0),), (SnapshotReplica("p", ONLINE, 5.0, pinned=True),
                                                     SnapshotReplica("q", ONLINE, 5.0, pinned=True))), (1.0, 1.0))
    assert snap_.reachable.throughput == pytest.approx(1.0)


def test_optimum_respects_memory() -> None:
    # Stage 1 needs 20 GB; only the slow peer has it, so it must serve there.
    work, mem, need = [10.0, 1.0], [8 * GB, 24 * GB], [4 * GB, 20 * GB]
    best = optimum(work, [1.0, 1.0], mem, need)
    assert best.throughput == pytest.approx(1.0) and best.assignment == (0, 1)
    assert fluid_bound(work, [1.0, 1.0], mem, need) == pytest.approx(1.0)


# --------------------------------------------------------------------------- newcomers

def test_newcomer_takes_an_empty_stage_first_then_the_bottleneck() -> None:
    s = snap([[("a", 5.0)], [], [("b", 1.0)]])
    me = PeerFigures("new", (1.0, 1.0, 1.0), 0, 1e9, 600.0)
    assert choose_stage_for_newcomer(s, me) == 1
    s = snap([[("a", 5.0)], [("c", 2.0)], [("b", 1.0)]])
    assert choose_stage_for_newcomer(s, me) == 2
    # Equal stages: deterministic (lowest index).
    s = snap([[("a", 1.0)], [("b", 1.0)]])
    assert choose_stage_for_newcomer(s, me) == 0


def test_newcomers_to_an_empty_swarm_spread_over_the_empty_stages() -> None:
    """Peers that start together do not see each other: each picks an empty stage by its id, the
    same one every time, and 16 such peers do not all pick one stage."""
    s = snap([[], [], []])
    picks = [choose_stage_for_newcomer(s, PeerFigures(f"peer{i}", (1.0, 1.0, 1.0), 0, 1e9, 600.0))
             for i in range(16)]
    assert set(picks) == {0, 1, 2}
    assert picks == [choose_stage_for_newcomer(s, PeerFigures(f"peer{i}", (1.0, 1.0, 1.0), 0, 1e9, 600.0))
                     for i in range(16)]
    s = snap([[("a", 5.0)], [], [("b", 1.0)]])  # one empty stage: everyone takes it
    assert {choose_stage_for_newcomer(s, PeerFigures(f"peer{i}", (1.0, 1.0, 1.0), 0, 1e9, 600.0))
            for i in range(16)} == {1}


def test_newcomer_respects_memory() -> None:
    s = snap([[("a", 5.0)], [("b", 1.0)]], memory_need=(4 * GB, 20 * GB))
    small = PeerFigures("new", (1.0, 1.0), 8 * GB, 1e9, 600.0)
    assert choose_stage_for_newcomer(s, small) == 0  # the bottleneck does not fit
    assert choose_stage_for_newcomer(s, PeerFigures("new", (1.0, 1.0), 2 * GB, 1e9, 600.0)) is None


# --------------------------------------------------------------------------- moves

def test_never_empties_a_stage() -> None:
    # Stage 0 has one huge replica, stage 1 is starving: the lone replica still stays.
    s = snap([[("big", 100.0)], [("x", 1.0), ("y", 1.0)]])
    assert decisions(s, NO_MARGIN) == []
    rng = random.Random(1)
    for _ in range(60):
        s = random_snapshot(rng, rng.randint(13, 30), rng.randint(2, 5))
        for d in decisions(s, NO_MARGIN, salt=rng.randrange(9)):
            assert s.live_counts[d.source] > 1


def test_one_mover_per_stage_and_none_from_a_stage_with_a_mover() -> None:
    rng = random.Random(2)
    for _ in range(60):
        s = random_snapshot(rng, rng.randint(13, 40), rng.randint(2, 5))
        ds = decisions(s, NO_MARGIN, salt=rng.randrange(9))
        sources = [d.source for d in ds]
        assert len(sources) == len(set(sources))
        assert not any(s.has_mover[src] for src in sources)


def test_moves_to_the_bottleneck_and_the_best_mover_goes() -> None:
    s = snap([[("a1", 1.0), ("a2", 1.0), ("a3", 1.0), ("a4", 3.0)], [("b1", 1.0)], [("c1", 2.0), ("c2", 2.0)]])
    ds = decisions(s)
    # T = 1 on stage 1. From stage 0 (C=6) the 3.0 replica makes the best pair: min(3, 4) = 3.
    # Planned after it (capacities 3, 4, 4), a 2.0 replica of stage 2 would leave min(2, 5) = 2
    # under the lowest stage's 3: it stays. (Each stage sending its best mover, as the policy
    # once did, moved c1 too and left T = 2 instead of 3.)
    assert [(d.peer_id, d.source, d.target) for d in ds] == [("a4", 0, 1)]
    assert all(d.reason == "bottleneck" and d.gain == 2.0 and d.throughput == 1.0 for d in ds)


def apply(s: Snapshot, ds: list[MoveDecision]) -> list[float]:
    """Capacities once every decision taken on ``s`` has landed."""
    caps = list(s.capacities)
    for d in ds:
        rate = next(r.rate for r in s.stages[d.source] if r.peer_id == d.peer_id)
        caps[d.source] -= rate
        caps[d.target] += rate * s.costs[d.source] / s.costs[d.target]
    return caps


def test_the_plan_sends_several_movers_to_one_stage_only_while_it_needs_them() -> None:
    # Stage 2 is far under: one mover from 0 and one from 1 both lift it, each planned after the other.
    s = snap([[("a1", 2.0), ("a2", 2.0), ("a3", 2.0)], [("b1", 2.0), ("b2", 2.0), ("b3", 2.0)], [("c", 1.0)]])
    ds = decisions(s, NO_MARGIN)
    assert sorted((d.source, d.target) for d in ds) == [(0, 2), (1, 2)]
    assert min(apply(s, ds)) == 4.0
    plan = s.move_plan(0)
    assert sorted(m.gain for m in plan.values()) == [1.0, 2.0]  # the second planned move lifts less


def test_the_movers_of_one_snapshot_never_lower_the_lowest_stage() -> None:
    # Every replica deciding on one snapshot at once (the herd case): the moves, all landed,
    # never leave a stage under the snapshot's T, and never overshoot so that the pipeline ends lower.
    rng = random.Random(7)
    for _ in range(80):
        s = random_snapshot(rng, rng.randint(13, 60), rng.randint(2, 8))
        if any(n == 0 for n in s.live_counts):
            continue
        ds = decisions(s, NO_MARGIN, salt=rng.randrange(9))
        assert min(apply(s, ds)) >= s.throughput - 1e-9
        assert len({d.source for d in ds}) == len(ds)


def test_no_move_within_the_margin() -> None:
    # Reachable optimum 3 ({1,1,1} | {3}... ) ; current 2.6: the swarm is within q = 0.8.
    s = snap([[("a", 1.0), ("b", 1.0), ("c", 1.0), ("d", 0.6)], [("e", 2.6)]])
    reach = s.reachable.throughput
    assert s.throughput / reach >= 0.8
    assert decisions(s, PlacementPolicy(q=0.8)) == []
    assert decisions(s, NO_MARGIN) != []  # the same move without margin


def test_a_move_must_repay_its_switch_time() -> None:
    s = snap([[("a", 1.0), ("b", 1.0), ("c", 1.0)], [("d", 1.0)]], state_bytes=(10 ** 9, 10 ** 9))
    assert decisions(s, bandwidth=1e8, tenure=3600.0)  # 10 s to switch, an hour to repay
    assert decisions(s, bandwidth=1e5, tenure=3600.0) == []  # 10^4 s to switch
    assert decisions(s, NO_MARGIN, bandwidth=1e5, tenure=3600.0)


def test_moves_respect_memory() -> None:
    stages = [[("a", 1.0), ("b", 1.0), ("c", 1.0)], [("d", 1.0)]]
    s = Snapshot(tuple(tuple(SnapshotReplica(p, ONLINE, r, memory=8 * GB) for p, r in st) for st in stages), (1.0, 1.0),
                 memory_need=(4 * GB, 20 * GB))
    assert decisions(s, NO_MARGIN, memory=8 * GB) == []
    s = Snapshot(s.stages, s.costs, memory_need=(4 * GB, 6 * GB))
    assert decisions(s, NO_MARGIN, memory=8 * GB)


def test_an_empty_stage_is_filled_at_once_by_one_peer() -> None:
    s = snap([[("a", 1.0), ("b", 3.0), ("c", 1.0)], [("d", 1.0), ("e", 1.0)], []])
    ds = decisions(s)
    assert len(ds) == 1 and ds[0].reason == "fill-empty" and ds[0].immediate and ds[0].target == 2
    assert ds[0].peer_id == "b"  # leaves min(5-3, 3) = 2 behind; a 1.0 replica would leave 1
    assert Confirmation().observe(ds[0]) is ds[0]


def test_a_pinned_replica_is_never_the_mover() -> None:
    """Two peers started together on stage 1, one pinned there (--stage 1): the other fills the
    empty stage 0, whatever the tie-break salt (with both rates 0 before any training, the salt
    alone decided, and it could pick the pinned one, which never moves)."""
    for salt in range(20):
        s = Snapshot(((), (SnapshotReplica("auto", ONLINE, 0.0), SnapshotReplica("pin", ONLINE, 0.0, pinned=True))), (1.0, 1.0))
        ds = decisions(s, salt=salt)
        assert [(d.peer_id, d.target) for d in ds] == [("auto", 0)], salt
    # nor for a bottleneck move: the pinned fast replica stays, the unpinned one is the mover
    s = Snapshot(((SnapshotReplica("a", ONLINE, 1.0),),
                  (SnapshotReplica("pin", ONLINE, 9.0, pinned=True), SnapshotReplica("b", ONLINE, 9.0))), (1.0, 1.0))
    assert all(d.peer_id == "b" for d in decisions(s, NO_MARGIN)) and decisions(s, NO_MARGIN)
    s = Snapshot(((SnapshotReplica("a", ONLINE, 1.0),),
                  (SnapshotReplica("pin", ONLINE, 9.0, pinned=True), SnapshotReplica("pin2", ONLINE, 9.0, pinned=True))), (1.0, 1.0))
    assert decisions(s, NO_MARGIN) == []


def test_confirmation_needs_two_consecutive_checks() -> None:
    d = MoveDecision("p", 0, 1, "bottleneck", 1.0, 1.0, 2.0, 3.0)
    other = MoveDecision("p", 0, 2, "bottleneck", 1.0, 1.0, 2.0, 3.0)
    c = Confirmation()
    assert c.observe(d) is None and c.pending
    assert c.observe(d) is d and not c.pending
    assert c.observe(d) is None  # counting starts again after acting
    c.reset()
    assert c.observe(d) is None
    assert c.observe(None) is None and not c.pending
    assert c.observe(d) is None
    assert c.observe(other) is None  # a different target starts over
    assert c.observe(other) is other


def test_check_interval_is_jittered() -> None:
    rng = random.Random(0)
    draws = [check_interval(60.0, rng) for _ in range(200)]
    assert all(30.0 <= x <= 90.0 for x in draws) and len(set(draws)) == 200


def settle(rates: list[float], costs: tuple[float, ...], start: list[int], policy: PlacementPolicy = PlacementPolicy(),
           checks: int = 40) -> tuple[list[int], list[int]]:
    """Play the policy in rounds: every peer checks on the same snapshot; confirmed moves apply
    before the next round. Returns the final placement and the number of moves per round."""
    ids = [f"p{i}" for i in range(len(rates))]
    stage = list(start)
    conf = {pid: Confirmation(policy.confirmations) for pid in ids}
    moves_per_round = []
    for round_ in range(checks):
        s = Snapshot(tuple(tuple(SnapshotReplica(ids[i], ONLINE, rates[i] / costs[stage[i]]) for i in range(len(ids))
                                 if stage[i] == st) for st in range(len(costs))), costs)
        moved = []
        for i, pid in enumerate(ids):
            me = PeerFigures(pid, tuple(rates[i] / c for c in costs), 0, 1e9, 3600.0, warmup=0.0)
            d = conf[pid].observe(should_move(s, me, stage[i], salt=round_ // 10, policy=policy))
            if d is not None:
                moved.append((i, d.target))
        for i, target in moved:
            stage[i] = target
        moves_per_round.append(len(moved))
    return stage, moves_per_round


def throughput_of(rates: list[float], costs: tuple[float, ...], stage: list[int]) -> float:
    return min(sum(r / costs[s] for r, st in zip(rates, stage) if st == s) for s in range(len(costs)))


def test_converges_from_one_stage_then_stops() -> None:
    rates, costs = [1.0, 1.0, 1.0, 1.0, 3.0, 3.0], (1.0, 1.0, 1.0)
    stage, moves = settle(rates, costs, [0] * 6)
    assert throughput_of(rates, costs, stage) >= 0.85 * optimum(rates, list(costs)).throughput
    assert sum(moves[-20:]) == 0


@pytest.mark.parametrize("policy", [PlacementPolicy(), NO_MARGIN])
def test_converges_on_unequal_costs(policy: PlacementPolicy) -> None:
    rng = random.Random(3)
    rates = [rng.choice([1.0, 1.0, 2.0, 4.0]) for _ in range(10)]
    costs = (1.5, 1.0, 0.5)
    stage, moves = settle(rates, costs, [0] * 7 + [1, 1, 2], policy)
    work = list(rates)  # rate·cost is the peer's speed here
    assert throughput_of(rates, costs, stage) >= 0.85 * optimum(work, list(costs)).throughput
    assert sum(moves[-15:]) == 0


# --------------------------------------------------------------------------- warm standbys (rule 7)

def warm_snap(h_fresh: frozenset[int] = frozenset({1}), h_rate: float = 6.0, joining: bool = False) -> Snapshot:
    """Stage 0 has surplus (f, x fast; h holds a backup of stage 1); stage 1 is short. With
    `joining`, a newcomer JOINING stage 1 makes it whole on paper but does not serve yet."""
    s0 = (SnapshotReplica("f", ONLINE, 10.0), SnapshotReplica("x", ONLINE, 10.0), SnapshotReplica("h", ONLINE, h_rate, fresh=h_fresh))
    s1 = (SnapshotReplica("d", ONLINE, 16.0), SnapshotReplica("n", JOINING, 10.0)) if joining else (SnapshotReplica("d", ONLINE, 5.0),)
    return Snapshot((s0, s1), (1.0, 1.0))


def test_fresh_backups_are_those_of_the_current_round() -> None:
    assert P.fresh_backups([(1, 5), (2, 4), (3, 9)], {1: 5, 2: 5}) == frozenset({1})  # 2 stale, 3 unknown


def test_plan_prefers_a_fresh_holder_within_its_share_of_the_best() -> None:
    # f and x lift stage 1 by 10, h by 6 (0.6 of the best >= FRESH_SHARE): h holds stage 1's state
    assert set(warm_snap().move_plan(0)) == {"h"}
    for salt in range(8):  # a stale (or no) copy is no reason: one of the fastest goes, as before
        assert set(warm_snap(h_fresh=frozenset()).move_plan(salt)) <= {"f", "x"}
    # a holder of another stage's state is no better than anyone
    assert set(warm_snap(h_fresh=frozenset({2})).move_plan(0)) <= {"f", "x"}
    # too slow a holder (0.3 of the best lift) does not displace the fast movers
    assert set(warm_snap(h_rate=3.0).move_plan(0)) <= {"f", "x"}


def test_repay_counts_no_download_for_a_fresh_holder() -> None:
    s = Snapshot(warm_snap().stages, (1.0, 1.0), state_bytes=(10 ** 12, 10 ** 12))
    slow_link = dict(bandwidth=1e6, tenure=600.0)  # a download would take 11 days
    d = should_move(s, figures(s, "h", 0, **slow_link), 0, policy=PlacementPolicy(q=1.0))
    assert d is not None and d.target == 1
    stale = Snapshot(warm_snap(h_fresh=frozenset()).stages, (1.0, 1.0), state_bytes=(10 ** 12, 10 ** 12))
    assert all(should_move(stale, figures(stale, p, 0, **slow_link), 0, policy=PlacementPolicy(q=1.0)) is None
               for p in ("f", "x", "h"))


def test_warm_repair_serves_a_stage_a_newcomer_only_fills_on_paper() -> None:
    s = warm_snap(joining=True)
    assert s.capacities == (26.0, 26.0) and s.serving == (26.0, 16.0)
    assert s.move_plan(0) == {}  # balanced on paper: no ordinary move
    d = should_move(s, figures(s, "h", 0), 0)
    assert d is not None and (d.source, d.target, d.reason) == (0, 1, "warm-repair") and d.gain == pytest.approx(4.0)
    assert not d.immediate  # confirmed like any move
    for pid in ("f", "x"):  # not holders: they wait for the newcomer
        assert should_move(s, figures(s, pid, 0), 0) is None
    assert should_move(warm_snap(h_fresh=frozenset(), joining=True), figures(s, "h", 0), 0) is None
    assert should_move(s, figures(s, "h", 0), 0, policy=PlacementPolicy(warm_repair=False)) is None


def test_warm_repair_keeps_the_structural_rules() -> None:
    base = warm_snap(joining=True)
    moving = Snapshot(((base.stages[0][0], SnapshotReplica("x", LEAVING, 10.0, moving=True), base.stages[0][2]),
                       base.stages[1]), base.costs)
    assert should_move(moving, figures(moving, "h", 0), 0) is None  # stage 0 already has a mover
    alone = Snapshot(((SnapshotReplica("h", ONLINE, 30.0, fresh=frozenset({1})),), base.stages[1]), base.costs)
    assert should_move(alone, figures(alone, "h", 0), 0) is None  # never empties its stage
    small = Snapshot(base.stages, base.costs, memory_need=(0, 10 * GB))
    assert should_move(small, figures(small, "h", 0, memory=GB), 0) is None  # memory still binds


def test_records_say_which_backups_are_fresh() -> None:
    from swarmgrad.peer.placement.rebalancer import snapshot_from_view
    from types import SimpleNamespace
    from swarmgrad.peer.records import PeerRecord

    def rec(pid: str, stage: int, applied: int, digest: str, backups=()) -> PeerRecord:
        return PeerRecord(peer_id=pid, stage=stage, state=ONLINE, throughput=1.0, round=applied,
                          applied_rounds=applied, digest=digest, manifest_hash="h", driver=stage == 0,
                          backups=backups)
    view = {0: [rec("a", 0, 7, "x"), rec("b", 0, 7, "x", backups=((1, 4),)), rec("c", 0, 7, "x", backups=((1, 3),))],
            1: [rec("d", 1, 4, "y"), rec("e", 1, 4, "y"), rec("liar", 1, 9, "z")]}
    costs = [SimpleNamespace(cost=1.0, memory_bytes=0, state_bytes=0)] * 2  # what from_records reads of a StageCost
    s = snapshot_from_view(view, costs)
    assert {r.peer_id: r.fresh for r in s.stages[0]} == {"a": frozenset(), "b": frozenset({1}), "c": frozenset()}


def test_warm_moves_skip_the_margin_only_in_a_large_swarm() -> None:
    strict = PlacementPolicy(q=0.5)  # the swarm serves above half of what it could reach: no ordinary move
    small = warm_snap(joining=True)
    assert should_move(small, figures(small, "h", 0), 0, policy=strict) is None  # 5 peers: exact reach, margin holds
    extra = [tuple(SnapshotReplica(f"e{s}{i}", ONLINE, 1.0) for i in range(6)) for s in range(2)]
    large = Snapshot((small.stages[0] + extra[0], small.stages[1] + extra[1]), small.costs)
    assert large.reachable.method == "bound"
    d = should_move(large, figures(large, "h", 0), 0, policy=strict)
    assert d is not None and d.reason == "warm-repair"
    assert should_move(large, figures(large, "h", 0), 0, policy=PlacementPolicy(q=0.5, warm_exempt=False)) is None


def test_a_large_swarm_may_use_its_own_margin() -> None:
    # 3 stages of ten 1.0s, two 0.2s on stages 0 and 2: T = 10 against a fluid bound of 10.27 (0.974).
    small = [("s%d" % i, 1.0) for i in range(10)]
    s = snap([small + [("a", 0.2), ("b", 0.2)], [(f"m{i}", 1.0) for i in range(10)],
              [(f"n{i}", 1.0) for i in range(10)] + [("c", 0.2), ("d", 0.2)]])
    assert s.reachable.method == "bound" and 0.95 < s.throughput / s.reachable.throughput < 1.0
    assert decisions(s, PlacementPolicy()) == []  # within q = 0.95
    moves = decisions(s, PlacementPolicy(q_bound=1.0))
    assert moves
    assert {(d.source, d.target) for d in moves} <= {(0, 1), (2, 1)} and all(d.gain > 0 for d in moves)
    # a handful of peers keeps q: the exact optimum, where one move is a large step
    few = snap([[("a", 1.0), ("b", 1.0), ("c", 1.0), ("d", 0.6)], [("e", 2.6)]])
    assert decisions(few, PlacementPolicy(q=0.8, q_bound=1.0)) == []


def _record(pid: str, stage: int, pinned: bool = False):
    from swarmgrad.peer.records import PeerRecord
    return PeerRecord(peer_id=pid, stage=stage, state=ONLINE, throughput=0.0, round=0, applied_rounds=0,
                      digest="d", manifest_hash="h", driver=stage == 0, pinned=pinned)


def _rebalance_over(monkeypatch, views: list[dict], n_stages: int) -> tuple[MoveDecision, list[float]]:
    """The daemon's Rebalancer for "me" on stage 1, reading `views` one per check (interval 10 s),
    asyncio.sleep patched to record each wait: its decision and the waits before each check."""
    import asyncio
    from types import SimpleNamespace
    from swarmgrad.peer.placement import rebalancer as R
    feed = iter(views)

    class Views:
        async def swarm(self) -> dict:
            return next(feed)

        async def round_checks(self, stage: int, round_no: int) -> dict:
            return {}  # no completed round seen: every record counts (peer/placement/evidence.py)

        async def round_registrations(self, stage: int, round_no: int) -> dict:
            return {}
    waits: list[float] = []

    async def sleep(s: float) -> None:
        waits.append(s)
    monkeypatch.setattr(R.asyncio, "sleep", sleep)
    costs = [SimpleNamespace(cost=1.0, memory_bytes=0, state_bytes=0)] * n_stages  # what from_records reads
    reb = R.Rebalancer(swarm=Views(), peer_id="me", costs=costs, bench_rates=(1.0,) * n_stages, memory=0,
                       interval_s=10.0, seed=0)
    return asyncio.run(reb.next_move(1, lambda: 0.0, lambda: 0)), waits


def test_records_carry_pinned_and_the_rebalancer_checks_sooner_while_a_stage_is_empty(monkeypatch) -> None:
    """The daemon's side: a pinned record reaches the snapshot, and while a stage is empty (and at
    the first check) the checks come EMPTY_CHECK_SHARE times as often, since filling it is
    immediate; a full swarm is checked at the ordinary interval."""
    from types import SimpleNamespace
    from swarmgrad.peer.placement import rebalancer as R
    rec = _record
    views = [{0: [rec("x", 0)], 1: [rec("me", 1)]},   # full: no move
             {0: [], 1: [rec("me", 1)]},                # empty, but we are stage 1's only replica
             {0: [], 1: [rec("me", 1), rec("pin", 1, pinned=True)]}]  # we fill it, not the pinned one
    decision, waits = _rebalance_over(monkeypatch, views, 2)
    assert (decision.peer_id, decision.target, decision.reason) == ("me", 0, "fill-empty")
    quick, ordinary = 10.0 / EMPTY_CHECK_SHARE, 10.0
    assert len(waits) == 3
    assert 0.5 * quick <= waits[0] <= 1.5 * quick  # the first check
    assert 0.5 * ordinary <= waits[1] <= 1.5 * ordinary  # after a full snapshot
    assert 0.5 * quick <= waits[2] <= 1.5 * quick  # after one with an empty stage
    costs = [SimpleNamespace(cost=1.0, memory_bytes=0, state_bytes=0)] * 2
    s = R.snapshot_from_view({0: [], 1: [rec("me", 1), rec("pin", 1, pinned=True)]}, costs)
    assert [r.pinned for r in s.stages[1]] == [False, True]


def test_the_quick_checks_stop_while_a_stage_stays_empty_that_this_peer_cannot_fill(monkeypatch) -> None:
    """A stage no one can fill (here: stage 0 empty, and we are stage 1's only replica) would cost a
    DHT read every few seconds for as long as it stays empty: after EMPTY_QUICK_CHECKS quick checks
    that found nothing the rebalancer waits the ordinary interval; a change in which stages are
    empty starts the quick checks again."""
    rec = _record
    stuck = {0: [], 1: [rec("me", 1)], 2: [rec("x", 2)]}
    views = [stuck] * (EMPTY_QUICK_CHECKS + 3) + [{0: [], 1: [rec("me", 1)], 2: []}] \
        + [{0: [], 1: [rec("me", 1), rec("y", 1)], 2: [rec("x", 2)]}]  # someone came: we fill stage 0
    decision, waits = _rebalance_over(monkeypatch, views, 3)
    assert (decision.target, decision.reason) == (0, "fill-empty")
    quick = 1.5 * 10.0 / EMPTY_CHECK_SHARE
    n = EMPTY_QUICK_CHECKS
    assert len(waits) == len(views)
    assert max(waits[:n]) <= quick  # the first check, then quick ones while stage 0 is empty
    assert min(waits[n:n + 4]) >= 5.0  # nothing found n times: the ordinary interval
    assert waits[n + 4] <= quick  # stage 2 emptied too: a new situation, quick again


def test_status_names_an_empty_stage_that_only_a_new_peer_can_fill() -> None:
    from swarmgrad.peer.cli.status import _placement
    from swarmgrad.peer.records import PeerRecord

    def rec(pid: str, stage: int, pinned: bool) -> PeerRecord:
        return PeerRecord(peer_id=pid, stage=stage, state=ONLINE, throughput=5.0, round=3, applied_rounds=3,
                          digest="d", manifest_hash="h", driver=stage == 0, pinned=pinned)
    m = load(DEFAULT)
    stuck = _placement(m, {0: [rec("a", 0, True), rec("b", 0, True)], 1: []})
    assert stuck["unfilled"] == [1] and stuck["moves"] == []
    one_free = _placement(m, {0: [rec("a", 0, True), rec("b", 0, False)], 1: []})
    assert one_free["unfilled"] == [] and [(mv["peer_id"], mv["to_stage"]) for mv in one_free["moves"]] == [("b", 1)]
    alone = _placement(m, {0: [rec("a", 0, False)], 1: []})  # its stage has none to spare
    assert alone["unfilled"] == [1]
