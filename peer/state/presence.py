"""Presence in the DHT: what this replica announces about itself, refreshed every heartbeat.

The record (stage, JOINING/ONLINE/LEAVING, measured rate, round, θ digest, ...) is what other
peers route, match and pick donors by; it expires after `timeouts.announce_ttl`, so a replica
that dies disappears by itself. The heartbeat also keeps the run's epoch (the origin of
wall-clock rounds) alive for as long as anyone runs.

The record is this object's alone: its status is derived from the replica's phase
(peer/state/phase.py), the measured figures are read when a store begins, and what others decide
they hand it (`set`, `set_stats`); it builds and stores the record, one store at a time.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Callable

from swarmgrad.peer.clock import RoundClock
from swarmgrad.peer.state.stage_state import StageState
from swarmgrad.peer.net.dht_view import SwarmView
from swarmgrad.peer.net.errors import BestEffort
from swarmgrad.peer.records import PeerRecord, ReplicaStats
from swarmgrad.peer.compute.worker import StageWorker
from swarmgrad.peer.state.phase import ReplicaPhase

logger = logging.getLogger(__name__)


class Presence:
    def __init__(self, swarm: SwarmView, *, peer_id: str, stage: int, manifest_hash: str, maddrs: tuple[str, ...],
                 phase: ReplicaPhase, worker: StageWorker, state: StageState, clock: RoundClock, heartbeat: float,
                 memory: int = 0, backups: Callable[[int], tuple[tuple[int, int], ...]] | None = None,
                 pinned: bool = False):
        self.swarm = swarm
        self.peer_id = peer_id
        self.stage = stage
        self.manifest_hash = manifest_hash
        self.maddrs = maddrs
        self.phase = phase
        """Read for the record's status (JOINING / ONLINE / LEAVING): `presence_status` of the phase."""
        self.worker = worker
        self.state = state
        self.clock = clock
        self.heartbeat = heartbeat
        self.memory = memory
        """Bytes this peer offers a stage (placement of others reads it)."""
        self._stats = ReplicaStats()
        self.backups = backups
        """(stage, applied_rounds) of the backups this peer holds, other than of `stage`."""
        self.pinned = pinned
        """This peer does not move between stages (announced: placement never picks it to move)."""
        self._moving = False
        """Set when this replica decided to move away: its stage has a mover, nobody else leaves it."""
        self._storing = asyncio.Lock()
        """One store of our record at a time. Two in flight (a heartbeat and the round's announce,
        or LEAVING on shutdown) may reach a DHT node out of order; the node keeps the one that
        expires later and refuses the other, and hivemind reports the refusal: an announce (LEAVING's
        on shutdown, which the `leaving` event reports) failed although a newer record was stored."""
        self._announcing = BestEffort(f"stage {stage}: announcing this replica's record", logger)
        self._refreshing = BestEffort(f"stage {stage}: refreshing the run's epoch", logger)

    @property
    def status(self) -> str:
        """JOINING until the replica serves (and while a stale one re-syncs), ONLINE while it
        does, LEAVING on the way out: read from the phase, so it changes the moment the phase does."""
        return self.phase.status

    @property
    def moving(self) -> bool:
        return self._moving

    @property
    def stats(self) -> ReplicaStats:
        """What the record carries as `stats` (a copy: hand changes to `set_stats`)."""
        return dataclasses.replace(self._stats)

    def set(self, *, moving: bool) -> None:
        """This replica decided to move away (announced with the next store)."""
        self._moving = moving

    def set_stats(self, **values: Any) -> None:
        """New figures for the record's `stats` (ReplicaStats fields; an unknown name raises
        TypeError), announced with the next store."""
        self._stats = dataclasses.replace(self._stats, **values)

    def record(self) -> PeerRecord:
        return PeerRecord(peer_id=self.peer_id, stage=self.stage, state=self.status,
                          throughput=self.worker.rate.rate, round=self.clock.current,
                          applied_rounds=self.state.applied_rounds, digest=self.state.digest,
                          manifest_hash=self.manifest_hash, driver=self.stage == 0, maddrs=self.maddrs[:4],
                          memory=self.memory, moving=self._moving, pinned=self.pinned, stats=self._stats.to_value(),
                          backups=self.backups(self.stage) if self.backups is not None else ())

    async def announce(self) -> bool:
        """Store our record now; False if the store failed or was refused. The network's failure
        is logged, not raised (the first at warning): the next heartbeat tries again, and the
        record's expiry covers a dead DHT. Anything else is a bug and propagates. A store queued
        behind one in flight announces the phase as it is when the queued store begins (the record
        is built then)."""
        async with self._storing:
            with self._announcing:
                return await self.swarm.announce(self.record())  # built here: expires after the last
        return False

    async def run(self) -> None:
        """Heartbeat until cancelled."""
        while True:
            await asyncio.sleep(self.heartbeat)
            await self.announce()
            if self.clock.epoch is not None:
                with self._refreshing:  # the next heartbeat tries again; the entry outlives a few misses
                    await self.swarm.refresh_epoch(self.clock.epoch)
