"""Which stage a peer serves: pure policy over a snapshot of the swarm (DESIGN.md, "Rebalancing").

Model. Replica i of stage a announces its measured rate r_i (samples/s on a); on stage b it
would run r_i·c_a/c_b (``estimate_rates``), c being the stages' relative costs
(``stage_cost.py``). Stage capacity C_s = Σ r_i over JOINING and ONLINE replicas; the swarm's
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
7. warm standbys: a peer that holds a *fresh* backup of the target stage (peer/backup.py: a copy
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
the swarm's *imbalance* (rule 4), not on one move's gain as DESIGN.md first wrote it: with N
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

import hashlib
import itertools
import math
import random
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Collection, Mapping, Sequence

# Same strings as swarm.JOINING/ONLINE/LEAVING (a test pins them); not imported from there, so
# that the policy and the simulator load without hivemind.
JOINING, ONLINE, LEAVING = "joining", "online", "leaving"
LIVE = (JOINING, ONLINE)
EXACT_LIMIT = 12
"""Swarms of at most this many peers get the exact optimum; larger ones the fluid bound."""
NEAR_TIE = 0.2
"""Movers whose improvement is within this fraction of the best one's tie (see Snapshot._best)."""
FRESH_SHARE = 0.5
"""A fresh backup holder is preferred as mover when its improvement is at least this share of
the best mover's: it serves after the warm-up alone, a downloader after state bytes / bandwidth
more (about 100 s of a 1.3 GB stage at 100 Mbit/s against a 30 s warm-up), and the rest of the
gap is filled by the next plan. Chosen on the simulator (docs/placement.md)."""


@dataclass(frozen=True)
class Replica:
    peer_id: str
    state: str
    """JOINING, ONLINE or LEAVING."""
    rate: float
    """Samples/s on the stage it is listed under (measured, or a benchmark while JOINING)."""
    memory: int = 0
    """Bytes it offers; 0 when unknown (then it is assumed to fit)."""
    moving: bool = False
    """It announced a move away from this stage (the stage has a mover)."""
    fresh: frozenset[int] = frozenset()
    """Other stages whose current state it holds as a backup (it could join them without a
    download; see ``fresh_backups``)."""


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
class Policy:
    q: float = 0.95
    """Move only while T / T_reach < q; 1.0 moves whenever placement is not optimal. DESIGN.md's
    q ≈ 0.8 was a margin on one move's gain; as a margin on the swarm's imbalance 0.8 left
    1000-peer swarms 4 % under the optimum without a single move (``swarmgrad simulate``)."""
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
    exact_limit: int = EXACT_LIMIT


NO_MARGIN = Policy(q=1.0, repay=False, confirmations=1)
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


@dataclass(frozen=True)
class PlannedMove:
    source: int
    target: int
    gain: float
    """How much this move lifts the lowest stage of its pair, given the moves planned before it."""


@dataclass(frozen=True)
class Optimum:
    throughput: float
    method: str
    """"exact" (branch and bound over assignments) or "bound" (fluid upper bound)."""
    assignment: tuple[int, ...] | None = None
    """Stage per peer (exact only; -1: fits no stage)."""


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


def check_interval(base_s: float, rng: random.Random) -> float:
    """Seconds to the next check: uniform in [0.5, 1.5]·base, so peers never check in lockstep."""
    return base_s * (0.5 + rng.random())


def tie_hash(peer_id: str, salt: int) -> int:
    """Deterministic across machines and runs (unlike ``hash()``)."""
    return int.from_bytes(hashlib.sha256(f"{salt}:{peer_id}".encode()).digest()[:8], "big")


def fresh_backups(held: Sequence[tuple[int, int]], current: Mapping[int, int]) -> frozenset[int]:
    """Stages whose backup a peer holds of the round the stage is at: ``held`` its (stage,
    applied_rounds) pairs as announced, ``current`` the applied rounds the stage's majority
    announces. An older copy is stale (joining from it would lose rounds), so it is not fresh."""
    return frozenset(s for s, applied in held if s in current and applied == current[s])


def _fits(offer: int, need: int) -> bool:
    return offer <= 0 or offer >= need


@dataclass(frozen=True)
class Snapshot:
    """What a peer read from the DHT: replicas per stage and the stages' figures. Immutable;
    derived figures are computed once per snapshot and shared by every check that reads it."""
    stages: tuple[tuple[Replica, ...], ...]
    costs: tuple[float, ...]
    memory_need: tuple[int, ...] = ()
    """Bytes per stage (empty: no memory limits)."""
    state_bytes: tuple[int, ...] = ()
    """Bytes a mover downloads per stage (empty: 0)."""

    def __post_init__(self) -> None:
        if len(self.stages) != len(self.costs) or not self.costs:
            raise ValueError(f"Snapshot: {len(self.stages)} stages but {len(self.costs)} costs")
        if any(not c > 0 for c in self.costs):
            raise ValueError(f"Snapshot: stage costs must be > 0 (got {self.costs})")
        for name in ("memory_need", "state_bytes"):
            if getattr(self, name) and len(getattr(self, name)) != len(self.costs):
                raise ValueError(f"Snapshot.{name} needs one entry per stage")

    @classmethod
    def from_records(cls, view: Mapping[int, Sequence[Any]], costs: Sequence[Any],
                     memory: Mapping[str, int] | None = None, moving: Collection[str] = (),
                     current: Mapping[int, int] | None = None) -> "Snapshot":
        """From ``SwarmView.swarm()`` records (peer_id, state, throughput, backups) and
        ``stage_costs()``; ``memory`` and ``moving`` add what the records do not carry (yet);
        ``current``: each stage's applied rounds as its majority announces them (a backup of
        that round is fresh; None: no backup counts as fresh)."""
        memory, current = memory or {}, current or {}
        stages = tuple(tuple(Replica(r.peer_id, r.state, float(r.throughput), memory.get(r.peer_id, 0),
                                     r.peer_id in moving,
                                     fresh_backups(getattr(r, "backups", ()), current) - {s})
                             for r in view.get(s, ()))
                       for s in range(len(costs)))
        return cls(stages, tuple(c.cost for c in costs), tuple(c.memory_bytes for c in costs),
                   tuple(c.state_bytes for c in costs))

    @property
    def n_stages(self) -> int:
        return len(self.costs)

    def need(self, stage: int) -> int:
        return self.memory_need[stage] if self.memory_need else 0

    def state(self, stage: int) -> int:
        return self.state_bytes[stage] if self.state_bytes else 0

    @cached_property
    def capacities(self) -> tuple[float, ...]:
        return tuple(math.fsum(r.rate for r in reps if r.state in LIVE) for reps in self.stages)

    @cached_property
    def live_counts(self) -> tuple[int, ...]:
        return tuple(sum(1 for r in reps if r.state in LIVE) for reps in self.stages)

    @cached_property
    def has_mover(self) -> tuple[bool, ...]:
        return tuple(any(r.state == LEAVING or r.moving for r in reps) for reps in self.stages)

    @property
    def throughput(self) -> float:
        return min(self.capacities)

    @cached_property
    def reachable(self) -> Optimum:
        """What placement can reach with the live replicas (ignoring the cost of moving)."""
        work, mem = [], []
        for s, reps in enumerate(self.stages):
            for r in reps:
                if r.state in LIVE:
                    work.append(r.rate * self.costs[s])
                    mem.append(r.memory)
        return optimum(work, self.costs, mem, self.memory_need)

    def candidates(self, stage: int, target: int) -> list[Replica]:
        """ONLINE, not moving, memory fits ``target``; sorted by peer id."""
        need = self.need(target)
        return sorted((r for r in self.stages[stage] if r.state == ONLINE and not r.moving and _fits(r.memory, need)),
                      key=lambda r: r.peer_id)

    def _best(self, scored: list[tuple[float, Replica]], base: float, salt: int, target: int) -> Replica | None:
        """The replica with the best score; scores whose improvement over ``base`` is within
        NEAR_TIE of the best count as tied (rates are measured with noise: without this the
        winner would change from one snapshot to the next and no move would be confirmed),
        and the tie goes to the highest hash of (salt, peer id). Before that, a holder of a
        fresh backup of ``target`` whose improvement is at least FRESH_SHARE of the best wins
        (rule 7: it serves a download sooner); the best such holder, ties alike."""
        if not scored:
            return None
        top = max(score for score, _ in scored)
        if top > base:
            warm = [(score, r) for score, r in scored if target in r.fresh and score - base >= FRESH_SHARE * (top - base)]
            if warm:
                scored, top = warm, max(score for score, _ in warm)
        bar = base + (1 - NEAR_TIE) * (top - base) if top > base else top * (1 - 1e-12)
        tied = [r for score, r in scored if score >= bar]
        return max(tied, key=lambda r: (tie_hash(r.peer_id, salt), r.peer_id))

    @cached_property
    def _plans(self) -> dict[tuple[str, int], Any]:
        return {}

    def _memo(self, kind: str, salt: int, compute: Callable[[int], Any]) -> Any:
        """Each plan is computed once per snapshot (immutable) and salt, however often it is read."""
        key = (kind, salt)
        if key not in self._plans:
            self._plans[key] = compute(salt)
        return self._plans[key]

    def fill_plan(self, salt: int) -> dict[str, int]:
        """Who fills which empty stage: peer id -> target. Empty stages in order; each takes the
        replica (of a stage keeping another live replica and without a mover) that leaves the
        best pair min(C_a − r, r·c_a/c_e); one mover per donor stage."""
        return self._memo("fill", salt, self._compute_fill_plan)

    def _compute_fill_plan(self, salt: int) -> dict[str, int]:
        caps, counts = list(self.capacities), list(self.live_counts)
        used = list(self.has_mover)
        plan: dict[str, int] = {}
        for e in range(self.n_stages):
            if counts[e] > 0:
                continue
            scored, donor = [], {}
            for a in range(self.n_stages):
                if a == e or used[a] or counts[a] <= 1:
                    continue
                for r in self.candidates(a, e):
                    if r.peer_id not in plan:
                        scored.append((min(caps[a] - r.rate, r.rate * self.costs[a] / self.costs[e]), r))
                        donor[r.peer_id] = a
            best = self._best(scored, caps[e], salt, e)
            if best is None:
                continue
            a = donor[best.peer_id]
            plan[best.peer_id] = e
            used[a] = True
            counts[a] -= 1
            counts[e] += 1
            caps[a] -= best.rate
            caps[e] += best.rate * self.costs[a] / self.costs[e]
        return plan

    def move_plan(self, salt: int) -> dict[str, PlannedMove]:
        """Who moves where now: peer id -> its move, the same for every peer that reads
        the same snapshot. Greedy and sequential: take the lowest stage b (ties: lowest index),
        send it the one replica, from any stage that may give one (another live replica stays,
        no mover yet, above b), whose move leaves the best pair min(C_a − r, C_b + r·c_a/c_b)
        (``_best``); apply that move to the capacities and repeat while a move improves its
        pair. So each move is planned knowing the ones before it: S − 1 stages no longer each
        send a replica to one bottleneck on the same snapshot (a herd that overshot it, left the
        donors under it and kept the swarm moving). One mover per stage still holds, and a stage
        that receives in this plan does not give."""
        return self._memo("move", salt, self._compute_move_plan)

    def _compute_move_plan(self, salt: int) -> dict[str, PlannedMove]:
        caps, counts = list(self.capacities), list(self.live_counts)
        blocked = list(self.has_mover)
        plan: dict[str, PlannedMove] = {}
        for _ in range(self.n_stages):
            b = min(range(self.n_stages), key=lambda s: (caps[s], s))
            scored, donor = [], {}
            for a in range(self.n_stages):
                if a == b or blocked[a] or counts[a] <= 1 or not caps[a] > caps[b]:
                    continue
                ratio = self.costs[a] / self.costs[b]
                for r in self.candidates(a, b):
                    scored.append((min(caps[a] - r.rate, caps[b] + r.rate * ratio), r))
                    donor[r.peer_id] = a
            best = self._best(scored, caps[b], salt, b)
            if best is None:
                break
            a = donor[best.peer_id]
            moved = best.rate * self.costs[a] / self.costs[b]
            if not min(caps[a] - best.rate, caps[b] + moved) > caps[b]:
                break  # no move improves the lowest stage's pair: balanced as far as one move goes
            plan[best.peer_id] = PlannedMove(a, b, min(caps[a] - best.rate, caps[b] + moved) - caps[b])
            blocked[a] = blocked[b] = True
            counts[a] -= 1
            counts[b] += 1
            caps[a] -= best.rate
            caps[b] += moved
        return plan


    @cached_property
    def serving(self) -> tuple[float, ...]:
        """Capacity per stage of the replicas that serve now (ONLINE, and LEAVING until they go);
        a JOINING replica is still downloading or warming up."""
        return tuple(math.fsum(r.rate for r in reps if r.state in (ONLINE, LEAVING)) for reps in self.stages)

    def warm_plan(self, salt: int) -> dict[str, PlannedMove]:
        """The one repair a fresh backup holder makes now (rule 7), at most one per snapshot:
        the stage serving least now, b (ties: lowest index), takes the holder of a fresh backup
        of b (another live replica stays on its stage a, no mover there, a serving more than b)
        whose move leaves the best pair of *serving* capacities min(S_a − r, S_b + r·c_a/c_b),
        if it beats S_b. Serving, not live, capacities: a newcomer JOINING b after a departure
        makes b whole on paper at once but serves only after its download; the holder serves
        after its warm-up, and the newcomers that follow go to the stage it left."""
        return self._memo("warm", salt, self._compute_warm_plan)

    def _compute_warm_plan(self, salt: int) -> dict[str, PlannedMove]:
        caps = self.serving
        b = min(range(self.n_stages), key=lambda s: (caps[s], s))
        others = min((caps[s] for s in range(self.n_stages) if s != b), default=math.inf)
        scored, donor = [], {}
        for a in range(self.n_stages):
            if a == b or self.has_mover[a] or self.live_counts[a] <= 1 or not caps[a] > caps[b]:
                continue
            ratio = self.costs[a] / self.costs[b]
            for r in self.candidates(a, b):
                if b in r.fresh:
                    scored.append((min(caps[a] - r.rate, caps[b] + r.rate * ratio), r))
                    donor[r.peer_id] = a
        best = self._best(scored, caps[b], salt, b)
        if best is None:
            return {}
        a = donor[best.peer_id]
        pair = min(caps[a] - best.rate, caps[b] + best.rate * self.costs[a] / self.costs[b])
        if not pair > caps[b]:
            return {}
        return {best.peer_id: PlannedMove(a, b, min(pair, others) - caps[b])}


def _own_replica(snapshot: Snapshot, peer_id: str, stage: int) -> Replica | None:
    return next((r for r in snapshot.stages[stage] if r.peer_id == peer_id), None)


def choose_stage_for_newcomer(snapshot: Snapshot, me: PeerFigures) -> int | None:
    """The stage a joining peer should serve, or None if its memory fits no stage.

    An empty stage first (lowest index); otherwise the stage where it raises T the most, ties
    broken towards the lowest capacity, then the lowest index."""
    fits = [s for s in range(snapshot.n_stages) if _fits(me.memory, snapshot.need(s))]
    if not fits:
        return None
    caps = snapshot.capacities
    empty = [s for s in fits if snapshot.live_counts[s] == 0]
    if empty:
        return empty[0]

    def key(s: int) -> tuple[float, float, int]:
        after = min(caps[s] + me.rates[s], min((caps[t] for t in range(snapshot.n_stages) if t != s), default=math.inf))
        return (-after, caps[s], s)
    return min(fits, key=key)


def should_move(snapshot: Snapshot, me: PeerFigures, stage: int, *, salt: int = 0,
                policy: Policy = Policy()) -> MoveDecision | None:
    """Whether the peer ``me`` (ONLINE on ``stage``) should move, and where; None to stay.
    See the module docstring for the rules. ``salt`` (a round or epoch number every peer
    agrees on) breaks ties between equally good movers."""
    mine = _own_replica(snapshot, me.peer_id, stage)
    if mine is None or mine.state != ONLINE or mine.moving:
        return None
    a, caps, T = stage, snapshot.capacities, snapshot.throughput
    if any(n == 0 for n in snapshot.live_counts):
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
    if not _fits(me.memory, snapshot.need(b)):
        return None
    reach = snapshot.reachable.throughput
    warm = b in mine.fresh
    if not T < policy.q * reach and not (warm and _exempt(snapshot, policy) and T < reach):
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


def _exempt(snapshot: Snapshot, policy: Policy) -> bool:
    """Whether a warm move may skip the margin q: only in a large swarm (T_reach is the fluid
    bound), where one move is a small step and measured rates average out. In a handful of peers
    one move is a large step on noisy rates: in the real 6-peer swarm (tests/test_rebalance_swarm.py)
    exempt warm moves sent one peer 0→2→0→2→1→2 in four minutes, every peer holding some stage's
    fresh copy there."""
    return policy.warm_exempt and snapshot.reachable.method == "bound"


def _warm_decision(snapshot: Snapshot, me: PeerFigures, mine: Replica, planned: PlannedMove,
                   policy: Policy) -> MoveDecision | None:
    """A repair from a fresh backup (``Snapshot.warm_plan``): no margin (it costs no download),
    but it must repay its warm-up and is confirmed like any move."""
    a, b, gain = planned.source, planned.target, planned.gain
    if not _fits(me.memory, snapshot.need(b)):
        return None
    T = min(snapshot.serving)
    if not _exempt(snapshot, policy) and not T < policy.q * snapshot.reachable.throughput:
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


# --------------------------------------------------------------------------- optimum

def fluid_bound(work: Sequence[float], costs: Sequence[float], memory: Sequence[int] = (),
                memory_need: Sequence[int] = ()) -> float:
    """Upper bound on T when work may be split freely: T·Σc ≤ Σ w (w_i = r_i·c_i, a peer's
    rate normalised by stage cost). With memory, fitting is nested (a peer that fits a stage
    fits every stage needing less), so for every threshold m the peers offering ≥ m must cover
    the stages needing ≥ m: T ≤ Σ_{mem ≥ m} w / Σ_{need ≥ m} c. Exact for the relaxation."""
    if not memory_need or not memory:
        return math.fsum(work) / math.fsum(costs)
    best = math.inf
    for m in sorted(set(memory_need)):
        c = math.fsum(cs for cs, need in zip(costs, memory_need) if need >= m)
        w = math.fsum(wi for wi, offer in zip(work, memory) if _fits(offer, m))
        best = min(best, w / c)
    return best


def optimum(work: Sequence[float], costs: Sequence[float], memory: Sequence[int] = (),
            memory_need: Sequence[int] = (), exact_limit: int = EXACT_LIMIT) -> Optimum:
    """The best T any placement reaches: exact (branch and bound) for ≤ ``exact_limit`` peers,
    else the fluid bound (``fluid_bound``), which the exact value approaches as peers grow."""
    if len(work) > exact_limit:
        return Optimum(fluid_bound(work, costs, memory, memory_need), "bound")
    return _exact(list(work), list(costs), list(memory) or [0] * len(work), list(memory_need) or [0] * len(costs))


def _exact(work: list[float], costs: list[float], memory: list[int], need: list[int]) -> Optimum:
    """Raise T step by step: find any assignment with every stage strictly above T·c_s (a
    depth-first search that only feeds stages still at or under the bar, so a peer either
    lifts one of them or is set aside), take its value as the new T, repeat until none exists."""
    n, s_count = len(work), len(costs)
    allowed = [[s for s in range(s_count) if _fits(memory[i], need[s])] for i in range(n)]
    order = sorted((i for i in range(n) if allowed[i]), key=lambda i: (-work[i], i))

    def place_rest(assign: list[int]) -> tuple[float, list[int]]:
        load = [0.0] * s_count
        for i, s in enumerate(assign):
            if s >= 0:
                load[s] += work[i]
        for i in order:  # set-aside peers go where they lift the lowest stage
            if assign[i] < 0:
                s = min(allowed[i], key=lambda s: (load[s] / costs[s], s))
                assign[i] = s
                load[s] += work[i]
        return min(load[s] / costs[s] for s in range(s_count)), assign

    if len(order) < s_count or any(not any(s in allowed[i] for i in order) for s in range(s_count)):
        return Optimum(0.0, "exact", tuple(place_rest([-1] * n)[1]) if order else tuple([-1] * n))
    best_t, best_assign = place_rest([-1] * n)
    bound = fluid_bound([work[i] for i in order], costs, [memory[i] for i in order], need)
    while best_t < bound * (1 - 1e-9):
        found = _above(best_t, work, costs, allowed, order)
        if found is None:
            break
        t, assign = place_rest(found)
        if t <= best_t:
            break  # float ties: no strict progress
        best_t, best_assign = t, assign
    return Optimum(best_t, "exact", tuple(best_assign))


def _above(bar: float, work: list[float], costs: list[float], allowed: list[list[int]],
           order: list[int]) -> list[int] | None:
    """An assignment (-1: set aside) putting every stage strictly above bar·c_s, or None."""
    s_count = len(costs)
    load = [0.0] * s_count
    assign = [-1] * len(work)
    suffix = [0.0] * (len(order) + 1)
    for k in range(len(order) - 1, -1, -1):
        suffix[k] = suffix[k + 1] + work[order[k]]

    def search(k: int) -> bool:
        # A stage within rounding of the bar is still under it, or the loop would not progress.
        short = {s: bar * costs[s] * (1 + 1e-9) - load[s] for s in range(s_count)
                 if load[s] <= bar * costs[s] * (1 + 1e-9)}
        if not short:
            return True
        if len(short) > len(order) - k or math.fsum(short.values()) >= suffix[k]:
            return False
        i = order[k]
        tried = set()
        for s in sorted((s for s in allowed[i] if s in short), key=lambda s: (-short[s], s)):
            sym = (costs[s], load[s])  # identical stages: try one of them
            if sym in tried:
                continue
            tried.add(sym)
            load[s] += work[i]
            assign[i] = s
            if search(k + 1):
                return True
            load[s] -= work[i]
            assign[i] = -1
        return search(k + 1)  # set this peer aside

    return assign if search(0) else None


def brute_force_optimum(work: Sequence[float], costs: Sequence[float]) -> float:
    """Every assignment (S^N): for tests on tiny cases only."""
    best = 0.0
    for assign in itertools.product(range(len(costs)), repeat=len(work)):
        load = [0.0] * len(costs)
        for w, s in zip(work, assign):
            load[s] += w
        best = max(best, min(l / c for l, c in zip(load, costs)))
    return best
