"""Routing decisions, pure: which replica of the next stage gets a microbatch, who is banned,
how long to wait. No network here; the pipeline gathers the inputs and acts on the answers."""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from swarmgrad.peer.manifest import PIPELINE_ROUTINGS
from swarmgrad.peer.net.retry import Backoff
from swarmgrad.peer.pipeline.window import PipelineEstimator


MEASURED, ANNOUNCED = PIPELINE_ROUTINGS
"""pipeline.routing: what a replica's weight is (`choose_replica`, `Downstream.forward`)."""


@dataclass(frozen=True)
class Candidate:
    peer_id: str
    throughput: float
    """Announced samples/s of this replica's compute (forward + backward, moving average)."""
    link_s: float = 0.0
    """Seconds per microbatch our link to it takes, as this caller measured it (the slower
    direction: request bytes over the rate our requests reached it at, answer bytes over the rate
    its answers reached us at); 0: not measured."""
    trip_s: float = 0.0
    """Seconds one microbatch takes there and back through an idle route, as measured (transfers,
    latency, its service without queueing); 0: not measured."""

    @property
    def measured(self) -> bool:
        return self.link_s > 0 or self.trip_s > 0


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def intervals(candidates: Sequence[Candidate], batch: int = 1) -> dict[str, float]:
    """Seconds per microbatch of `batch` samples each candidate can take: the slower of its
    announced compute and our measured link to it (a fast GPU behind a slow link is as slow as
    its link). A figure not known yet is the median of the others' (a replica we have not sent
    to, or a newcomer that announces no rate yet, is assumed like the rest until measured, so it
    is tried rather than starved). Only relative sizes matter: with nothing known of anyone, all
    are 1."""
    compute = [batch / c.throughput for c in candidates if c.throughput > 0]
    links = [c.link_s for c in candidates if c.link_s > 0]
    compute_fallback, link_fallback = (_median(compute) if compute else 0.0), (_median(links) if links else 0.0)
    out = {c.peer_id: max(batch / c.throughput if c.throughput > 0 else compute_fallback,
                          c.link_s if c.link_s > 0 else link_fallback) for c in candidates}
    return {p: v if v > 0 else 1.0 for p, v in out.items()}  # nothing known of anyone: all alike


def next_back(candidates: Sequence[Candidate], in_flight: dict[str, int], every: dict[str, float]
              ) -> dict[str, float]:
    """Seconds until a microbatch sent now to each candidate is expected back: its trip (at least
    its interval; a trip not measured yet is the median of the others') plus its interval for each
    of our microbatches already queued there."""
    trips = [c.trip_s for c in candidates if c.trip_s > 0]
    trip_fallback = _median(trips) if trips else 0.0
    return {c.peer_id: max(c.trip_s if c.trip_s > 0 else trip_fallback, every[c.peer_id])
            + in_flight.get(c.peer_id, 0) * every[c.peer_id] for c in candidates}


def completion_plan(candidates: Sequence[Candidate], in_flight: dict[str, int], remaining: int,
                    batch: int = 1) -> dict[str, int]:
    """How many of the step's `remaining` microbatches (this one included) each candidate gets
    when each goes where it is expected back first: a candidate's k-th new microbatch is expected
    at trip + (queue + k − 1) × interval (our microbatches already queued there are served first;
    the trip is at least one interval, the time the replica takes for one).
    For equal microbatches on replicas of different speeds this greedy plan gives the shortest
    time to the last answer (Q|p_j=1|C_max): a slow replica gets the microbatches it can return
    before a faster one would, and none at a step's tail that a faster one returns sooner."""
    if remaining < 1:
        raise ValueError(f"remaining must be >= 1, got {remaining}")
    every = intervals(candidates, batch)
    # ties go to the earlier candidate in the caller's order, so the plan is a function of its inputs
    nxt = next_back(candidates, in_flight, every)
    plan = {c.peer_id: 0 for c in candidates}
    order = [c.peer_id for c in candidates]
    for _ in range(remaining):
        best = min(order, key=lambda p: nxt[p])
        plan[best] += 1
        nxt[best] += every[best]
    return plan


def choose_replica(candidates: Sequence[Candidate], in_flight: dict[str, int], banned: set[str],
                   rng: random.Random, remaining: int | None = None, batch: int = 1,
                   explore: bool = True) -> str | None:
    """SWARM's stochastic wiring: pick at random, weighted by 1 / the time until a microbatch sent
    there is expected back (`next_back`): rate / (1 + our queue to it) where the trip is no longer
    than the interval, the rate being 1 / `intervals` (the announced throughput while no link is
    measured); a replica whose trips are long weighs less even where its link's rate could not be
    measured (small messages arrive in one piece).

    With `remaining` (the microbatches of this inner step not sent yet, this one included), the
    weights are `completion_plan`'s counts instead: near a step's end a microbatch goes only to
    a replica expected to return it no later than a faster one would (a slow replica must not
    hold up the whole step), and early in a step the plan gives each replica about its share.
    Random among the planned ones, so that drivers that cannot see each other's queues do not
    all pick the same replica at once.

    Once any candidate is measured, one that is not (new, or forgotten: `ReplicaMeter`) gets a
    probe, one microbatch in flight at a time, from a caller that may `explore` (a driver: the
    first microbatch of a step, which has the whole step to come back); it is not used otherwise
    until its answer is in. Returns None when every candidate is banned.
    """
    usable = [c for c in candidates if c.peer_id not in banned]
    if not usable:
        return None
    if any(c.measured for c in usable):
        # a replica not measured yet (or forgotten) is probed with one microbatch at a time, and only
        # by one that may take long without holding up its step; guessed like the others, it would
        # get a full share of a step before its first answer said what it can take
        probes = [c.peer_id for c in usable if not c.measured and not in_flight.get(c.peer_id, 0)]
        if explore and probes:
            return rng.choice(probes)
        usable = [c for c in usable if c.measured]
    if remaining is not None:
        plan = completion_plan(usable, in_flight, remaining, batch)
        chosen = [c.peer_id for c in usable if plan[c.peer_id] > 0]
        return rng.choices(chosen, weights=[plan[p] for p in chosen], k=1)[0]
    back = next_back(usable, in_flight, intervals(usable, batch))
    return rng.choices([c.peer_id for c in usable], weights=[1.0 / back[c.peer_id] for c in usable], k=1)[0]


def route_deadline(deadline: float, now: float, expected_back: float, factor: float, cap_s: float) -> float:
    """A driver's deadline for a microbatch once its replica is chosen: the one its recent trips
    gave (`DeadlineEstimator`, over every replica), or `factor` × when this replica is expected
    to return it if that is later, at most `cap_s` from `now` (timeouts.microbatch). A slow
    replica's trips are few among the fast ones' and the shared deadline would time them out."""
    return max(deadline, min(now + factor * expected_back, now + cap_s))


@dataclass
class ReplicaMeter:
    """What one caller measured of each replica of the next stage from its own answered
    microbatches (a `PipelineEstimator` per replica: link rates over busy time, latency, service
    at a low quantile), forgotten `horizon_s` after the last answer: a replica passed over that
    long is probed again as if new (`choose_replica`), so a link that got faster is found out.
    A slow one is kept longer, its trip / `probe_share`: a probe of a replica that is still slow
    may hold up a step by about its trip, and this bounds that to a share of the time."""
    horizon_s: float = 30.0
    probe_share: float = 0.03
    window: int = 16
    _replicas: dict[str, tuple[float, PipelineEstimator]] = field(default_factory=dict)
    _pruned: int = 8
    """How many were kept at the last pruning (the next comes at twice as many)."""

    def observe(self, peer_id: str, now: float, **trip: float) -> None:
        """One answered microbatch (`PipelineEstimator.observe_trip`'s arguments)."""
        held = self._replicas.get(peer_id)
        fresh = held is not None and self._figures(held, now) is not None
        estimator = held[1] if fresh else PipelineEstimator(self.window)  # type: ignore[index]
        estimator.observe_trip(**trip)  # type: ignore[arg-type]
        self._replicas[peer_id] = (now, estimator)
        if len(self._replicas) > 2 * self._pruned:  # replicas that left: forgotten, not kept forever
            self._replicas = {p: h for p, h in self._replicas.items() if self._figures(h, now) is not None}
            self._pruned = max(8, len(self._replicas))

    def _figures(self, held: tuple[float, PipelineEstimator], now: float) -> tuple[float, float] | None:
        m = held[1].measure()
        link, trip = max(m.up_s, m.down_s), m.up_s + m.latency + m.remote_compute + m.down_s
        return (link, trip) if now - held[0] <= max(self.horizon_s, trip / self.probe_share) else None

    def figures(self, peer_id: str, now: float) -> tuple[float, float]:
        """(link_s, trip_s) for a `Candidate`; zeros when not measured or forgotten."""
        held = self._replicas.get(peer_id)
        found = self._figures(held, now) if held is not None else None
        if found is None:
            self._replicas.pop(peer_id, None)
            return 0.0, 0.0
        return found

    def measured(self, candidates: Sequence[Candidate], now: float) -> list[Candidate]:
        """`candidates` with what we measured of each."""
        out = []
        for c in candidates:
            link, trip = self.figures(c.peer_id, now)
            out.append(Candidate(c.peer_id, c.throughput, link, trip))
        return out


@dataclass
class BanList:
    """Peers that failed us, avoided for base·2^(failures−1) seconds, capped at `max_seconds`
    (a `retry.Backoff`). `on_ban(peer_id, seconds, failures)`, if given, hears of every ban (the
    `banned` event)."""
    base_seconds: float
    max_seconds: float
    on_ban: Callable[[str, float, int], None] | None = None
    _until: dict[str, float] = field(default_factory=dict)
    _failures: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._backoff = Backoff(first=self.base_seconds, cap=self.max_seconds, growth=2.0)

    def ban(self, peer_id: str, now: float) -> float:
        failures = self._failures.get(peer_id, 0) + 1
        self._failures[peer_id] = failures
        duration = self._backoff.wait(failures)
        self._until[peer_id] = now + duration
        if self.on_ban is not None:
            self.on_ban(peer_id, duration, failures)
        return duration

    def defer(self, peer_id: str, now: float, seconds: float) -> None:
        """Avoid a peer briefly without counting a failure (it is busy, e.g. between rounds)."""
        self._until[peer_id] = max(self._until.get(peer_id, 0.0), now + seconds)

    def succeeded(self, peer_id: str) -> None:
        self._failures.pop(peer_id, None)

    def banned(self, now: float) -> set[str]:
        return {p for p, until in self._until.items() if until > now}


@dataclass
class DeadlineEstimator:
    """Deadline for one microbatch from observed round trips: a multiple of the recent p90,
    clamped to [minimum, maximum]. Fixed timeouts are the first source of failed rounds."""
    minimum: float
    maximum: float
    factor: float = 4.0
    window: int = 64
    _samples: deque = field(default_factory=deque)

    def observe(self, seconds: float) -> None:
        self._samples.append(seconds)
        while len(self._samples) > self.window:
            self._samples.popleft()

    def deadline(self) -> float:
        if len(self._samples) < 4:
            return self.maximum
        ordered = sorted(self._samples)
        p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
        return max(self.minimum, min(self.maximum, self.factor * p90))
