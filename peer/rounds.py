"""The round loop of one stage replica: wait for the boundary, pause the worker, average, apply
the outer step, resume, report.

The runner is the only writer of the round clock's round and of θ_global between joins; the
averager does the group work (peer/averaging.py), state sync the re-sync after a failed round
(peer/state_sync.py), and `policy` the decisions.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from pathlib import Path
from typing import Awaitable, Callable

import torch
from hivemind.utils import get_dht_time

from swarmgrad.peer import policy
from swarmgrad.peer.averaging import Averager, RoundResult
from swarmgrad.peer.backup import BackupPusher
from swarmgrad.peer.clock import RoundClock
from swarmgrad.peer.events import EventLog
from swarmgrad.peer.presence import Presence
from swarmgrad.peer.rpc import Traffic
from swarmgrad.peer.schedule import TrainingProgress
from swarmgrad.peer.state import StageState
from swarmgrad.peer.state_sync import StateSync
from swarmgrad.peer.swarm import SwarmView
from swarmgrad.peer.worker import StageWorker

logger = logging.getLogger(__name__)

BOUNDARY_POLL_SECONDS = 1.0
"""How often a waiting boundary re-reads the drivers' records (events wake it sooner)."""


class RoundRunner:
    def __init__(self, *, stage: int, clock: RoundClock, worker: StageWorker, state: StageState,
                 averager: Averager, sync: StateSync, presence: Presence, swarm: SwarmView,
                 progress: TrainingProgress, traffic: Traffic, events: EventLog, schedule_outer: bool,
                 save_dir: str | None, peer_id: str, after_round: Callable[[], Awaitable[None]] | None = None,
                 backups: BackupPusher | None = None, byzantine: str | None = None):
        self.stage = stage
        self.byzantine = byzantine
        """TESTING AID (--byzantine): corrupt this replica's pseudo-gradient before it is sent
        (benchmarks/byzantine.py measures what robust averaging makes of it)."""
        self.clock = clock
        self.worker = worker
        self.state = state
        self.averager = averager
        self.sync = sync
        self.presence = presence
        self.swarm = swarm
        self.progress = progress
        self.traffic = traffic
        self.events = events
        self.schedule_outer = schedule_outer
        self.save_dir = save_dir
        self.peer_id = peer_id
        self.after_round = after_round
        """Called after every round's report (the driving loop schedules evaluations there)."""
        self.backups = backups
        self._bytes_mark = (0, 0)
        self._round_started = time.monotonic()
        self.leave_after_round = False
        """Set when the peer moves to another stage: the current round is the last one here."""

    async def run(self, stop: asyncio.Event) -> None:
        """Run rounds until the clock has counted max_rounds (or forever, or until `stop`)."""
        self._round_started = time.monotonic()
        while not stop.is_set():
            round = self.clock.current
            await self.wait_boundary(round, stop)
            if stop.is_set():
                return
            await self.run_round(round)
            if self.leave_after_round:
                return  # the worker stays paused: no microbatch starts here any more
            if self.clock.finished:
                # no more rounds: the worker must not stay paused (the clock no longer pauses it
                # after H steps), or the drivers' final evaluation would wait on a round that never comes
                if self.worker.paused:
                    await self.worker.resume()
                return

    async def wait_boundary(self, round: int, stop: asyncio.Event) -> None:
        """Wait until round `round` ends (policy.round_ended), waking on inner steps and on later
        rounds announced by microbatches."""
        while not stop.is_set():
            drivers_min = None
            if self.stage > 0 and self.clock.epoch is None:
                try:
                    drivers_min = policy.drivers_min_round(await self.swarm.stage_records(0))
                except Exception as e:
                    logger.debug("stage %d: could not read drivers' records: %s", self.stage, e)
            now = get_dht_time()
            if policy.round_ended(round=round, seen=self.clock.seen, counts_steps=self.clock.counts_steps,
                                  inner_steps=self.worker.inner_steps, steps_per_round=self.clock.cfg.inner_steps,
                                  now=now, wall_end=self.clock.wall_end(round), drivers_min_round=drivers_min):
                return
            wall_end = self.clock.wall_end(round)
            wait = BOUNDARY_POLL_SECONDS if wall_end is None else min(BOUNDARY_POLL_SECONDS, wall_end - now)
            await self.clock.wait_change(max(0.01, wait))

    async def run_round(self, round: int) -> RoundResult:
        started = time.monotonic()
        worker, state = self.worker, self.state
        await worker.pause()
        samples, losses, steps = worker.samples, list(worker.losses), worker.inner_steps
        lr = worker.lr
        lr_start = worker.cfg.lr * self.progress.multiplier(0)  # agreed position: equal on every replica
        sent0, recv0 = self.traffic.sent, self.traffic.recv
        self.averager.patience = policy.matchmaking_patience(
            self.averager.m.timeouts.matchmaking, time.monotonic() - self._round_started, self.clock.cfg.inner_steps > 0)
        try:
            delta = await worker.run(state.pseudo_gradient, worker.module)
            if self.byzantine:
                delta = corrupt(delta, self.byzantine, round)
            result = await self.averager.run_round(round, delta, float(samples), state.digest, state.applied_rounds)
        except Exception as e:  # a round that raised is an incomplete round, never a dead peer
            logger.exception("stage %d round %d failed", self.stage, round)
            result = RoundResult(False, f"{type(e).__name__}: {e}", (), None)
        next_round = self.clock.next_round(get_dht_time())
        carry = False
        if result.complete:
            assert result.mean_delta is not None
            # A round in which the whole group trained on nothing is a no-op: an outer step on a zero
            # pseudo-gradient would still move θ_global by momentum alone, on no evidence.
            if result.total_weight > 0:
                outer_mult = self.progress.round_multiplier() if self.schedule_outer else 1.0
                await worker.run(state.apply_outer, result.mean_delta, result.total_weight, outer_mult)
                self.progress.completed_round(result.total_weight, float(samples))
            self.clock.advance(next_round)
            await worker.run(state.commit, self.clock.current)
            await worker.run(state.copy_to, worker.module)
            if self.backups is not None and result.total_weight > 0:
                self.backups.after_round(self.peer_id, result.group, state.snapshot)
        else:
            logger.warning("stage %d round %d incomplete: %s", self.stage, round, result.reason)
            if await self.sync.resync(round, result):
                await worker.run(state.copy_to, worker.module)
                self.averager.reset_feedback()
            else:
                carry = True  # nobody applied this round: θ_global unchanged everywhere, keep θ_local's work
            self.clock.advance(next_round)
            await worker.run(state.commit, self.clock.current)
        self.clock.count(result.complete and result.total_weight > 0)
        await self.presence.announce()
        if not self.leave_after_round:
            await worker.resume(carry_over=carry)
        self._report(round, result, samples, losses, steps, (lr, lr_start), started, sent0, recv0)
        if self.save_dir:
            await asyncio.get_running_loop().run_in_executor(None, self.save)
        if self.after_round is not None and not self.leave_after_round:
            await self.after_round()
        return result

    def save(self) -> None:
        if self.save_dir:
            self.state.save(Path(self.save_dir) / f"stage{self.stage}-{self.peer_id[-8:]}.safetensors",
                            {"stage": str(self.stage), "peer": self.peer_id})

    def _report(self, round: int, result: RoundResult, samples: int, losses: list[float], steps: int,
                lrs: tuple[float, float], started: float, sent0: int, recv0: int) -> None:
        lr, lr_start = lrs
        elapsed = max(1e-9, time.monotonic() - self._round_started)
        self._round_started = time.monotonic()
        train_loss = sum(losses) / len(losses) if losses else math.nan
        sent, recv = self.traffic.sent - self._bytes_mark[0], self.traffic.recv - self._bytes_mark[1]
        self._bytes_mark = (self.traffic.sent, self.traffic.recv)
        self.events.emit("round", round=round, train_loss=train_loss, samples=samples, inner_steps=steps,
                         bytes_sent=sent, bytes_recv=recv, avg_bytes_sent=self.traffic.sent - sent0,
                         avg_bytes_recv=self.traffic.recv - recv0, complete=result.complete,
                         reason=result.reason, group_size=len(result.group), group=list(result.group),
                         digest=self.state.digest, applied_rounds=self.state.applied_rounds,
                         samples_per_s=samples / elapsed, round_s=round_ms(elapsed),
                         averaging_s=round_ms(time.monotonic() - started),
                         lr=lr, lr_start=lr_start, swarm_samples=self.state.trained_samples, rate=self.worker.rate.rate,
                         skipped_steps=self.worker.skipped_steps, uncommitted=self.worker.uncommitted)
        stats = self.presence.stats
        stats.train_loss = train_loss if losses else None
        stats.round_s, stats.group_size = round_ms(elapsed), len(result.group)
        stats.samples_per_s = samples / elapsed
        stats.samples += samples
        stats.bytes_sent = self.traffic.sent
        by_kind = self.traffic.sent_by_kind
        stats.bytes_activations, stats.bytes_gradients = by_kind["activations"], by_kind["gradients"]
        stats.bytes_averaging, stats.bytes_state = by_kind["averaging"], by_kind["state"]
        logger.info("stage %d round %d: loss %s | %.1f samples/s | lr %.2e | sent %.2f MB recv %.2f MB | group %d %s",
                    self.stage, round, f"{train_loss:.3f}" if losses else "-", samples / elapsed, lr,
                    sent / 1e6, recv / 1e6, len(result.group),
                    "ok" if result.complete else f"INCOMPLETE ({result.reason})")


BYZANTINE_MODES = ("scale", "random")


def corrupt(delta: dict[str, torch.Tensor], mode: str, round: int) -> dict[str, torch.Tensor]:
    """A hostile replica's pseudo-gradient (testing aid): `scale` sends 100 x the honest one,
    `random` Gaussian noise with 10 x its RMS, tensor by tensor (seeded by the round)."""
    if mode == "scale":
        return {n: d * 100.0 for n, d in delta.items()}
    generator = torch.Generator().manual_seed(1_000_003 * round + 17)
    out = {}
    for n, d in delta.items():
        rms = float(d.pow(2).mean().sqrt()) if d.numel() else 0.0
        out[n] = torch.randn(d.shape, generator=generator) * (10.0 * rms + 1e-6)
    return out


def round_ms(seconds: float) -> float:
    return round(seconds, 3)
