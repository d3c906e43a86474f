"""Presence in the DHT: what this replica announces about itself, refreshed every heartbeat.

The record (stage, JOINING/ONLINE/LEAVING, measured rate, round, θ digest, ...) is what other
peers route, match and pick donors by; it expires after `timeouts.announce_ttl`, so a replica
that dies disappears by itself. The heartbeat also keeps the run's epoch (the origin of
wall-clock rounds) alive for as long as anyone runs.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

from swarmgrad.peer.clock import RoundClock
from swarmgrad.peer.state.stage_state import StageState
from swarmgrad.peer.net.dht_view import SwarmView
from swarmgrad.peer.records import JOINING, PeerRecord
from swarmgrad.peer.compute.worker import StageWorker
from swarmgrad.peer.records import ReplicaStats

logger = logging.getLogger(__name__)


class Presence:
    def __init__(self, swarm: SwarmView, *, peer_id: str, stage: int, manifest_hash: str, maddrs: tuple[str, ...],
                 worker: StageWorker, state: StageState, clock: RoundClock, heartbeat: float, memory: int = 0,
                 stats: ReplicaStats | None = None,
                 backups: Callable[[int], tuple[tuple[int, int], ...]] | None = None, pinned: bool = False):
        self.swarm = swarm
        self.peer_id = peer_id
        self.stage = stage
        self.manifest_hash = manifest_hash
        self.maddrs = maddrs
        self.worker = worker
        self.state = state
        self.clock = clock
        self.heartbeat = heartbeat
        self.memory = memory
        """Bytes this peer offers a stage (placement of others reads it)."""
        self.stats = stats if stats is not None else ReplicaStats()
        self.backups = backups
        """(stage, applied_rounds) of the backups this peer holds, other than of `stage`."""
        self.pinned = pinned
        """This peer does not move between stages (announced: placement never picks it to move)."""
        self.moving = False
        """Set when this replica decided to move away: its stage has a mover, nobody else leaves it."""
        self.status = JOINING
        """JOINING until the replica serves, ONLINE while it does, LEAVING on the way out."""
        self._storing = asyncio.Lock()
        """One store of our record at a time. Two in flight (a heartbeat and the round's announce,
        or LEAVING on shutdown) may reach a DHT node out of order; the node keeps the one that
        expires later and refuses the other, and hivemind reports the refusal: an announce (LEAVING's
        on shutdown, which the `leaving` event reports) failed although a newer record was stored."""

    def record(self) -> PeerRecord:
        return PeerRecord(peer_id=self.peer_id, stage=self.stage, state=self.status,
                          throughput=self.worker.rate.rate, round=self.clock.current,
                          applied_rounds=self.state.applied_rounds, digest=self.state.digest,
                          manifest_hash=self.manifest_hash, driver=self.stage == 0, maddrs=self.maddrs[:4],
                          memory=self.memory, moving=self.moving, pinned=self.pinned, stats=self.stats.to_value(),
                          backups=self.backups(self.stage) if self.backups is not None else ())

    async def announce(self, status: str | None = None) -> bool:
        """Store our record now (optionally in a new status). A failed store is logged, not raised:
        the next heartbeat tries again, and the record's expiry covers a dead DHT."""
        if status is not None:
            self.status = status  # at once: a store queued behind the lock announces it too
        try:
            async with self._storing:
                return await self.swarm.announce(self.record())  # built here: expires after the last
        except Exception as e:
            logger.warning("stage %d: announce failed: %s: %s", self.stage, type(e).__name__, e)
            return False

    async def run(self) -> None:
        """Heartbeat until cancelled."""
        while True:
            await asyncio.sleep(self.heartbeat)
            await self.announce()
            if self.clock.epoch is not None:
                try:
                    await self.swarm.refresh_epoch(self.clock.epoch)
                except Exception as e:
                    logger.debug("epoch refresh failed: %s: %s", type(e).__name__, e)
