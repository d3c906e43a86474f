"""Credit for work: the samples (and tokens) each peer contributed, counted from the rounds' own
records, never from what a peer says of itself.

A round's evidence lives in the DHT under {run}/round/{stage}/{round}: every member's registration
(`digest`, `applied_rounds`, `weight` = the samples it trained for the round) and, under `/check`,
every member's outcome vote "<group hash>:<digest of the mean>" (peer/averaging/outcome.py). Each
entry is signed by its writer (peer/net/record_signing.py). A round **completed** for a group when
every member of the group voted the same digest: the vote's group hash is the hash of the sorted
member list (group.group_hash), so the voters of one value must be exactly the members it names.
That is the only state in which the members applied the round (outcome.py), so it is the work the
swarm kept: BOINC's rule (credit only validated work).

What a completed round credits each member is its registered weight, bounded by what the round
could have carried (`RoundBounds`):
- `round_capacity`: the samples one replica can train in a round, where the manifest fixes it
  (`rounds.inner_steps` × the samples of an inner step); None where rounds end on the clock;
- `max_weight_ratio` × the median weight of the *other* members (so a member of a group of two is
  bounded by its partner, and a lone claim of 10^9 among honest members is bounded by theirs);
- `bound(peer_id, stage, weight)`: a caller's own bound, e.g. by observed throughput × round time
  (where an evidence ledger of observed rates exists, it plugs in here).
Only the group matchmaking formed is credited: exactly the members `choose_group` picks from the
registrations of the round's voters (the reference state honest members average from; the rule
placement's evidence of work applies too, peer/placement/evidence.py `completed_voters`). Ids
that vote a group of their own beside it, from the same state or another, are credited nothing
(and deny that round's credit to the real group: which of the two is real cannot be told). A round of one member casts no
vote, so it is credited nothing: nobody validated it.

Uptime is the time a peer was seen ONLINE by whoever keeps the ledger (its records, read at each
look, counted up to `max_gap_s` between two looks): presence, not work, so it ranks contributors
after their samples and lists nobody on its own.

The module is pure: `completed_rounds` and `Ledger` take plain values; `scan_rounds` reads them
through a narrow `RoundEvidence` board (peer/net/dht_view.py SwarmView, or a dict in tests).
"""
from __future__ import annotations

import logging
import math
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Protocol

from swarmgrad.peer.averaging.group import completed_groups
from swarmgrad.peer.net.errors import NETWORK_FAILURES

logger = logging.getLogger(__name__)

DEFAULT_MAX_GAP_S = 120.0
"""Uptime: two sightings further apart than this count as this much (the peer may have left between)."""
REMEMBERED_ROUNDS = 4096
"""Credited (stage, round, group) keys remembered per stage, so a round read twice counts once. The
DHT keeps a round's entries for 4 × announce_ttl; a scan never reaches further back than that."""


@dataclass(frozen=True)
class RoundBounds:
    """What one round could have carried (see the module docstring)."""
    round_capacity: float | None = None
    max_weight_ratio: float = 8.0
    bound: Callable[[str, int, float], float] | None = None


@dataclass(frozen=True)
class CompletedRound:
    stage: int
    round: int
    group_hash: str
    digest: str
    """The digest of the mean every member voted."""
    members: tuple[str, ...]
    claimed: Mapping[str, float]
    """Each member's registered weight (0 for a member whose registration could not be read)."""
    credited: Mapping[str, float]
    """Each member's weight after RoundBounds: what the ledger adds."""


def _bounded(member: str, stage: int, claimed: Mapping[str, float], bounds: RoundBounds) -> float:
    weight = claimed[member]
    if bounds.round_capacity is not None:
        weight = min(weight, bounds.round_capacity)
    others = sorted(w for p, w in claimed.items() if p != member)
    if others and bounds.max_weight_ratio > 0:
        median = others[len(others) // 2] if len(others) % 2 else (others[len(others) // 2 - 1]
                                                                   + others[len(others) // 2]) / 2
        weight = min(weight, bounds.max_weight_ratio * median)
    if bounds.bound is not None:
        weight = min(weight, max(0.0, float(bounds.bound(member, stage, weight))))
    return weight if math.isfinite(weight) and weight > 0 else 0.0


def completed_rounds(stage: int, round_no: int, registrations: Mapping[str, Mapping[str, Any]],
                     votes: Mapping[str, str], bounds: RoundBounds = RoundBounds()) -> list[CompletedRound]:
    """The groups of (stage, round_no) that completed, each with its members' credited weights.

    `registrations`: peer id -> {"digest", "applied_rounds", "weight"} as validated from the DHT
    (dht_view.round_registrations); `votes`: peer id -> vote (dht_view.round_checks). A group
    completed when the voters of one digest vote "H:d" are exactly the members whose sorted list
    hashes to H, there are two or more, and they are exactly the group `choose_group` forms from the
    registrations of the round's voters."""
    out = []
    for group in completed_groups(votes, registrations):  # the rule placement's evidence counts by too
        claimed = {p: _weight(registrations.get(p, {}).get("weight")) for p in group.members}
        credited = {p: _bounded(p, stage, claimed, bounds) for p in group.members}
        out.append(CompletedRound(stage, round_no, group.group_hash, group.digest, group.members, claimed, credited))
    return out


def _weight(value: Any) -> float:
    try:
        weight = float(value)
    except (TypeError, ValueError):
        return 0.0
    return weight if math.isfinite(weight) and weight > 0 else 0.0


@dataclass
class Contribution:
    """One peer's credit, as the ledger counted it."""
    peer_id: str
    samples: float = 0.0
    rounds: int = 0
    stages: set[int] = field(default_factory=set)
    uptime_s: float = 0.0
    first_seen: float | None = None
    last_seen: float | None = None
    last_round: int | None = None
    """The latest round it was credited for."""


class Ledger:
    """Credit per peer, accumulated from completed rounds (`credit`) and sightings (`seen`).

    Each completed round is counted once, whoever reads it how often. Not thread-safe: one owner
    writes it (a coordinator's or monitor's loop); `rows` returns plain copies for other threads."""

    def __init__(self, tokens_per_sample: int | None = None, max_gap_s: float = DEFAULT_MAX_GAP_S):
        self.tokens_per_sample = tokens_per_sample
        self.max_gap_s = max_gap_s
        self.peers: dict[str, Contribution] = {}
        self._credited: dict[int, deque[tuple[int, str]]] = defaultdict(lambda: deque(maxlen=REMEMBERED_ROUNDS))
        self._credited_set: set[tuple[int, int, str]] = set()
        self._last_look: dict[str, float] = {}

    def _peer(self, peer_id: str) -> Contribution:
        if peer_id not in self.peers:
            self.peers[peer_id] = Contribution(peer_id)
        return self.peers[peer_id]

    def credited(self, stage: int, round_no: int, hash_: str) -> bool:
        return (stage, round_no, hash_) in self._credited_set

    def credit(self, completed: CompletedRound) -> bool:
        """Add a completed round's credited weights; False (and nothing added) if it was already counted."""
        key = (completed.stage, completed.round, completed.group_hash)
        if key in self._credited_set:
            return False
        remembered = self._credited[completed.stage]
        if len(remembered) == remembered.maxlen:
            old_round, old_hash = remembered[0]
            self._credited_set.discard((completed.stage, old_round, old_hash))
        remembered.append((completed.round, completed.group_hash))
        self._credited_set.add(key)
        for peer_id, weight in completed.credited.items():
            if weight <= 0:  # a member that trained nothing in the round (it just joined): nothing to credit
                continue
            c = self._peer(peer_id)
            c.samples += weight
            c.rounds += 1
            c.stages.add(completed.stage)
            c.last_round = completed.round if c.last_round is None else max(c.last_round, completed.round)
        return True

    def seen(self, online: Iterable[str], now: float) -> None:
        """The peers seen ONLINE at `now`: each gains the time since its previous sighting, at most
        `max_gap_s` (so a peer that left and came back is not credited for its absence)."""
        for peer_id in set(online):
            c = self._peer(peer_id)
            previous = self._last_look.get(peer_id)
            if previous is not None and now > previous:
                c.uptime_s += min(now - previous, self.max_gap_s)
            self._last_look[peer_id] = now
            c.first_seen = now if c.first_seen is None else min(c.first_seen, now)
            c.last_seen = now if c.last_seen is None else max(c.last_seen, now)

    def rows(self) -> list[dict[str, Any]]:
        """The leaderboard: peers credited for at least one round, most samples first, then most
        uptime (the JSON of /api/contributors' `contributors`)."""
        credited = [c for c in self.peers.values() if c.rounds > 0]
        credited.sort(key=lambda c: (-c.samples, -c.uptime_s, c.peer_id))
        return [{"rank": i + 1, "peer_id": c.peer_id, "samples": round(c.samples, 3),
                 "tokens": None if self.tokens_per_sample is None else round(c.samples * self.tokens_per_sample),
                 "rounds": c.rounds, "stages": sorted(c.stages), "uptime_s": round(c.uptime_s, 1),
                 "first_seen": c.first_seen, "last_seen": c.last_seen, "last_round": c.last_round}
                for i, c in enumerate(credited)]

    def totals(self) -> dict[str, Any]:
        samples = sum(c.samples for c in self.peers.values())
        return {"samples": round(samples, 3), "contributors": sum(1 for c in self.peers.values() if c.rounds > 0),
                "rounds": len(self._credited_set),
                "tokens": None if self.tokens_per_sample is None else round(samples * self.tokens_per_sample)}

    def to_json(self) -> dict[str, Any]:
        """Everything needed to go on counting after a restart (`from_json`)."""
        return {"tokens_per_sample": self.tokens_per_sample,
                "peers": [{"peer_id": c.peer_id, "samples": c.samples, "rounds": c.rounds, "stages": sorted(c.stages),
                           "uptime_s": c.uptime_s, "first_seen": c.first_seen, "last_seen": c.last_seen,
                           "last_round": c.last_round} for c in self.peers.values()],
                "credited": sorted([s, r, h] for s, r, h in self._credited_set)}

    @classmethod
    def from_json(cls, value: Mapping[str, Any], max_gap_s: float = DEFAULT_MAX_GAP_S) -> "Ledger":
        """A ledger saved by `to_json`. Raises ValueError (KeyError, TypeError) for anything else."""
        ledger = cls(value.get("tokens_per_sample"), max_gap_s)
        for row in value.get("peers", []):
            ledger.peers[str(row["peer_id"])] = Contribution(
                str(row["peer_id"]), float(row["samples"]), int(row["rounds"]), {int(s) for s in row["stages"]},
                float(row["uptime_s"]), row.get("first_seen"), row.get("last_seen"), row.get("last_round"))
        for s, r, h in sorted(value.get("credited", [])):
            ledger._credited[int(s)].append((int(r), str(h)))
            ledger._credited_set.add((int(s), int(r), str(h)))
        return ledger


class RoundEvidence(Protocol):
    """Where a round's registrations and votes are read (peer/net/dht_view.py: SwarmView)."""

    async def round_registrations(self, stage: int, round_no: int) -> dict[str, dict[str, Any]]: ...

    async def round_checks(self, stage: int, round_no: int) -> dict[str, str]: ...


async def scan_rounds(board: RoundEvidence, ledger: Ledger, current: Mapping[int, int], lookback: int,
                      bounds: RoundBounds = RoundBounds()) -> int:
    """Credit the completed rounds of each stage in [current[stage] − lookback, current[stage] − 1]
    (`current`: the latest round the stage's records announce) that the ledger has not counted yet.
    Returns how many groups were credited. A round whose entries cannot be read now is skipped (a
    later scan reads it again while it is in the window); only the network's failures are caught."""
    added = 0
    for stage, latest in sorted(current.items()):
        for round_no in range(max(0, latest - lookback), latest):
            try:
                votes = await board.round_checks(stage, round_no)
                if len(votes) < 2:
                    continue
                registrations = await board.round_registrations(stage, round_no)
            except NETWORK_FAILURES as e:
                logger.debug("credit: stage %d round %d unreadable now: %s", stage, round_no, e)
                continue
            for completed in completed_rounds(stage, round_no, registrations, votes, bounds):
                added += ledger.credit(completed)
    return added


def manifest_bounds(manifest: Any, bound: Callable[[str, int, float], float] | None = None) -> RoundBounds:
    """RoundBounds from a run's manifest (peer/manifest.py): with `rounds.inner_steps` H, a replica
    trains at most H inner steps of `inner.step_sizes` samples in a round; the ratio is the robust
    aggregate's `averaging.max_weight_ratio` (8 where it is disabled)."""
    steps = manifest.rounds.inner_steps
    capacity = float(steps * manifest.inner.step_samples) if steps > 0 else None
    ratio = manifest.averaging.max_weight_ratio if manifest.averaging.max_weight_ratio > 0 else 8.0
    return RoundBounds(round_capacity=capacity, max_weight_ratio=ratio, bound=bound)


def tokens_per_sample(manifest: Any) -> int | None:
    """A sample of a token model is `model.seq_len` tokens; None for an entry-point model (its
    samples are whatever the user's data yields)."""
    return int(manifest.model.seq_len) if manifest.model.kind != "entry_point" else None
