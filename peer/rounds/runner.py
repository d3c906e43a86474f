"""The round loop of one stage replica: wait for the boundary, pause the worker, average, apply
the outer step, resume, report. With `rounds.overlap` the worker resumes before the averaging and
the outer step lands during the next round (peer/rounds/overlap.py).

The runner is the only writer of the round clock's round, of θ_global between joins and of the
replica's phase (peer/state/phase.py: SERVING, AVERAGING at a boundary, HOLDING for joiners,
OVERLAPPED while a round averages in the background, JOINING while a stale replica re-syncs; the
replica asks it to `serve` and to `leave`). The averager does the group work
(peer/averaging/averager.py), state sync the re-sync after a failed round (peer/state/sync.py), and
`decisions` the decisions.
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

from swarmgrad.peer.rounds import overlap
from swarmgrad.peer import decisions
from swarmgrad.peer.averaging.averager import Averager, RoundResult
from swarmgrad.peer.state.backup import BackupPusher
from swarmgrad.peer.clock import RoundClock
from swarmgrad.peer.net.deadline import within
from swarmgrad.peer.net.errors import NETWORK_FAILURES, BestEffort
from swarmgrad.peer.events import EventLog
from swarmgrad.peer.state.phase import Phase, ReplicaPhase
from swarmgrad.peer.state.presence import Presence
from swarmgrad.peer.net.rpc import Traffic
from swarmgrad.peer.compute.schedule import TrainingProgress
from swarmgrad.peer.state.stage_state import StageState
from swarmgrad.peer.state.sync import StateSync
from swarmgrad.peer.net.dht_view import SwarmView
from swarmgrad.peer.records import ONLINE
from swarmgrad.peer.compute.worker import StageWorker
from swarmgrad.protocol.framing import ProtocolError

logger = logging.getLogger(__name__)

BOUNDARY_POLL_SECONDS = 1.0
"""How often a waiting boundary re-reads the drivers' records (events wake it sooner)."""
JOIN_HOLD_POLL_SECONDS = 0.25
JOIN_HOLD_MIN_SHARE = 0.25
"""A peer is held for only once it has asked this replica for at least this fraction of the state
(decisions.join_hold): a joiner asks for the whole state, spread over at most two donors (one
donor's share of a state in several parts is a third or more unless one tensor dwarfs the rest)."""
JOIN_HOLD_WINDOW_FACTOR = 10
"""Holds for joiners last at most timeouts.join_hold in all over any window this many times as
long (decisions.join_hold_left): whatever ids ask, a stage stalls for them at most a tenth of its time."""
JOIN_HOLD_STALL_SECONDS = 10.0
"""A hold for a joiner ends once its download from us has not moved (no request, no stream of its
open to us) for this long, or half of timeouts.join_hold if that is longer: its download stalled,
or ended long enough ago for a real joiner to have loaded the state and come ONLINE
(decisions.join_hold). Loading a 125M-parameter stage and announcing ONLINE took longer than
10 s on 2 loaded cores (benchmarks/scale.py): the donor went on, and the joiner's first round
was of a stale round."""
HELD_FOR_KEPT = 4096
"""Peer ids a boundary was held for, remembered so that none is held for twice."""
"""How often a boundary held for joiners re-reads the stage's records."""
ROUND_FAILURES: tuple[type[BaseException], ...] = (*NETWORK_FAILURES, ProtocolError)
"""What a round's averaging fails with when the swarm, not our code, failed it: the network's
failures, or a member's refusal or malformed reply (ProtocolError)."""


class RoundRunner:
    def __init__(self, *, stage: int, clock: RoundClock, worker: StageWorker, state: StageState,
                 averager: Averager, sync: StateSync, presence: Presence, phase: ReplicaPhase, swarm: SwarmView,
                 progress: TrainingProgress, traffic: Traffic, events: EventLog, schedule_outer: bool,
                 save_dir: str | None, peer_id: str, join_hold: float, dht_timeout: float, matchmaking: float,
                 after_round: Callable[[int, RoundResult], Awaitable[None]] | None = None,
                 backups: BackupPusher | None = None, byzantine: str | None = None, overlap: bool = False,
                 overlap_steps: int = 0):
        """`join_hold`, `dht_timeout`, `matchmaking`: timeouts.join_hold, timeouts.dht and
        timeouts.matchmaking (peer/manifest.py)."""
        self.stage = stage
        self.phase = phase
        """The replica's phase: this runner is its one writer (peer/state/phase.py)."""
        self.join_hold = join_hold
        self.dht_timeout = dht_timeout
        self.matchmaking = matchmaking
        self.overlap = overlap
        """rounds.overlap: average in the background while the next round trains (peer/rounds/overlap.py)."""
        self.overlap_steps = overlap_steps
        """rounds.overlap_steps: inner steps after which the worker waits for the mean in flight (0: none)."""
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
        self._mark = (time.monotonic(), worker.compute_total)
        """(time, worker compute seconds) at the last resume: a round's wall time and utilisation start there."""
        self._carried = 0
        """Samples of rounds that applied nothing, still in θ_local: they weigh in the next round."""
        self._in_flight: overlap.InFlight | None = None
        self._boundary = False
        """Between the worker's pause at a boundary and its resume: an overlapped round whose mean
        lands then leaves the replica AVERAGING, not SERVING."""
        self._samples_trained = 0
        """Samples this replica trained so far (the record's stats.samples)."""
        self.leave_after_round = False
        """Set when the peer moves to another stage: the current round is the last one here."""
        self._holds: list[tuple[float, float]] = []
        """(start, end), monotonic, of the boundaries held for joiners in the last window
        (decisions.join_hold_left)."""
        self._held_for: dict[str, None] = {}
        """Peer ids a boundary was held for (insertion-ordered, at most HELD_FOR_KEPT): one hold each."""
        self._counting = BestEffort(f"stage {stage}: counting its replicas", logger)
        self._reading_drivers = BestEffort(f"stage {stage}: reading the drivers' records at a boundary", logger)
        self._reading_joiners = BestEffort(f"stage {stage}: reading the stage's records to hold for joiners", logger)
        self._listing = BestEffort(f"stage {stage}: listing connected peers", logger)

    def serve(self) -> None:
        """The replica's handlers are up and its state is committed: it serves (JOINING -> SERVING).
        Called once, by Replica.start."""
        self.phase.enter(Phase.SERVING)

    def leave(self) -> None:
        """The replica is on its way out (Replica.close): LEAVING, for good."""
        self.phase.enter(Phase.LEAVING)

    async def run(self, stop: asyncio.Event) -> None:
        """Run rounds until the clock has counted max_rounds (or forever, or until `stop`)."""
        self._mark = (time.monotonic(), self.worker.compute_total)
        if self.worker.moment_replicas is not None:
            await self._count_replicas()
        try:
            while not stop.is_set():
                round_no = self.clock.current
                await self.wait_boundary(round_no, stop)
                if stop.is_set():
                    return
                await self.run_round(round_no)
                if self.leave_after_round:
                    return  # the worker stays paused: no microbatch starts here any more
                if self.clock.finished:
                    # no more rounds: the worker must not stay paused (the clock no longer pauses it
                    # after H steps), or the drivers' final evaluation would wait on a round that never comes
                    if self.worker.paused:
                        await self.worker.resume()
                    self._resume_phase()
                    return
        finally:
            await self._drop_in_flight()

    async def _count_replicas(self) -> None:
        """Until the first round's group is known, the replicas the stage records call ONLINE are
        the best guess of who this one's steps are averaged with (inner.swarm_second_moment)."""
        with self._counting:  # unknown: M stays 1 (no correction) until the first round's group
            online = {r.peer_id for r in await self.swarm.stage_records(self.stage) if r.state == ONLINE}
            self.worker.set_replicas(len(online | {self.peer_id}))

    async def wait_boundary(self, round_no: int, stop: asyncio.Event) -> None:
        """Wait until round `round` ends (decisions.round_ended), waking on inner steps and on later
        rounds announced by microbatches."""
        def ended(drivers_min: int | None) -> bool:
            return decisions.round_ended(round_no=round_no, seen=self.clock.seen, counts_steps=self.clock.counts_steps,
                                      inner_steps=self.worker.inner_steps, steps_per_round=self.clock.cfg.inner_steps,
                                      now=get_dht_time(), wall_end=self.clock.wall_end(round_no),
                                      drivers_min_round=drivers_min)

        while not stop.is_set():
            if ended(None):
                return
            now = get_dht_time()
            wall_end = self.clock.wall_end(round_no)
            wait = max(0.01, BOUNDARY_POLL_SECONDS if wall_end is None else min(BOUNDARY_POLL_SECONDS, wall_end - now))
            if self.stage > 0 and self.clock.epoch is None:
                # the drivers' records end a round that gets no more work; the read races the
                # clock, because over a slow link it takes a good part of a second and a microbatch
                # of the next round (which ends ours at once) may arrive meanwhile
                change = asyncio.ensure_future(self.clock.wait_change(wait))
                read = asyncio.ensure_future(self.swarm.stage_records(0))
                try:
                    await asyncio.wait([change, read], return_when=asyncio.FIRST_COMPLETED)
                    if ended(None):
                        return
                    with self._reading_drivers:  # unknown: the clock and the next poll end the round
                        if ended(decisions.drivers_min_round(await read)):
                            return
                    await change  # the rest of the poll interval, unless something changes
                finally:
                    for task in (change, read):
                        task.cancel()
                    await asyncio.gather(change, read, return_exceptions=True)
            else:
                await self.clock.wait_change(wait)

    async def run_round(self, round_no: int) -> RoundResult | None:
        """End round `round`: a plain round (average, then resume), or with `rounds.overlap` an
        overlapped one (resume at once, average in the background; peer/rounds/overlap.py). Returns the
        plain round's result, None for an overlapped one (its result comes later)."""
        boundary = time.monotonic()
        worker = self.worker
        self._boundary = True
        if self.phase.current is Phase.SERVING:  # OVERLAPPED stays so until its mean lands
            self.phase.enter(Phase.AVERAGING)
        await worker.pause()
        await self._finish_in_flight()  # the previous overlapped round's mean, applied before Δ is taken
        last = overlap.is_last_round(leaving=self.leave_after_round, max_rounds=self.clock.max_rounds,
                                     rounds_done=self.clock.rounds_done)
        if not last:
            await self._hold_for_joiners(round_no)
        report = self._boundary_report(boundary)
        if self.overlap and not last:
            await self._start_overlapped(round_no, report)
            return None
        return await self._plain_round(round_no, report)

    async def _hold_for_joiners(self, round_no: int) -> None:
        """Hold the boundary (worker paused, state served, nothing averaged) while peers that
        downloaded this replica's state have not landed it (decisions.join_hold), at most
        `timeouts.join_hold` from each one's first request. Not with wall-clock rounds: a joiner
        adopts the wall's round, which holding cannot change. Only for plausible joiners (they asked
        for JOIN_HOLD_MIN_SHARE of the state or more), one hold per peer id, and at most
        `timeouts.join_hold` of holding in all per JOIN_HOLD_WINDOW_FACTOR times that (docs/trust.md,
        "Join hold"): requests from any number of ids cannot stall the stage longer."""
        hold, sync = self.join_hold, self.sync
        if hold <= 0 or not sync.served or self.clock.epoch is not None or self.phase.current is not Phase.AVERAGING:
            return
        started, waited = time.monotonic(), set()
        window = JOIN_HOLD_WINDOW_FACTOR * hold
        self._holds = [h for h in self._holds if h[1] > started - window]
        budget = decisions.join_hold_left(self._holds, started, hold, window)
        if budget <= 0:
            logger.info("stage %d round %d: not holding for joiners (held %.0f s in the last %.0f s already)",
                        self.stage, round_no, hold, window)
            return
        self.phase.enter(Phase.HOLDING)
        try:
            while time.monotonic() - started < budget:
                records = None
                with self._reading_joiners:
                    records = await within(self.swarm.stage_records(self.stage), self.dht_timeout)
                if records is None:  # unknown: average now, as a replica that does not hold would
                    break
                waiting, settled = decisions.join_hold(dict(sync.served), records, self.state.digest,
                                                    time.monotonic(), hold, await self._connected(),
                                                    shares=sync.shares(), min_share=JOIN_HOLD_MIN_SHARE,
                                                    held_before=self._held_for, active=sync.activity(),
                                                    stall=max(JOIN_HOLD_STALL_SECONDS, hold / 2),
                                                    unannounced=max(JOIN_HOLD_STALL_SECONDS, hold / 2))
                sync.forget_served(settled)
                if not waiting:
                    break
                waited.update(waiting)
                await asyncio.sleep(JOIN_HOLD_POLL_SECONDS)
        finally:
            self.phase.enter(Phase.AVERAGING)
            if waited:
                self._holds.append((started, time.monotonic()))
                for peer in sorted(waited):  # one hold per peer id
                    self._held_for[peer] = None
                while len(self._held_for) > HELD_FOR_KEPT:
                    del self._held_for[next(iter(self._held_for))]
        if waited:
            joined = [p for p in sorted(waited) if p not in sync.served]
            held_s = time.monotonic() - started
            self.events.emit("join_hold", round=round_no, joiners=sorted(waited), joined=joined, held_s=round_ms(held_s))
            logger.info("stage %d round %d: held the boundary %.1f s for %d joiner(s) downloading its state "
                        "(%d landed)", self.stage, round_no, held_s, len(waited), len(joined))

    async def _connected(self) -> set[str] | None:
        """The peers our p2p daemon is connected to (None if it did not say)."""
        with self._listing:
            return await within(self.sync.rpc.connected(), self.dht_timeout)
        return None

    def _boundary_report(self, boundary: float) -> overlap.RoundReport:
        """The round's counters, taken with the worker paused. Its wall time and utilisation are
        filled in when the worker resumes (`_resumed`); until then round_s is the time so far."""
        worker, traffic = self.worker, self.traffic
        round_s = max(1e-9, time.monotonic() - self._mark[0])
        return overlap.RoundReport(
            samples=worker.samples + self._carried, losses=list(worker.losses), steps=worker.inner_steps,
            lr=worker.lr, lr_start=worker.cfg.lr * self.progress.round_multiplier(),  # agreed: equal everywhere
            boundary=boundary, round_s=round_s, utilisation=math.nan,
            avg_sent0=traffic.sent_by_kind["averaging"], avg_recv0=traffic.recv_by_kind["averaging"])

    def _resumed(self, report: overlap.RoundReport) -> None:
        """A round's wall time runs from one resume of the worker to the next: its compute, and the
        waits of its boundary (draining, a previous overlapped round's mean, a plain round's whole
        averaging). Utilisation: the worker's compute seconds over that time."""
        now, compute = time.monotonic(), self.worker.compute_total
        report.round_s = max(1e-9, now - self._mark[0])
        report.utilisation = min(1.0, (compute - self._mark[1]) / report.round_s)
        self._mark = (now, compute)

    async def _pseudo_gradient(self, round_no: int, report: overlap.RoundReport) -> dict[str, torch.Tensor]:
        """Δ = θ_global − θ_local to average (corrupted by the --byzantine testing aid), with the
        matchmaking patience this round's length calls for."""
        self.averager.patience = decisions.matchmaking_patience(
            self.matchmaking, report.round_s, self.clock.cfg.inner_steps > 0)
        delta = await self.worker.run(self.state.pseudo_gradient, self.worker.module)
        return corrupt(delta, self.byzantine, round_no) if self.byzantine else delta

    def _failed(self, round_no: int, e: Exception) -> RoundResult:
        """A round that raised is an incomplete round, never a dead peer. The swarm failing it
        (ROUND_FAILURES) is its reason, which the caller logs; anything else is a bug, logged here
        with its traceback and survived too: a replica that stopped on it would leave its stage short."""
        if not isinstance(e, ROUND_FAILURES):
            logger.error("stage %d round %d failed on an unexpected error", self.stage, round_no, exc_info=e)
        return RoundResult(False, f"{type(e).__name__}: {e}", (), None)

    async def _plain_round(self, round_no: int, report: overlap.RoundReport) -> RoundResult:
        worker, state = self.worker, self.state
        samples = report.samples
        try:
            delta = await self._pseudo_gradient(round_no, report)
            result = await self.averager.run_round(round_no, delta, float(samples), state.digest, state.applied_rounds)
        except Exception as e:  # the whole round: whatever it raised, the replica goes on (_failed)
            result = self._failed(round_no, e)
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
                self.averager.ledger.applied(round_no, result.group, state.applied_rounds)
            self._carried = 0
            self.clock.advance(next_round)
            await worker.run(state.commit, self.clock.current)
            await worker.run(state.copy_to, worker.module)
            if self.backups is not None and result.total_weight > 0:
                self.backups.after_round(self.peer_id, result.group, state.snapshot)
        else:
            logger.warning("stage %d round %d incomplete: %s", self.stage, round_no, result.reason)
            if await self._resync(round_no, result):
                await worker.run(state.copy_to, worker.module)
                self.averager.reset_feedback()
                self._carried = 0
            else:
                carry = True  # nobody applied this round: θ_global unchanged everywhere, keep θ_local's work
            self.clock.advance(next_round)
            await worker.run(state.commit, self.clock.current)
        self.clock.count(result.complete and result.total_weight > 0)
        if not self.leave_after_round:  # before the announce: a DHT store is not worth idle compute
            await worker.resume(carry_over=carry)
            self._resume_phase()
        self._resumed(report)
        await self.presence.announce()
        await self._after(round_no, result, report)
        return result

    async def _resync(self, round_no: int, result: RoundResult, overlapped: bool = False) -> bool:
        """StateSync.resync, in phase JOINING (announced) while it runs when our θ_global was stale.

        A stale replica can be in no group until it has the others' state, but its ONLINE record
        keeps their next matchmaking waiting for it (every ONLINE replica must register): seen when a
        joiner's download crossed its donor's boundary, the donor waited out its whole patience
        for the joiner (5 s) while refusing it the state it waited for (the donor was averaging)."""
        interrupted = self.phase.current
        stale = result.stale and self.phase.online
        if stale:
            self.phase.enter(Phase.JOINING)
            await self.presence.announce()
        try:
            return await self.sync.resync(round_no, result, overlapped=overlapped)
        finally:
            if stale and self.phase.current is Phase.JOINING:
                self.phase.enter(interrupted)  # ONLINE, announced with the round's report (or the heartbeat)

    # overlapped rounds (peer/rounds/overlap.py) ------------------------------------------------------
    async def _start_overlapped(self, round_no: int, report: overlap.RoundReport) -> None:
        """Snapshot Δ and θ_local, move the clock on, resume, and average in the background."""
        worker, state = self.worker, self.state
        delta = await self._pseudo_gradient(round_no, report)
        anchor = await worker.run(overlap.snapshot_local, worker.module)
        weight = float(report.samples)
        report.overlapped = True
        flight = overlap.InFlight(round_no, weight, anchor, worker.steps_total, report)
        self._carried = 0
        self.progress.pending = report.samples  # ours until the mean lands (peer/compute/schedule.py)
        self.clock.advance(self.clock.next_round(get_dht_time()))
        self.phase.enter(Phase.OVERLAPPED)
        await self.presence.announce()
        report.mean_wait0 = worker.mean_wait_total
        worker.expect_mean(self.overlap_steps)
        flight.task = asyncio.create_task(self._average_in_flight(flight, delta, state.digest, state.applied_rounds),
                                          name=f"overlapped-round-{self.stage}-{round_no}")
        self._in_flight = flight
        self._boundary = False  # before the resume yields: a mean that lands meanwhile leaves it SERVING
        await worker.resume()
        self._resumed(report)

    async def _average_in_flight(self, flight: overlap.InFlight, delta: dict[str, torch.Tensor], digest: str,
                                 applied_rounds: int) -> None:
        try:
            await self._land(flight, delta, digest, applied_rounds)
        finally:  # a cancelled or failed round must not leave the worker waiting for its mean
            await asyncio.shield(self.worker.mean_settled())

    async def _land(self, flight: overlap.InFlight, delta: dict[str, torch.Tensor], digest: str,
                    applied_rounds: int) -> None:
        """Average Δ, apply the mean (or re-sync), move θ_local, report the round."""
        worker, state, round = self.worker, self.state, flight.round
        try:
            result = await self.averager.run_round(round, delta, flight.weight, digest, applied_rounds)
        except Exception as e:  # the whole round: whatever it raised, the replica goes on (_failed)
            result = self._failed(round, e)
        del delta
        moved = False
        if result.complete:
            assert result.mean_delta is not None
            if result.total_weight > 0:
                outer_mult = self.progress.round_multiplier() if self.schedule_outer else 1.0
                await worker.run(self._apply_overlapped, result, outer_mult, flight)
                self.averager.ledger.applied(round, result.group, state.applied_rounds)
                moved = True
            else:
                await worker.run(state.commit, self.clock.current)
            if self.backups is not None and result.total_weight > 0:
                self.backups.after_round(self.peer_id, result.group, state.snapshot)
        else:
            logger.warning("stage %d round %d incomplete: %s", self.stage, round, result.reason)
            if await self._resync(round, result, overlapped=True):
                overlap.into_shift(flight.anchor, state.params)
                self.averager.reset_feedback()
                moved = True
            else:
                # nobody applied it: θ_global is unchanged everywhere and θ_local still holds this
                # round's work, which the next round's Δ carries (with its samples, as its weight)
                self._carried += int(flight.weight)
            await worker.run(state.commit, self.clock.current)
        if moved:
            await worker.rebase(overlap.rebase_fn(worker.module, flight.anchor, state.params, flight.steps_at_snapshot,
                                                lambda: worker.steps_total))
        await worker.mean_settled()  # before the report, which counts the time the worker waited for it
        flight.report.mean_wait_s = worker.mean_wait_total - flight.report.mean_wait0
        self.clock.count(result.complete and result.total_weight > 0)
        self._landed()
        await self.presence.announce()
        await self._after(round, result, flight.report)

    def _apply_overlapped(self, result: RoundResult, outer_mult: float, flight: overlap.InFlight) -> None:
        """On the compute thread: the outer step, the agreed position, the commit, and the shift
        θ_global_new − anchor that the rebase adds to θ_local."""
        assert result.mean_delta is not None
        self.state.apply_outer(result.mean_delta, result.total_weight, outer_mult)
        self.progress.completed_round(result.total_weight, flight.weight)
        self.state.commit(self.clock.current)
        overlap.into_shift(flight.anchor, self.state.params)

    async def _finish_in_flight(self) -> None:
        """At a boundary (worker paused): wait for the overlapped round in flight, if any, and move
        θ_local now if no inner step did it since its mean landed."""
        flight, self._in_flight = self._in_flight, None
        if flight is not None and flight.task is not None:
            await flight.task
        rebase = self.worker.take_rebase()
        if rebase is not None:
            await self.worker.run(rebase)

    async def _drop_in_flight(self) -> None:
        flight, self._in_flight = self._in_flight, None
        if flight is not None and flight.task is not None and not flight.task.done():
            flight.task.cancel()
            await asyncio.gather(flight.task, return_exceptions=True)
            self._landed()

    def _resume_phase(self) -> None:
        """The worker resumed after a plain round (or the run's last): the state is served again."""
        self._boundary = False
        if self.phase.current is Phase.AVERAGING:
            self.phase.enter(Phase.SERVING)

    def _landed(self) -> None:
        """An overlapped round's mean landed (or its averaging was dropped): SERVING mid-round,
        AVERAGING at the boundary it ended in."""
        if self.phase.current is Phase.OVERLAPPED:
            self.phase.enter(Phase.AVERAGING if self._boundary else Phase.SERVING)

    async def _after(self, round_no: int, result: RoundResult, report: overlap.RoundReport) -> None:
        self._report(round_no, result, report)
        if self.save_dir:
            await asyncio.get_running_loop().run_in_executor(None, self.save)
        if self.after_round is not None and not self.leave_after_round:
            await self.after_round(round_no, result)

    def save(self) -> None:
        if self.save_dir:
            self.state.save(Path(self.save_dir) / f"stage{self.stage}-{self.peer_id[-8:]}.safetensors",
                            {"stage": str(self.stage), "peer": self.peer_id})

    def _report(self, round_no: int, result: RoundResult, r: overlap.RoundReport) -> None:
        train_loss = sum(r.losses) / len(r.losses) if r.losses else math.nan
        sent, recv = self.traffic.sent - self._bytes_mark[0], self.traffic.recv - self._bytes_mark[1]
        self._bytes_mark = (self.traffic.sent, self.traffic.recv)
        by_kind_sent, by_kind_recv = self.traffic.sent_by_kind, self.traffic.recv_by_kind
        samples_per_s = r.samples / r.round_s
        self.events.emit("round", round=round_no, train_loss=train_loss, samples=r.samples, inner_steps=r.steps,
                         bytes_sent=sent, bytes_recv=recv, avg_bytes_sent=by_kind_sent["averaging"] - r.avg_sent0,
                         avg_bytes_recv=by_kind_recv["averaging"] - r.avg_recv0, complete=result.complete,
                         reason=result.reason, group_size=len(result.group), group=list(result.group),
                         blamed=list(result.blamed),
                         digest=self.state.digest, applied_rounds=self.state.applied_rounds,
                         samples_per_s=samples_per_s, round_s=round_ms(r.round_s),
                         averaging_s=round_ms(time.monotonic() - r.boundary), utilisation=round_ms(r.utilisation),
                         overlapped=r.overlapped, mean_wait_s=round_ms(r.mean_wait_s) if r.overlapped else None,
                         **{f"{k}_s": round_ms(result.phases[k]) if k in result.phases else None
                            for k in ("matchmaking", "exchange", "vote")},
                         lr=r.lr, lr_start=r.lr_start, swarm_samples=self.state.trained_samples,
                         rate=self.worker.rate.rate, skipped_steps=self.worker.skipped_steps,
                         uncommitted=self.worker.uncommitted, committed=self.worker.take_committed(),
                         moment_replicas=self.worker.moment_replicas)
        if result.complete:
            self.worker.set_replicas(len(result.group))
        self._samples_trained += r.samples
        self.presence.set_stats(train_loss=train_loss if r.losses else None, round_s=round_ms(r.round_s),
                                group_size=len(result.group), samples_per_s=samples_per_s,
                                samples=self._samples_trained, bytes_sent=self.traffic.sent,
                                bytes_activations=by_kind_sent["activations"],
                                bytes_gradients=by_kind_sent["gradients"],
                                bytes_averaging=by_kind_sent["averaging"], bytes_state=by_kind_sent["state"])
        logger.info("stage %d round %d: loss %s | %.1f samples/s | util %.2f | lr %.2e | sent %.2f MB recv %.2f MB "
                    "| group %d %s", self.stage, round_no, f"{train_loss:.3f}" if r.losses else "-", samples_per_s,
                    r.utilisation, r.lr, sent / 1e6, recv / 1e6, len(result.group),
                    "ok" if result.complete else f"INCOMPLETE ({result.reason})")


def corrupt(delta: dict[str, torch.Tensor], mode: str, round_no: int) -> dict[str, torch.Tensor]:
    """A hostile replica's pseudo-gradient (testing aid): `scale` sends 100 x the honest one,
    `random` Gaussian noise with 10 x its RMS, tensor by tensor (seeded by the round)."""
    if mode == "scale":
        return {n: d * 100.0 for n, d in delta.items()}
    generator = torch.Generator().manual_seed(1_000_003 * round_no + 17)
    out = {}
    for n, d in delta.items():
        rms = float(d.pow(2).mean().sqrt()) if d.numel() else 0.0
        out[n] = torch.randn(d.shape, generator=generator) * (10.0 * rms + 1e-6)
    return out


def round_ms(seconds: float) -> float:
    return round(seconds, 3)
