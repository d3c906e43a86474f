"""Routing decisions, pure: which replica of the next stage gets a microbatch, who is banned,
how long to wait. No network here; the pipeline gathers the inputs and acts on the answers."""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from swarmgrad.peer.net.retry import Backoff


@dataclass(frozen=True)
class Candidate:
    peer_id: str
    throughput: float
    """Announced samples/s of this replica's compute (forward + backward, moving average)."""


def choose_replica(candidates: Sequence[Candidate], in_flight: dict[str, int], banned: set[str],
                   rng: random.Random) -> str | None:
    """SWARM's stochastic wiring: pick at random, weighted by throughput / (1 + our queue to it).

    A replica with no measurement yet gets the median weight of the others, so a newcomer
    is tried rather than starved. Returns None when every candidate is banned.
    """
    usable = [c for c in candidates if c.peer_id not in banned]
    if not usable:
        return None
    measured = sorted(c.throughput for c in usable if c.throughput > 0)
    fallback = measured[len(measured) // 2] if measured else 1.0
    weights = [(c.throughput if c.throughput > 0 else fallback) / (1 + in_flight.get(c.peer_id, 0)) for c in usable]
    return rng.choices([c.peer_id for c in usable], weights=weights, k=1)[0]


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
