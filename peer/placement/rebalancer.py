"""Rebalancing, the daemon's side: at jittered intervals gather a snapshot of the swarm, ask the
placement policy (peer/placement/rules.py, pure) whether this replica should move, and hand a move
that came up on two checks in a row to the peer, which makes it (make-before-break)."""
from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from typing import Callable, Sequence

from swarmgrad.peer.placement.rules import (EMPTY_CHECK_SHARE, Confirmation, EmptyStageChecks, MoveDecision,
                                      PeerFigures, PlacementPolicy, check_interval, estimate_rates, expected_tenure,
                                      should_move)
from swarmgrad.peer.placement.evidence import (UNPROVEN_STAGE_SHARE, StageService, WorkSeen, bound_claims, completed_voters,
                                               evidenced)
from swarmgrad.peer.placement.plan import LIVE, Snapshot
from swarmgrad.peer.placement.cost import StageCost
from swarmgrad.peer.decisions import majority_digest
from swarmgrad.peer.net.dht_view import SwarmView
from swarmgrad.peer.net.errors import BestEffort
from swarmgrad.peer.records import ONLINE, PeerRecord

logger = logging.getLogger(__name__)

DEFAULT_BANDWIDTH = 10e6
"""Bytes/s assumed for a state download before one was measured (an ordinary volunteer link)."""
DWELL_CHECKS = 4
"""After a move, a peer lets this many check intervals pass before it considers the next one: its
rate on the new stage is an estimate until it has measured itself there, and acting on the
estimate can send a peer back and forth between two stages."""


def current_rounds(view: dict[int, list[PeerRecord]]) -> dict[int, int]:
    """Each stage's applied rounds as its majority announces them (decisions.majority_digest): a
    backup of that many rounds is the stage's current state."""
    out = {}
    for stage, records in view.items():
        digest = majority_digest(records)
        if digest is not None:
            out[stage] = next(r.applied_rounds for r in records if r.state == ONLINE and r.digest == digest)
    return out


def snapshot_from_view(view: dict[int, list[PeerRecord]], costs: Sequence[StageCost],
                       work: WorkSeen | None = None, round_no: int = 0, unserved: frozenset[int] = frozenset()
                       ) -> Snapshot:
    """The placement snapshot of what was read. With ``work`` (what this peer saw of completed
    voted rounds, up to round ``round_no``) it counts only what has evidence
    (peer/placement/evidence.py): one record per id, movers and capacity of proven replicas, other
    claims bounded, and no unproven live record under an ``unserved`` stage (``StageService``).
    Without it (``swarmgrad status``) every record counts."""
    proven = None
    if work is not None:
        view, proven = evidenced(view, work.proven(round_no), work.seen_any, unserved)
    snap = Snapshot.from_records(view, costs, memory={r.peer_id: r.memory for rs in view.values() for r in rs},
                                 moving={r.peer_id for rs in view.values() for r in rs if r.moving},
                                 current=current_rounds(view), proven=proven)
    return snap if proven is None else bound_claims(snap, UNPROVEN_STAGE_SHARE)


async def read_work(swarm: SwarmView, work: WorkSeen, n_stages: int, round_no: int) -> None:
    """Feed ``work`` the completed groups of each stage's two rounds before ``round_no`` (those not
    already seen complete): the votes and registrations of a round expire from the DHT a few
    announce TTLs after it, so each check reads the rounds that just ended. Raises
    SwarmUnavailable when the network fails a read."""
    wanted = [(s, r) for s in range(n_stages) for r in (round_no - 1, round_no - 2)
              if r >= 0 and not work.settled(s, r)]

    async def read(s: int, r: int) -> tuple[dict[str, str], dict[str, dict]]:
        return await swarm.round_checks(s, r), await swarm.round_registrations(s, r)
    found = await asyncio.gather(*(read(s, r) for s, r in wanted))
    for (s, r), (checks, registrations) in zip(wanted, found):
        work.observe(s, r, completed_voters(checks, registrations))


class Rebalancer:
    def __init__(self, *, swarm: SwarmView, peer_id: str, costs: Sequence[StageCost], bench_rates: Sequence[float],
                 memory: int, interval_s: float, policy: PlacementPolicy = PlacementPolicy(), seed: int | None = None,
                 bandwidth: Callable[[], float] = lambda: DEFAULT_BANDWIDTH, unserved_after: float = math.inf,
                 clock: Callable[[], float] = time.monotonic):
        """``unserved_after``: seconds after which a stage no evidence shows served stops being held
        by unproven records (evidence.unserved_after of the run's timeouts; inf: never)."""
        self.swarm = swarm
        self.peer_id = peer_id
        self.costs = tuple(costs)
        self.bench_rates = tuple(bench_rates)
        """This peer's benchmarked samples/s per stage (used until it has measured itself)."""
        self.memory = memory
        self.interval_s = interval_s
        self.policy = policy
        self.rng = random.Random(seed)
        self.started = time.monotonic()
        self.bandwidth = bandwidth
        self._dwell_until = 0.0
        """This peer's measured link rate in bytes/s (rpc.LinkMeter), for a move's switch time."""
        self._reading = BestEffort("reading the swarm for a rebalancing check", logger)
        self.work = WorkSeen()
        """Who this peer saw complete voted rounds, per stage: placement's evidence."""
        self.clock = clock
        self.unserved_after = unserved_after
        self.service = StageService(len(self.costs), clock())
        """When each stage was last seen served (a proven replica there, or this peer trained)."""
        self._trained: int | None = None

    def figures(self, stage: int, measured_rate: float) -> PeerFigures:
        rates = (estimate_rates(measured_rate, stage, [c.cost for c in self.costs]) if measured_rate > 0
                 else self.bench_rates)
        return PeerFigures(peer_id=self.peer_id, rates=tuple(rates), memory=self.memory, bandwidth=self.bandwidth(),
                           tenure=expected_tenure(time.monotonic() - self.started))

    async def decide(self, stage: int, measured_rate: float, salt: int, trained: int | None = None
                     ) -> tuple[Snapshot, MoveDecision | None]:
        """One check, unconfirmed: what the policy says now. ``salt`` is this replica's round;
        ``trained``: the microbatches it trained ever (a growth since the last check: every stage
        served them; None: unknown)."""
        view = await self.swarm.swarm()
        await read_work(self.swarm, self.work, len(self.costs), salt)
        now, proven = self.clock(), self.work.proven(salt)
        grew = trained is not None and self._trained is not None and trained > self._trained
        self._trained = trained
        self.service.observe(now, {s for s, records in view.items() for r in records
                                   if r.state in LIVE and (r.peer_id, s) in proven}, grew)
        snap = snapshot_from_view(view, self.costs, self.work, salt, self.service.unserved(now, self.unserved_after))
        return snap, should_move(snap, self.figures(stage, measured_rate), stage, salt=salt, policy=self.policy)

    def moved(self) -> None:
        """The peer just moved: stay put for DWELL_CHECKS intervals."""
        self._dwell_until = time.monotonic() + DWELL_CHECKS * self.interval_s

    async def next_move(self, stage: int, rate_fn, salt_fn, trained_fn: Callable[[], int] | None = None
                        ) -> MoveDecision:
        """Check until a move is confirmed (same decision twice in a row), then return it.
        `rate_fn()` gives the replica's measured rate, `salt_fn()` its round (the tie-break salt
        that all replicas of a stage share), `trained_fn()` the microbatches it trained ever
        (`decide`)."""
        dwell = self._dwell_until - time.monotonic()
        if dwell > 0:
            await asyncio.sleep(dwell)
        confirm = Confirmation(self.policy.confirmations)
        quick = self._dwell_until == 0.0  # at the start (a peer that moved dwelt first); then as seen
        empties = EmptyStageChecks()
        while True:
            wait = check_interval(self.interval_s / (EMPTY_CHECK_SHARE if quick else 3 if confirm.pending else 1),
                                  self.rng)
            await asyncio.sleep(wait)
            with self._reading:  # a slow DHT: skip this check, never act on a partial view
                snap, decision = await self.decide(stage, rate_fn(), salt_fn(),
                                                   trained_fn() if trained_fn is not None else None)
            if not self._reading.ok:
                continue
            quick = empties.observe(snap.empty_stages, moved=decision is not None)
            confirmed = confirm.observe(decision)
            if confirmed is not None:
                return confirmed
