"""The peer daemon's life cycle: one process, one device, one stage replica at a time.

`Peer` is built from its collaborators (manifest, model, a started hivemind DHT), builds the
pieces of a replica — round clock, worker, state, averager, presence, state sync, round runner,
and on stage 0 the driving loop — and owns the lifetime of everything it starts: RPC handlers,
the compute thread, the heartbeat, the round loop and the driver. Each concern lives in its own
module; this one only wires them, runs them and shuts them down. `run()` returns when the run
is over or `stop` is set, after announcing LEAVING and removing its handlers; the caller shuts
the DHT down.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import torch
from hivemind import DHT

from swarmgrad.compression import parse_codec_spec
from swarmgrad.peer import policy
from swarmgrad.peer.averaging import Averager
from swarmgrad.peer.balance import choose_stage
from swarmgrad.peer.clock import RoundClock
from swarmgrad.peer.driving import DrivingLoop, data_seed
from swarmgrad.peer.events import EventLog
from swarmgrad.peer.manifest import Manifest
from swarmgrad.peer.model import StagedModel
from swarmgrad.peer.pipeline import Downstream, StageServer, refusal
from swarmgrad.peer.presence import Presence
from swarmgrad.peer.rounds import RoundRunner
from swarmgrad.peer.routing import BanList
from swarmgrad.peer.rpc import FramedRPC, Traffic
from swarmgrad.peer.schedule import TrainingProgress
from swarmgrad.peer.state import StageState
from swarmgrad.peer.state_sync import StateSync
from swarmgrad.peer.swarm import LEAVING, ONLINE, SwarmView
from swarmgrad.peer.worker import StageWorker
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.codecs import wire_codec_names
from swarmgrad.protocol.validation import RunIdentity, StageContract

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PeerOptions:
    stage: int | None = None
    """Stage to serve; None picks the stage with the fewest replicas."""
    device: str = "cpu"
    events_path: str | None = None
    save_dir: str | None = None
    """Write the stage's θ_global (safetensors) here after every round and at exit."""
    data_seed: int | None = None
    """Seed of this driver's data shard; None derives it from the manifest seed and the peer id."""
    max_rounds: int | None = None
    """Overrides rounds.max_rounds."""
    linger: float = 60.0
    """After its last round, a non-driver keeps serving (drivers evaluate) until no driver is
    online or this many seconds passed."""
    slowdown: float = 1.0
    """Testing aid: compute takes this many times longer (a sleep proportional to measured compute)."""
    max_memory: int | None = None
    """Bytes this peer offers for a stage; None: what the device has."""
    rebalance: str = "on"
    """"on": move between stages when the placement policy says it pays; "off": stay."""


class Peer:
    def __init__(self, manifest: Manifest, model: StagedModel, dht: DHT, options: PeerOptions):
        self.m = manifest
        self.model = model
        self.dht = dht
        self.opt = options
        self.peer_id = str(dht.peer_id)
        self.identity = RunIdentity(manifest.run_id, manifest.hash)
        self.n_stages = model.n_stages
        self.traffic = Traffic()
        self.swarm = SwarmView(dht, manifest.run_id, manifest.hash, self.n_stages, manifest.timeouts.dht,
                               manifest.timeouts.announce_ttl)
        self.max_message_bytes = int(manifest.pipeline.max_message_mb * 2**20)
        self.max_numel = self.max_message_bytes  # no tensor has more elements than its message has bytes
        self.events = EventLog(None)
        self._tasks: list[asyncio.Task] = []
        self._handlers: FramedRPC | None = None
        self._worker: StageWorker | None = None
        self._presence: Presence | None = None
        self._rounds: RoundRunner | None = None
        self._driving: DrivingLoop | None = None
        self._clock: RoundClock | None = None

    @property
    def max_rounds(self) -> int:
        """Rounds to run (0: until stopped): --max-rounds if given, else rounds.max_rounds."""
        return self.opt.max_rounds if self.opt.max_rounds is not None else self.m.rounds.max_rounds

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await self._start()
            await self._main(stop)
        finally:
            await self._shutdown()

    async def _start(self) -> None:
        """Build the replica, take the stage's state, serve, go ONLINE."""
        m, t = self.m, self.m.timeouts
        p2p = await self.dht.replicate_p2p()
        stage = self.opt.stage if self.opt.stage is not None else choose_stage(
            await self.swarm.swarm(), self.n_stages, exclude=self.peer_id)
        if not 0 <= stage < self.n_stages:
            raise ValueError(f"--stage {stage} is outside 0..{self.n_stages - 1}")
        self.stage = stage
        # get_visible_maddrs blocks on the DHT process: ask once, while it is surely alive
        maddrs = tuple(str(a) for a in self.dht.get_visible_maddrs())
        self.events = EventLog(self.opt.events_path, peer=self.peer_id, stage=stage)
        self.events.emit("started", maddrs=list(maddrs), run_id=m.run_id, manifest_hash=m.hash)
        logger.info("peer %s serves stage %d of %d", self.peer_id[-8:], stage, self.n_stages)

        epoch = await self.swarm.epoch() if m.rounds.round_seconds else None
        self._clock = clock = RoundClock(m.rounds, counts_steps=stage == 0, max_rounds=self.max_rounds, epoch=epoch)
        progress = TrainingProgress(m.schedule)
        is_last = stage == self.n_stages - 1
        module = self.model.build_stage(stage)
        self._worker = worker = StageWorker(module, m.inner, torch.device(self.opt.device),
                                            self.model.loss_fn if is_last else None, clock, progress)
        state = StageState(module, m.outer)
        # a request must arrive whole within a microbatch's deadline; each remote peer may hold a
        # driver's in-flight window plus its averaging and state streams open at once
        self._handlers = rpc = FramedRPC(p2p, f"swarmgrad/{m.run_id}", self.traffic, self.max_message_bytes,
                                         read_timeout=t.microbatch,
                                         max_streams_per_peer=max(8, 2 * m.pipeline.max_in_flight + 4))
        bans = BanList(t.ban_base, t.ban_max)
        downstream = None if is_last else Downstream(self.identity, rpc, self.swarm, bans,
                                                     parse_codec_spec(m.pipeline.activation_codec), self.max_numel,
                                                     gradient_codecs=wire_codec_names(m.pipeline.gradient_codec))
        averager = Averager(m, stage, self.peer_id, state.shapes, rpc, self.swarm, self.max_numel, clock)
        self._presence = presence = Presence(self.swarm, peer_id=self.peer_id, stage=stage, manifest_hash=m.hash,
                                             maddrs=maddrs, worker=worker, state=state, clock=clock,
                                             heartbeat=t.heartbeat)
        sync = StateSync(rpc=rpc, swarm=self.swarm, identity=self.identity, peer_id=self.peer_id, stage=stage,
                         state=state, worker=worker, clock=clock, progress=progress, events=self.events,
                         timeouts=t, max_numel=self.max_numel)
        if stage == 0:
            self._driving = DrivingLoop(manifest=m, worker=worker, downstream=downstream, peer_id=self.peer_id,
                                        n_stages=self.n_stages, swarm=self.swarm, clock=clock, events=self.events,
                                        seed=data_seed(m, self.peer_id, self.opt.data_seed), tasks=self._tasks)
        self._rounds = RoundRunner(stage=stage, clock=clock, worker=worker, state=state, averager=averager,
                                   sync=sync, presence=presence, swarm=self.swarm, progress=progress,
                                   traffic=self.traffic, events=self.events, schedule_outer=m.schedule.outer,
                                   save_dir=self.opt.save_dir, peer_id=self.peer_id,
                                   after_round=self._driving.after_round if self._driving else None)

        await presence.announce()
        await sync.join()
        await worker.run(state.commit, clock.current)
        contract = StageContract(stage=stage, n_stages=self.n_stages, max_batch=m.inner.microbatch_size,
                                 input_spec=lambda b: self.model.input_spec(stage, b),
                                 targets_spec=self.model.targets_spec,
                                 vocab_size=m.model.vocab_size if m.model.kind == "gpt" else None)
        if stage > 0:
            server = StageServer(self.identity, contract, worker, downstream,
                                 parse_codec_spec(m.pipeline.gradient_codec), self.max_numel, clock,
                                 activation_codecs=wire_codec_names(m.pipeline.activation_codec),
                                 max_deadline_s=t.microbatch)
            await rpc.add_handler("forward", pb.ForwardRequest, server.handle, refusal(pb.ForwardResponse))
        await rpc.add_handler("average", pb.AverageRequest, averager.handle, refusal(pb.AverageResponse))
        await rpc.add_handler("state", pb.StateRequest, sync.handle, refusal(pb.StateResponse))
        sync.serving = True
        await presence.announce(ONLINE)
        self.events.emit("online", round=clock.current, digest=state.digest)

    async def _main(self, stop: asyncio.Event) -> None:
        assert self._presence is not None and self._rounds is not None
        self._own(self._presence.run(), "heartbeat")
        rounds = self._own(self._rounds.run(stop), "rounds")
        watched = [rounds]
        if self._driving is not None:
            watched.append(self._own(self._driving.run(), "driver"))
        elif self.max_rounds:
            watched.append(self._own(self._until_no_drivers(), "orphan-watch"))
        stopper = asyncio.create_task(stop.wait())
        try:
            done, _ = await asyncio.wait([*watched, stopper], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
        for task in done:
            if task is not stopper and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        if rounds in done and not stop.is_set():
            await self._finish(stop)

    def _own(self, coro, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._tasks.append(task)
        return task

    async def _finish(self, stop: asyncio.Event) -> None:
        """The last round is done: drivers evaluate a final time; others keep serving them."""
        if self._driving is not None:
            await self._driving.finish()
            return
        deadline = time.monotonic() + self.opt.linger
        while not stop.is_set() and time.monotonic() < deadline:
            if await self._drivers_gone():
                return
            try:
                await asyncio.wait_for(stop.wait(), self.m.timeouts.heartbeat)
            except asyncio.TimeoutError:
                pass

    async def _drivers_gone(self) -> bool:
        try:
            return policy.drivers_gone(await self.swarm.stage_records(0))
        except Exception as e:
            logger.info("could not read the drivers' records: %s: %s", type(e).__name__, e)
            return False

    async def _until_no_drivers(self) -> None:
        """In a bounded run (max_rounds), a later stage whose drivers are all gone for `linger`
        seconds will never see another round's work: return, so the peer stops."""
        last_seen = time.monotonic()
        while time.monotonic() - last_seen < self.opt.linger:
            await asyncio.sleep(self.m.timeouts.heartbeat)
            if not await self._drivers_gone():
                last_seen = time.monotonic()
        logger.info("no driver online for %.0fs; leaving", self.opt.linger)

    async def _shutdown(self) -> None:
        if self._driving is not None:
            self._driving.stop_training.set()
        if self._presence is not None:
            try:
                await asyncio.wait_for(self._presence.announce(LEAVING), self.m.timeouts.shutdown / 3)
            except asyncio.TimeoutError:
                logger.info("could not announce LEAVING within timeouts.shutdown / 3")
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._handlers is not None:
            await self._handlers.remove_handlers()
        if self._worker is not None:
            self._worker.close()
            if self._rounds is not None:
                self._rounds.save()
        clock = self._clock
        self.events.emit("stopped", rounds=clock.rounds_done if clock else 0, bytes_sent=self.traffic.sent,
                         bytes_recv=self.traffic.recv)
        self.events.close()
