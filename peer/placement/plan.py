"""The placement plans over one snapshot of the swarm: who fills an empty stage, who moves to the
bottleneck, who repairs from a fresh backup. Every peer that reads the same snapshot computes the
same plans (deterministic ties: ``tie_hash`` of peer id and an agreed salt); ``rules.py``
applies its rules to them. Pure; the rules are numbered as in ``rules.py``."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Collection, Mapping, Sequence

from swarmgrad.peer.placement.optimum import Optimum, fits, optimum
from swarmgrad.peer.records import JOINING, LEAVING, ONLINE

LIVE = (JOINING, ONLINE)
NEAR_TIE = 0.2
"""Movers whose improvement is within this fraction of the best one's tie (see Snapshot._best)."""
FRESH_SHARE = 0.5
"""A fresh backup holder is preferred as mover when its improvement is at least this share of
the best mover's: it serves after the warm-up alone, a downloader after state bytes / bandwidth
more (about 100 s of a 1.3 GB stage at 100 Mbit/s against a 30 s warm-up), and the rest of the
gap is filled by the next plan. Chosen on the simulator (docs/placement.md)."""


@dataclass(frozen=True)
class SnapshotReplica:
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
    pinned: bool = False
    """Its peer never moves (``--stage N`` or ``--rebalance off``): it counts in its stage's
    capacity, and is never a candidate mover."""
    proven: bool = True
    """The deciding peer has evidence that it serves this stage (``evidence.py``: it took part in
    a completed, voted round there). Only a proven replica marks its stage as having a mover, and
    a replica leaves a stage only while a proven one stays (docs/trust.md, "Placement capacity")."""


@dataclass(frozen=True)
class PlannedMove:
    source: int
    target: int
    gain: float
    """How much this move lifts the lowest stage of its pair, given the moves planned before it."""


def tie_hash(peer_id: str, salt: int) -> int:
    """Deterministic across machines and runs (unlike ``hash()``)."""
    return int.from_bytes(hashlib.sha256(f"{salt}:{peer_id}".encode()).digest()[:8], "big")


def fresh_backups(held: Sequence[tuple[int, int]], current: Mapping[int, int]) -> frozenset[int]:
    """Stages whose backup a peer holds of the round the stage is at: ``held`` its (stage,
    applied_rounds) pairs as announced, ``current`` the applied rounds the stage's majority
    announces. An older copy is stale (joining from it would lose rounds), so it is not fresh."""
    return frozenset(s for s, applied in held if s in current and applied == current[s])


@dataclass(frozen=True)
class Snapshot:
    """What a peer read from the DHT: replicas per stage and the stages' figures. Immutable;
    derived figures are computed once per snapshot and shared by every check that reads it."""
    stages: tuple[tuple[SnapshotReplica, ...], ...]
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
                     current: Mapping[int, int] | None = None,
                     proven: Collection[tuple[str, int]] | None = None) -> "Snapshot":
        """From ``SwarmView.swarm()`` records (peer_id, state, throughput, backups) and
        ``stage_costs()``; ``memory`` and ``moving`` add what the records do not carry (yet);
        ``current``: each stage's applied rounds as its majority announces them (a backup of
        that round is fresh; None: no backup counts as fresh); ``proven``: the (peer id, stage)
        pairs with evidence of work (None: every replica counts as proven)."""
        memory, current = memory or {}, current or {}
        stages = tuple(tuple(SnapshotReplica(r.peer_id, r.state, float(r.throughput), memory.get(r.peer_id, 0),
                                     r.peer_id in moving,
                                     fresh_backups(getattr(r, "backups", ()), current) - {s},
                                     bool(getattr(r, "pinned", False)),
                                     proven is None or (r.peer_id, s) in proven)
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
    def empty_stages(self) -> tuple[int, ...]:
        """Stages with no JOINING or ONLINE replica (placement fills these before anything else)."""
        return tuple(s for s, n in enumerate(self.live_counts) if n == 0)

    @cached_property
    def proven_counts(self) -> tuple[int, ...]:
        """Live replicas per stage with evidence of work (``SnapshotReplica.proven``)."""
        return tuple(sum(1 for r in reps if r.state in LIVE and r.proven) for reps in self.stages)

    @cached_property
    def has_mover(self) -> tuple[bool, ...]:
        """A proven replica of the stage is LEAVING or moving: an unproven record saying so is a
        claim that would block every move from its stage (point 7 of issue 43)."""
        return tuple(any((r.state == LEAVING or r.moving) and r.proven for r in reps) for reps in self.stages)

    @staticmethod
    def may_leave(r: SnapshotReplica, proven_live: int) -> bool:
        """Rule 1 with evidence: after ``r`` leaves, a proven live replica stays on its stage
        (``proven_live``: the stage's proven live count before). A stage whose other replicas are
        claims only would be emptied by the move while looking served."""
        return proven_live - (1 if r.proven else 0) >= 1

    @property
    def throughput(self) -> float:
        return min(self.capacities)

    @cached_property
    def reachable(self) -> Optimum:
        """What placement can reach with the live replicas (ignoring the cost of moving)."""
        work, mem, fixed = [], [], []
        for s, reps in enumerate(self.stages):
            for r in reps:
                if r.state in LIVE:
                    work.append(r.rate * self.costs[s])
                    mem.append(r.memory)
                    fixed.append(s if r.pinned else -1)
        return optimum(work, self.costs, mem, self.memory_need, fixed=fixed)

    def candidates(self, stage: int, target: int) -> list[SnapshotReplica]:
        """ONLINE, not moving, not pinned, proven, memory fits ``target``; sorted by peer id.

        Proven: a plan that names an unproven record (a fresh id's claim) as the mover moves
        nobody, and it takes the stage's one mover slot and the target's repair: forged records
        rated at the bound would be chosen to fill an empty stage on paper, and it would stay
        empty. So a real replica moves only after its first completed round there."""
        need = self.need(target)
        return sorted((r for r in self.stages[stage]
                       if r.state == ONLINE and not r.moving and not r.pinned and r.proven and fits(r.memory, need)),
                      key=lambda r: r.peer_id)

    def _best(self, scored: list[tuple[float, SnapshotReplica]], base: float, salt: int, target: int) -> SnapshotReplica | None:
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
        caps, counts, proven = list(self.capacities), list(self.live_counts), list(self.proven_counts)
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
                    if r.peer_id not in plan and self.may_leave(r, proven[a]):
                        scored.append((min(caps[a] - r.rate, r.rate * self.costs[a] / self.costs[e]), r))
                        donor[r.peer_id] = a
            best = self._best(scored, caps[e], salt, e)
            if best is None:
                continue
            a = donor[best.peer_id]
            plan[best.peer_id] = e
            used[a] = True
            proven[a] -= best.proven
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
        pair. So each move is planned knowing the ones before it: S − 1 stages do not each send a
        replica to one bottleneck on the same snapshot (a herd that would overshoot it, leave the
        donors under it and keep the swarm moving). One mover per stage still holds, and a stage
        that receives in this plan does not give."""
        return self._memo("move", salt, self._compute_move_plan)

    def _compute_move_plan(self, salt: int) -> dict[str, PlannedMove]:
        caps, counts, proven = list(self.capacities), list(self.live_counts), list(self.proven_counts)
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
                    if self.may_leave(r, proven[a]):
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
            proven[a] -= best.proven
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
                if b in r.fresh and self.may_leave(r, self.proven_counts[a]):
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
