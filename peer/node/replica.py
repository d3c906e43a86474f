"""One stage replica inside a peer: everything that belongs to serving stage s.

A peer serves one stage at a time, except for the moment of a move: make-before-break, the
replica of the new stage is started (JOINING, state downloaded, serving, ONLINE) while the old
one still serves; the old one then finishes its current round, so its last contribution is
averaged, and only then leaves (LEAVING, handlers removed). Each replica therefore owns its own
round clock, worker, state, averager, presence, state sync, round runner and (on stage 0)
driving loop, and registers its RPC handlers under a namespace of its own stage, so the two
can coexist in one process.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Coroutine

import torch
from hivemind import DHT
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from swarmgrad.compression import parse_codec_spec
from swarmgrad.peer import decisions
from swarmgrad.peer.averaging.averager import Averager
from swarmgrad.peer.state.backup import BackupPusher
from swarmgrad.peer.net.round_tickets import RoundSigner, VerifiedTickets
from swarmgrad.peer.clock import RoundClock, resume_epoch
from swarmgrad.peer.net.deadline import within
from swarmgrad.peer.net.errors import BestEffort
from swarmgrad.peer.pipeline.driving_loop import DrivingLoop, data_seed, driver_memory_window
from swarmgrad.peer.events import EventLog
from swarmgrad.peer.manifest import Manifest
from swarmgrad.peer.model import StagedModel
from swarmgrad.peer.pipeline.stage_server import Downstream, DriverList, StageServer, refusal
from swarmgrad.peer.state.phase import ReplicaPhase
from swarmgrad.peer.state.presence import Presence
from swarmgrad.peer.rounds.runner import RoundRunner
from swarmgrad.peer.pipeline.routing import BanList
from swarmgrad.peer.net.rpc import FramedRPC, Traffic, stage_namespace
from swarmgrad.peer.compute.precision import COMPUTE_DTYPES, Precision, enable_activation_checkpointing
from swarmgrad.peer.compute.schedule import TrainingProgress
from swarmgrad.peer.state.stage_state import StageState
from swarmgrad.peer.state.sync import StateSync
from swarmgrad.peer.net.dht_view import SwarmView
from swarmgrad.peer.compute.worker import StageWorker
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.codecs import wire_codec_names
from swarmgrad.protocol.validation import RunIdentity, StageContract

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerContext:
    """What every replica of a peer shares: the run, the model, the DHT and P2P, the counters."""
    manifest: Manifest
    model: StagedModel
    dht: DHT
    p2p: P2P
    swarm: SwarmView
    traffic: Traffic
    identity: RunIdentity
    peer_id: str
    maddrs: tuple[str, ...]
    events: EventLog
    device: str
    save_dir: str | None
    data_seed: int | None
    max_rounds: int
    linger: float
    slowdown: float
    rate_clock: str
    memory: int
    max_message_bytes: int
    backup_rpc: FramedRPC
    """Client and server of the peer-level backup handlers (peer/state/backup.py)."""
    gate: Callable[[Any], Awaitable[str | None]] | None = None
    """Private runs: Admission.check, asked by every RPC server before it serves a caller."""
    checkpoints: Callable[[int], Awaitable[Any]] | None = None
    """Private runs: the coordinator's newest checkpoint of a stage (a StateSnapshot or None),
    which an empty stage restores when it is newer than any backup."""
    byzantine: str | None = None
    """TESTING AID (--byzantine): this peer's replicas send corrupted pseudo-gradients."""
    resume_round: int = 0
    """Private runs: the round of the coordinator's newest checkpoint. A swarm that starts again
    from it sets a new wall-clock epoch that many rounds back (SwarmView.epoch)."""
    pinned: bool = False
    """The peer does not rebalance (PeerOptions.rebalancing is false): its records say so."""
    compute_dtype: str = "float32"
    """What this peer's forwards compute in (peer/compute/precision.py resolve_compute_dtype)."""
    key: Any = None
    """The peer's Ed25519 key (PeerNetwork.key): a driver signs its round tickets with it."""
    backup_store: Any = None
    """The peer's BackupStore (peer/state/backup.py): its copies are announced, and a replica joining a
    stage whose current state it holds starts from that copy instead of downloading it."""

    @property
    def max_numel(self) -> int:
        return self.max_message_bytes  # no tensor has more elements than its message has bytes


class Replica:
    def __init__(self, ctx: PeerContext, stage: int, expected_rate: float = 0.0):
        self.ctx = ctx
        self.stage = stage
        self.expected_rate = expected_rate
        """Samples/s this peer expects on the stage (benchmark or estimate): announced until it has
        measured itself, so others do not see the stage as empty and pile in."""
        self.events = ctx.events.view(stage=stage)
        self.tasks: list[asyncio.Task] = []
        """Every task of this replica, started through `spawn`; `close` cancels and awaits them."""
        self.handlers: FramedRPC | None = None
        self.worker: StageWorker | None = None
        self.presence: Presence | None = None
        self.rounds: RoundRunner | None = None
        self.driving: DrivingLoop | None = None
        self.clock: RoundClock | None = None
        self.phase = ReplicaPhase()
        """JOINING / SERVING / AVERAGING / ...: written by the round runner only (peer/state/phase.py)."""
        self.state: StageState | None = None
        self.main: asyncio.Task | None = None
        """Ends when the replica's run ends: its rounds are done (or it left), or a task failed."""
        self._reading_drivers = BestEffort(f"stage {stage}: reading the drivers' records to see if they are gone",
                                           logger)

    @property
    def is_driver(self) -> bool:
        return self.stage == 0

    # start ------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Build the replica, take the stage's state, serve, go ONLINE."""
        ctx, m = self.ctx, self.ctx.manifest
        t, stage, n_stages = m.timeouts, self.stage, ctx.model.n_stages
        epoch = await ctx.swarm.epoch(origin=resume_epoch(get_dht_time(), ctx.resume_round, m.rounds.round_seconds)) \
            if m.rounds.round_seconds else None
        self.clock = clock = RoundClock(m.rounds, counts_steps=stage == 0, max_rounds=ctx.max_rounds, epoch=epoch)
        progress = TrainingProgress(m.schedule)
        is_last = stage == n_stages - 1
        module = ctx.model.build_stage(stage)
        if m.model.activation_checkpointing:
            enable_activation_checkpointing(module)
        precision = Precision(torch.device(ctx.device), COMPUTE_DTYPES[ctx.compute_dtype])
        self.worker = worker = StageWorker(module, m.inner, torch.device(ctx.device),
                                           ctx.model.loss_fn if is_last else None, clock, progress,
                                           slowdown=ctx.slowdown, rate_clock=ctx.rate_clock,
                                           commit_timeout=t.commit, precision=precision,
                                           forward_first=m.pipeline.forward_first,
                                           stale_correction=(m.pipeline.stale_correction,
                                                             m.pipeline.stale_correction_scale))
        worker.rate.rate = self.expected_rate
        self.state = state = StageState(module, m.outer)
        worker.eval_weights = lambda: state.snapshot.params if state.snapshot is not None else None
        # a request must arrive whole within a microbatch's deadline; each remote peer may hold a
        # driver's in-flight window plus its averaging and state streams open at once
        limits = dict(read_timeout=t.microbatch, max_streams_per_peer=max(8, 2 * m.pipeline.max_in_flight + 4),
                      gate=ctx.gate)
        self.handlers = rpc = FramedRPC(ctx.p2p, stage_namespace(m.run_id, stage), ctx.traffic,
                                        ctx.max_message_bytes, **limits)
        downstream = None
        if not is_last:  # a client of the next stage's handlers
            next_rpc = FramedRPC(ctx.p2p, stage_namespace(m.run_id, stage + 1), ctx.traffic, ctx.max_message_bytes,
                                 **limits)
            bans = BanList(t.ban_base, t.ban_max, on_ban=lambda peer, seconds, failures: self.events.emit(
                "banned", failed_peer=peer, seconds=seconds, failures=failures))
            downstream = Downstream(ctx.identity, next_rpc, ctx.swarm, bans,
                                    parse_codec_spec(m.pipeline.activation_codec), ctx.max_numel,
                                    gradient_codecs=wire_codec_names(m.pipeline.gradient_codec), self_id=ctx.peer_id,
                                    boundary=precision.boundary, routing=m.pipeline.routing,
                                    max_deadline_s=t.microbatch,
                                    signer=RoundSigner(ctx.key, m.run_id, m.hash) if stage == 0 and ctx.key else None)
        averager = Averager(m, stage, ctx.peer_id, state.shapes, rpc, ctx.swarm, ctx.max_numel, clock, key=ctx.key)
        self.presence = presence = Presence(ctx.swarm, peer_id=ctx.peer_id, stage=stage, manifest_hash=m.hash,
                                            maddrs=ctx.maddrs, phase=self.phase, worker=worker, state=state,
                                            clock=clock, heartbeat=t.heartbeat, memory=ctx.memory,
                                            backups=ctx.backup_store.held if ctx.backup_store else None,
                                            pinned=ctx.pinned)
        sync = StateSync(rpc=rpc, swarm=ctx.swarm, identity=ctx.identity, peer_id=ctx.peer_id, stage=stage,
                         state=state, worker=worker, clock=clock, progress=progress, events=self.events,
                         phase=self.phase, timeouts=t, max_numel=ctx.max_numel, backup_rpc=ctx.backup_rpc,
                         checkpoints=ctx.checkpoints, ledger=averager.ledger,
                         local_copy=ctx.backup_store.local_copy if ctx.backup_store else None)
        if stage == 0:
            self.driving = DrivingLoop(manifest=m, worker=worker, downstream=downstream, peer_id=ctx.peer_id,
                                       n_stages=n_stages, swarm=ctx.swarm, clock=clock, events=self.events,
                                       seed=data_seed(m, ctx.peer_id, ctx.data_seed), spawn=self.spawn,
                                       report_stats=presence.set_stats,
                                       memory_window=driver_memory_window(m, ctx.memory, ctx.model),
                                       save_dir=ctx.save_dir, token_carry=ctx.model.token_carry)
        self.rounds = RoundRunner(stage=stage, clock=clock, worker=worker, state=state, averager=averager,
                                  sync=sync, presence=presence, phase=self.phase, swarm=ctx.swarm, progress=progress,
                                  traffic=ctx.traffic, events=self.events, schedule_outer=m.schedule.outer,
                                  save_dir=ctx.save_dir, peer_id=ctx.peer_id, join_hold=t.join_hold,
                                  dht_timeout=t.dht, matchmaking=t.matchmaking,
                                  after_round=self.driving.after_round if self.driving else None,
                                  byzantine=ctx.byzantine, overlap=m.rounds.overlap,
                                  overlap_steps=m.rounds.overlap_steps,
                                  backups=BackupPusher(ctx.backup_rpc, ctx.swarm, ctx.identity, stage,
                                                       m.averaging.backup_every, t.state_download, self.spawn,
                                                       link_share=m.averaging.backup_link_share,
                                                       emit=self.events.emit))

        await presence.announce()
        await sync.join()
        if self.driving is not None:
            self.driving.evaluate_at_start = not sync.from_replica
        await worker.run(state.commit, clock.current)
        contract = StageContract(stage=stage, n_stages=n_stages, max_batch=m.inner.microbatch_size,
                                 input_spec=lambda b: ctx.model.input_spec(stage, b),
                                 targets_spec=ctx.model.targets_spec,
                                 vocab_size=m.model.vocab_size if m.model.kind in ("gpt", "llama") else None)
        if stage > 0:
            server = StageServer(ctx.identity, contract, worker, downstream,
                                 parse_codec_spec(m.pipeline.gradient_codec), ctx.max_numel, clock,
                                 activation_codecs=wire_codec_names(m.pipeline.activation_codec),
                                 max_deadline_s=t.microbatch, drivers=DriverList(ctx.swarm, t.heartbeat).listed,
                                 lookahead=m.pipeline.lookahead, hold_s=t.between_rounds,
                                 boundary=precision.boundary,
                                 tickets=VerifiedTickets(m.run_id, m.hash),
                                 token_carry=ctx.model.token_carry)
            await rpc.add_handler("forward", pb.ForwardRequest, server.handle, refusal(pb.ForwardResponse))
            await rpc.add_handler("commit", pb.CommitRequest, server.commit, refusal(pb.CommitResponse))
        await rpc.add_handler("average", pb.AverageRequest, averager.reducer.handle, refusal(pb.AverageResponse))
        await rpc.add_handler("state", pb.StateRequest, sync.handle, refusal(pb.StateResponse))
        self.rounds.serve()
        await presence.announce()
        self.events.emit("online", round=clock.current, digest=state.digest, epoch=clock.epoch)
        logger.info("peer %s serves stage %d of %d", ctx.peer_id[-8:], stage, n_stages)

    # run --------------------------------------------------------------------------------------
    def launch(self, stop: asyncio.Event) -> asyncio.Task:
        """Start the replica's tasks; returns `main`, which ends when its run ends. Idempotent: a
        moving peer launches its new replica at once (make-before-break) and its serve loop asks
        again; a second round runner on one replica would average and step every round twice."""
        if self.main is not None:
            return self.main
        assert self.presence is not None and self.rounds is not None
        self.spawn(self.presence.run(), "heartbeat")
        rounds = self.spawn(self.rounds.run(stop), "rounds")
        watched = [rounds]
        if self.driving is not None:
            watched.append(self.spawn(self.driving.run(), "driver"))
        elif self.ctx.max_rounds:
            watched.append(self.spawn(self._until_no_drivers(), "orphan-watch"))

        async def main() -> bool:
            """True if the rounds ended (the run is over or the replica left), False otherwise."""
            done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            return rounds in done

        self.main = asyncio.create_task(main(), name=f"replica-{self.stage}")
        return self.main

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        """Run `coro` as a task this replica owns (`close` cancels and awaits it). The one way its
        pieces start tasks: the driving loop's evaluations, the backup pushes."""
        task = asyncio.create_task(coro, name=f"{name}-{self.stage}")
        self.tasks.append(task)
        return task

    async def finish(self, stop: asyncio.Event) -> None:
        """The last round is done: drivers evaluate a final time; others keep serving them."""
        if self.driving is not None:
            await self.driving.finish()
            return
        deadline = time.monotonic() + self.ctx.linger
        while not stop.is_set() and time.monotonic() < deadline:
            if await self._drivers_gone():
                return
            try:
                await within(stop.wait(), self.ctx.manifest.timeouts.heartbeat)
            except asyncio.TimeoutError:
                pass

    async def _drivers_gone(self) -> bool:
        """Whether every driver is gone (decisions.drivers_gone); False when the records could not
        be read: a replica leaves on evidence, not on a DHT hiccup."""
        with self._reading_drivers:
            return decisions.drivers_gone(await self.ctx.swarm.stage_records(0))
        return False

    async def _until_no_drivers(self) -> None:
        """In a bounded run (max_rounds), a later stage whose drivers are all gone for `linger`
        seconds will never see another round's work: return, so the peer stops."""
        last_seen = time.monotonic()
        while time.monotonic() - last_seen < self.ctx.linger:
            await asyncio.sleep(self.ctx.manifest.timeouts.heartbeat)
            if not await self._drivers_gone():
                last_seen = time.monotonic()
        logger.info("no driver online for %.0fs; leaving", self.ctx.linger)

    # moves --------------------------------------------------------------------------------------
    async def leave_after_round(self) -> None:
        """Announce the move and stop after the current round (its contribution is averaged)."""
        assert self.rounds is not None and self.presence is not None
        self.rounds.leave_after_round = True
        if self.worker is not None:
            await self.worker.leave()
        self.presence.set(moving=True)
        await self.presence.announce()

    # stop ---------------------------------------------------------------------------------------
    async def close(self) -> None:
        """Announce LEAVING, cancel and await every task, remove the handlers, save."""
        if self.driving is not None:
            self.driving.stop_training.set()
        if self.worker is not None:  # requests held for a resume are refused now, not cut off below
            await self.worker.leave()
        # no runner: start failed while building the pieces, before any record was stored
        if self.presence is not None and self.rounds is not None:
            self.rounds.leave()
            announced = False
            try:
                announced = await within(self.presence.announce(), self.ctx.manifest.timeouts.shutdown / 3)
            except asyncio.TimeoutError:
                t = self.ctx.manifest.timeouts
                # typical when the peers it would store to are stopping too: nothing is lost
                logger.info("could not announce that it is leaving within %.1f s (timeouts.shutdown / 3): "
                            "the others see it gone when its record expires (timeouts.announce_ttl, %.0f s)",
                            t.shutdown / 3, t.announce_ttl)
            self.events.emit("leaving", announced=bool(announced))
        if self.driving is not None:  # its shard goes back at once, not when the lease expires
            await self.driving.release()
        tasks = self.tasks + ([self.main] if self.main is not None else [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.handlers is not None:
            await self.handlers.remove_handlers()
        if self.worker is not None:
            self.worker.close()
            if self.rounds is not None:
                self.rounds.save()
