"""Which stage a peer serves: pure policy over a snapshot of the swarm (docs/placement.md).

Three files, one concern each: this one holds the rules (a newcomer's stage, ``should_move``, the
margin, repay, memory, ``Confirmation``); ``plan.py`` the snapshot and the plans every
peer reading it computes alike (``Snapshot.fill_plan``, ``move_plan``, ``warm_plan``);
``optimum.py`` what placement can reach (``optimum``, ``fluid_bound``). The daemon
(``rebalance.py``) and the simulator call the same functions.

Model. SnapshotReplica i of stage a announces its measured rate r_i (samples/s on a); on stage b it
would run r_i·c_a/c_b (``estimate_rates``), c being the stages' relative costs
(``cost.py``). Stage capacity C_s = Σ r_i over JOINING and ONLINE replicas; the swarm's
throughput is T = min_s C_s. A stage with no JOINING/ONLINE replica is *empty* (C_s = 0).

Rules (``should_move``, for a peer ONLINE on stage a):
1. never empty a stage: a needs another JOINING/ONLINE replica; never leave a stage that already
   has a mover (a LEAVING replica or one announced as moving);
2. an empty stage is filled at once, by the mover that leaves the best pipeline behind, chosen
   the same way by every peer that reads the same snapshot (``fill_plan``);
3. otherwise moves follow one plan per snapshot (``Snapshot.move_plan``), which every peer reading
   the snapshot computes alike: repeatedly, the lowest stage b (ties: lowest index) gets the one
   replica, from any stage that may give one, whose move leaves the best pair
   min(C_a − r, C_b + r·c_a/c_b) (near-ties: a hash of peer id and the caller's round/epoch
   salt), computed from snapshot figures only; the move is applied to the plan's capacities
   before the next is chosen, and the plan stops when no move improves its pair. Every move
   keeps the donor above the old lowest stage, so it raises the sorted capacity vector
   (leximin) and a static swarm cannot cycle; and the movers of one snapshot do not pile into
   one bottleneck (each stage sending its own best mover there overshot it);
4. margin: the swarm must be out of balance, T / T_reach < q, T_reach being what placement can
   reach (``optimum``: exact for small swarms, the fluid bound Σ r·c / Σ c for large ones);
5. repay: gain × expected tenure > T × switch time (state bytes / bandwidth + warm-up), gain
   being the pair's improvement, capped at T_reach − T;
6. memory: a peer only goes where its memory offer covers the stage's need;
7. warm standbys: a peer that holds a *fresh* backup of the target stage (peer/state/backup.py: a copy
   of the state the stage's majority announces now) joins from that copy, without a download,
   so its switch time is the warm-up alone. Filling or repairing a stage, the plan prefers such a
   holder when its move lifts the pair by at least FRESH_SHARE of the best mover's lift
   (``Snapshot._best``), the repay test counts its switch time without the download, and in a
   large swarm it skips the margin (``_exempt``); ``Snapshot.warm_plan`` lets it repair the
   stage *serving* least even while a newcomer JOINING there makes it whole on paper. A
   departure at the bottleneck costs throughput until the repair serves; the simulator measured
   that wait, not the choice of mover, as what kept it under 0.97 (``swarmgrad simulate``).
``Confirmation`` acts on a move only when the same decision came up on two checks in a row, and
``check_interval`` spreads the checks so peers do not decide in lockstep on one snapshot.

Against Petals' ``server/block_selection.py`` (``should_choose_other_blocks``): Petals compares
the current min throughput with the one reached after simulating its own move *and* a local
search that moves every other server (in random order: two servers reading one snapshot may
disagree), then moves if the ratio is under ``balance_quality`` (0.75). Our plan is that local
search made deterministic, so every peer reading one snapshot agrees on who moves. We keep its margin on
the swarm's *imbalance* (rule 4), not on one move's gain: with N
peers in S stages one move changes T by about S/N, so at 1000 peers a per-move margin of 1/q
never passes and the swarm could not repair itself; a per-move margin only makes sense for a
handful of peers, where T_reach is exact and one move is a large step anyway. We add what
Petals lacks: a deterministic single mover per stage (Petals lets every server of a span move
on the same snapshot), the repay check (a Petals move cost its users ~10 minutes), the
confirmation, memory, and per-stage costs (Petals' blocks are all alike).

Against SWARM parallelism (Ryabinin et al. 2023, "adaptive rebalancing"): there, periodically,
peers of the least loaded stage move to the most loaded one, judged by throughput/queue
figures, with no margin or repay test: SWARM's peers hold no optimiser state that must be
downloaded and replayed. Ours carry θ_global and outer momentum (DiLoCo), so a move costs a
state download and a warm-up, and must be worth it (rules 4–5).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence

from swarmgrad.peer.placement.optimum import EXACT_LIMIT, fits
from swarmgrad.peer.placement.plan import ONLINE, PlannedMove, SnapshotReplica, Snapshot, tie_hash


@dataclass(frozen=True)
class PeerFigures:
    """The deciding peer's own figures."""
    peer_id: str
    rates: tuple[float, ...]
    """Samples/s per stage: measured on its own stage, estimated for the others."""
    memory: int
    """Bytes it can offer a stage."""
    bandwidth: float
    """Bytes/s it can download state at."""
    tenure: float
    """Seconds it expects to stay (see ``expected_tenure``)."""
    warmup: float = 30.0
    """Seconds from having the state to serving at full rate."""


@dataclass(frozen=True)
class PlacementPolicy:
    q: float = 0.95
    """Move only while T / T_reach < q; 1.0 moves whenever placement is not optimal. A margin of
    0.8 on the swarm's imbalance leaves 1000-peer swarms 4 % under the optimum without a single
    move (``swarmgrad simulate``)."""
    repay: bool = True
    """Require gain × tenure > T × switch time."""
    confirmations: int = 2
    """Consecutive checks that must agree before a move is acted on (see ``Confirmation``)."""
    warm_repair: bool = True
    """Holders of fresh backups also repair the stage serving least (``Snapshot.warm_plan``)."""
    confirm_warm: bool = True
    """Warm repairs wait for ``confirmations`` like any move (False: act on the first check)."""
    warm_exempt: bool = True
    """A mover holding a fresh backup of its target skips the margin q (rule 7) in a large swarm
    (``_exempt``): the margin is there because a move costs a download, and this one does not
    (repay and confirmation stay). Without it the 1000-peer simulator loses the gain (0.9595
    against 0.9621 on seeds 0–3)."""
    q_bound: float | None = None
    """The margin where T_reach is the fluid bound (more than ``exact_limit`` peers); None: q.
    There one move is a step of about S/N and repay and confirmation already filter moves; the
    simulator's policy uses 1.0 (no margin): at 1000 peers it served 0.9629 of the bound against
    0.9619 with q = 0.95 (seeds 0–5, five higher, seed 3 0.0055 lower: within the seed noise),
    0.9697 against 0.9665 with 1 Gbit/s links (seeds 0–2), for 0.040 moves per peer-hour
    against 0.029; no-margin (no repay, no confirmation) makes 0.155."""
    exact_limit: int = EXACT_LIMIT


SWARM_POLICY = PlacementPolicy(q=0.8, q_bound=1.0)
"""The policy peers run (the daemon, ``swarmgrad status``) and the simulator's "full" policy: one
object, so the simulated figures are the daemon's. In a handful of peers (T_reach exact) a peer
moves only when the swarm is more than 20 % below what placement can reach (the design's q ≈ 0.8):
measured rates there are noisy (shared machines, contention: ±30 % on 2 cores) and one peer's
error moves T_reach a lot. In a large swarm (T_reach the fluid bound) there is no margin: a 0.8
margin on the swarm's imbalance left 1000-peer swarms 4 % under the bound without a single move,
while one peer's noise barely moves the bound, and repay and two confirming checks still filter
moves (0.040 moves per peer-hour at 1000 peers)."""

NO_MARGIN = PlacementPolicy(q=1.0, repay=False, confirmations=1)
"""The ablation: any improving move, at once. Never-empty, one-mover and memory still hold."""


@dataclass(frozen=True)
class MoveDecision:
    peer_id: str
    source: int
    target: int
    reason: str
    """"fill-empty" (immediate) or "bottleneck"."""
    gain: float
    """Expected throughput gain (samples/s) of this move."""
    throughput: float
    """T now."""
    new_throughput: float
    """min over stages right after the move (may equal T while other stages tie at T)."""
    reachable: float
    """T_reach, what placement can reach (0 when a stage is empty)."""
    immediate: bool = False
    """Act without confirmation (filling an empty stage)."""


def estimate_rates(rate: float, stage: int, costs: Sequence[float]) -> tuple[float, ...]:
    """A rate measured on ``stage``, expressed for every stage: r·c_a/c_b."""
    return tuple(rate * costs[stage] / c for c in costs)


def switch_time(state_bytes: int, bandwidth: float, warmup: float) -> float:
    """Seconds from deciding to serving: download the stage state, then warm up."""
    return state_bytes / max(bandwidth, 1e-9) + warmup


def expected_tenure(age_s: float, floor_s: float = 600.0) -> float:
    """Remaining seconds a peer of this age expects to stay. Online times are heavy-tailed (a
    peer that has stayed long tends to stay long: for a Pareto law the expected remaining time
    grows linearly with age), so we take the age itself, with a floor for newcomers."""
    return max(float(age_s), floor_s)


EMPTY_CHECK_SHARE = 5
"""While a stage is empty (and, in the daemon, at its first check), a peer checks this many times
as often: filling it is immediate, and at a fresh start every peer chose its stage before it saw
the others' records (two started together, one pinned to stage 1, both on stage 1: the other
filled stage 0 only at its first check, 22 s later, the swarm idle meanwhile). The daemon's
rebalancer and the simulator both use it."""
EMPTY_QUICK_CHECKS = 10
"""Quick checks that found no move for this peer while the same stages stayed empty, before it
goes back to the ordinary interval: a stage that no one can fill (every peer that could come is
pinned, or has no stage to spare) would otherwise cost one DHT read of the swarm every few seconds
per rebalancing peer, for as long as it stays empty. Any change in which stages are empty starts
the quick checks again."""


def check_interval(base_s: float, rng: random.Random) -> float:
    """Seconds to the next check: uniform in [0.5, 1.5]·base, so peers never check in lockstep."""
    return base_s * (0.5 + rng.random())


def _own_replica(snapshot: Snapshot, peer_id: str, stage: int) -> SnapshotReplica | None:
    return next((r for r in snapshot.stages[stage] if r.peer_id == peer_id), None)


def choose_stage_for_newcomer(snapshot: Snapshot, me: PeerFigures) -> int | None:
    """The stage a joining peer should serve, or None if its memory fits no stage.

    An empty stage first; otherwise the stage where it raises T the most, ties broken towards
    the lowest capacity, then the lowest index. Among several empty stages the choice is spread by
    a hash of the peer id: peers that start together decide before they see each other's records,
    and "the lowest empty index" sent them all to stage 0 (seen: two peers of a resumed private
    run, 2 s apart, both on stage 0 until a fill-empty move 39 s later)."""
    fitting = [s for s in range(snapshot.n_stages) if fits(me.memory, snapshot.need(s))]
    if not fitting:
        return None
    caps = snapshot.capacities
    empty = [s for s in fitting if snapshot.live_counts[s] == 0]
    if empty:
        return empty[tie_hash(me.peer_id, 0) % len(empty)]

    def key(s: int) -> tuple[float, float, int]:
        after = min(caps[s] + me.rates[s], min((caps[t] for t in range(snapshot.n_stages) if t != s), default=math.inf))
        return (-after, caps[s], s)
    return min(fitting, key=key)


def should_move(snapshot: Snapshot, me: PeerFigures, stage: int, *, salt: int = 0,
                policy: PlacementPolicy = PlacementPolicy()) -> MoveDecision | None:
    """Whether the peer ``me`` (ONLINE on ``stage``) should move, and where; None to stay.
    See the module docstring for the rules. ``salt`` (a round or epoch number every peer
    agrees on) breaks ties between equally good movers."""
    mine = _own_replica(snapshot, me.peer_id, stage)
    if mine is None or mine.state != ONLINE or mine.moving:
        return None
    a, caps, T = stage, snapshot.capacities, snapshot.throughput
    if snapshot.empty_stages:
        target = snapshot.fill_plan(salt).get(me.peer_id)
        if target is None:
            return None
        after = list(caps)
        after[a] -= mine.rate
        after[target] += me.rates[target]
        nonempty = [c for s, c in enumerate(after) if snapshot.live_counts[s] > 0 or s == target]
        return MoveDecision(me.peer_id, a, target, "fill-empty", gain=min(nonempty), throughput=T,
                            new_throughput=min(after), reachable=0.0, immediate=True)
    planned = snapshot.move_plan(salt).get(me.peer_id)
    if (planned is None or planned.source != a) and mine.fresh and policy.warm_repair:
        planned = snapshot.warm_plan(salt).get(me.peer_id)
        if planned is not None and planned.source == a and planned.gain > 0:
            return _warm_decision(snapshot, me, mine, planned, policy)
    if planned is None or planned.source != a:
        return None
    b, gain = planned.target, planned.gain
    if not fits(me.memory, snapshot.need(b)):
        return None
    reach = snapshot.reachable.throughput
    warm = b in mine.fresh
    if not T < _margin(snapshot, policy) * reach and not (warm and _exempt(snapshot, policy) and T < reach):
        return None
    gain = min(gain, reach - T)
    download = 0 if warm else snapshot.state(b)  # a fresh backup joins without one (rule 7)
    if policy.repay and not gain * me.tenure > mine.rate * switch_time(download, me.bandwidth, me.warmup):
        return None
    after = list(caps)
    after[a] -= mine.rate
    after[b] += me.rates[b]
    return MoveDecision(me.peer_id, a, b, "bottleneck", gain=gain, throughput=T, new_throughput=min(after),
                        reachable=reach)


def _margin(snapshot: Snapshot, policy: PlacementPolicy) -> float:
    """q, or ``PlacementPolicy.q_bound`` where T_reach is the fluid bound (a large swarm)."""
    if policy.q_bound is not None and snapshot.reachable.method == "bound":
        return policy.q_bound
    return policy.q


def _exempt(snapshot: Snapshot, policy: PlacementPolicy) -> bool:
    """Whether a warm move may skip the margin q: only in a large swarm (T_reach is the fluid
    bound), where one move is a small step and measured rates average out. In a handful of peers
    one move is a large step on noisy rates: in the real 6-peer swarm (tests/test_rebalance_swarm.py)
    exempt warm moves sent one peer 0→2→0→2→1→2 in four minutes, every peer holding some stage's
    fresh copy there."""
    return policy.warm_exempt and snapshot.reachable.method == "bound"


def _warm_decision(snapshot: Snapshot, me: PeerFigures, mine: SnapshotReplica, planned: PlannedMove,
                   policy: PlacementPolicy) -> MoveDecision | None:
    """A repair from a fresh backup (``Snapshot.warm_plan``): no margin (it costs no download),
    but it must repay its warm-up and is confirmed like any move."""
    a, b, gain = planned.source, planned.target, planned.gain
    if not fits(me.memory, snapshot.need(b)):
        return None
    T = min(snapshot.serving)
    if not _exempt(snapshot, policy) and not T < _margin(snapshot, policy) * snapshot.reachable.throughput:
        return None
    if policy.repay and not gain * me.tenure > mine.rate * switch_time(0, me.bandwidth, me.warmup):
        return None
    after = list(snapshot.serving)
    after[a] -= mine.rate
    after[b] += me.rates[b]
    return MoveDecision(me.peer_id, a, b, "warm-repair", gain=gain, throughput=T, new_throughput=min(after),
                        reachable=snapshot.reachable.throughput, immediate=not policy.confirm_warm)


class Confirmation:
    """Acts on a move only when the same (source, target) came up on ``required`` consecutive
    checks; a fill-empty decision passes at once. No I/O; one per peer."""

    def __init__(self, required: int = 2) -> None:
        if required < 1:
            raise ValueError(f"Confirmation.required must be >= 1 (got {required})")
        self.required = required
        self._last: tuple[int, int] | None = None
        self._count = 0

    def observe(self, decision: MoveDecision | None) -> MoveDecision | None:
        """Feed this check's decision; returns it when it is to be acted on, else None."""
        if decision is None:
            self.reset()
            return None
        key = (decision.source, decision.target)
        self._count = self._count + 1 if key == self._last else 1
        self._last = key
        if decision.immediate or self._count >= self.required:
            self.reset()
            return decision
        return None

    @property
    def pending(self) -> bool:
        """A decision awaits confirmation: check again soon (after the next snapshot), not at
        the usual interval, or the swarm will have changed by then."""
        return self._count > 0

    def reset(self) -> None:
        self._last, self._count = None, 0


class EmptyStageChecks:
    """Whether a peer's next check comes soon (``EMPTY_CHECK_SHARE`` times as often): while the view
    has an empty stage, for at most ``EMPTY_QUICK_CHECKS`` checks that found no move while the same
    stages stayed empty; a change in which stages are empty starts them again. No I/O; one per peer
    (the daemon's rebalancer and the simulator's peers)."""

    def __init__(self) -> None:
        self.empty: tuple[int, ...] = ()
        self.left = EMPTY_QUICK_CHECKS

    def observe(self, empty_stages: tuple[int, ...], moved: bool) -> bool:
        """Feed this check's empty stages and whether it decided a move; True: check soon."""
        if empty_stages != self.empty:
            self.empty, self.left = empty_stages, EMPTY_QUICK_CHECKS
        if self.empty and not moved:
            self.left -= 1
        return bool(self.empty) and self.left > 0
