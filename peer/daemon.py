"""The peer daemon: one process, one device, one stage replica at a time.

`Peer` is built from its collaborators (manifest, model, a started hivemind DHT) and owns the
lifetime of everything it starts: RPC handlers, the compute thread, the heartbeat, the round
loop and, on stage 0, the driver. `run()` returns when the run is over or `stop` is set, after
announcing LEAVING and removing its handlers; the caller shuts the DHT down.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from hivemind import DHT
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from swarmgrad.compression import parse_codec_spec
from swarmgrad.peer.averaging import Averager, RoundResult
from swarmgrad.peer.balance import choose_stage
from swarmgrad.peer.data import MicrobatchStream, bits_per_byte, load_corpora, validation_batches
from swarmgrad.peer.driver import Driver
from swarmgrad.peer.events import EventLog
from swarmgrad.peer.manifest import Manifest
from swarmgrad.peer.model import StagedModel
from swarmgrad.peer.pipeline import Downstream, StageServer, refusal, wait_for_pipeline
from swarmgrad.peer.routing import BanList
from swarmgrad.peer.rpc import FramedRPC, RPCFailed, Traffic
from swarmgrad.peer.state import StageState
from swarmgrad.peer.swarm import JOINING, LEAVING, ONLINE, PeerRecord, SwarmView
from swarmgrad.peer.worker import StageWorker
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.framing import ProtocolError
from swarmgrad.peer.state_sync import fetch_state, state_response
from swarmgrad.protocol.validation import RunIdentity, StageContract, check_envelope

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
        self.state_name = JOINING
        self.events = EventLog(None)
        self.rounds_done = 0
        self._tasks: list[asyncio.Task] = []
        self._bytes_mark = (0, 0)
        self._round_started = time.monotonic()
        self.driver: Driver | None = None
        self._evaluating = False
        self._seen_round = -1
        """The latest round a microbatch has announced to this replica."""
        self._stop_training = asyncio.Event()
        """Set after the last round: drivers stop sending training microbatches (evaluation goes on)."""
        self._maddrs: tuple[str, ...] = ()

    @property
    def max_rounds(self) -> int:
        """Rounds to run (0: until stopped): --max-rounds if given, else rounds.max_rounds."""
        return self.opt.max_rounds if self.opt.max_rounds is not None else self.m.rounds.max_rounds

    # lifecycle --------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        t = self.m.timeouts
        self.p2p = await self.dht.replicate_p2p()
        self.stage = self.opt.stage if self.opt.stage is not None else choose_stage(
            await self.swarm.swarm(), self.n_stages, exclude=self.peer_id)
        if not 0 <= self.stage < self.n_stages:
            raise ValueError(f"--stage {self.stage} is outside 0..{self.n_stages - 1}")
        # get_visible_maddrs blocks on the DHT process: ask once, while it is surely alive
        self._maddrs = tuple(str(a) for a in self.dht.get_visible_maddrs())
        self.events = EventLog(self.opt.events_path, peer=self.peer_id, stage=self.stage)
        self.events.emit("started", maddrs=list(self._maddrs),
                         run_id=self.m.run_id, manifest_hash=self.m.hash)
        logger.info("peer %s serves stage %d of %d", self.peer_id[-8:], self.stage, self.n_stages)
        self.epoch = await self.swarm.epoch() if self.m.rounds.round_seconds else None
        is_last = self.stage == self.n_stages - 1
        module = self.model.build_stage(self.stage)
        self.worker = StageWorker(module, self.m.inner, torch.device(self.opt.device),
                                  self.model.loss_fn if is_last else None)
        self.worker.steps_per_round = self.m.rounds.inner_steps if self.stage == 0 else 0
        self.state = StageState(module, self.m.outer)
        self.rpc = FramedRPC(self.p2p, f"swarmgrad/{self.m.run_id}", self.traffic, self.max_message_bytes)
        self.bans = BanList(t.ban_base, t.ban_max)
        act = parse_codec_spec(self.m.pipeline.activation_codec)
        self.downstream = None if is_last else Downstream(self.identity, self.rpc, self.swarm, self.bans, act,
                                                          self.max_numel)
        self.averager = Averager(self.m, self.stage, self.peer_id, self.state.shapes, self.rpc, self.swarm,
                                 self.max_numel)
        try:
            await self._announce()
            await self._join()
            self.averager.current_round = self.state.round
            await self._serve()
            self.state_name = ONLINE
            await self._announce()
            self.events.emit("online", round=self.state.round, digest=self.state.digest)
            await self._main(stop)
        finally:
            await self._shutdown()

    async def _join(self) -> None:
        """Take the stage's current state from a live replica, or start from the seed if none.

        A replica that is averaging refuses (NOT_READY): a joiner must not start from the state a
        round is about to replace (hivemind #445), so it retries until the round is over.
        """
        deadline = time.monotonic() + self.m.timeouts.state_download
        while True:
            donors = [r for r in await self.swarm.stage_records(self.stage)
                      if r.state == ONLINE and r.peer_id != self.peer_id]
            if not donors:
                self.events.emit("state_initialised", round=self.state.round, digest=self.state.digest)
                break
            for donor in sorted(donors, key=lambda r: (-r.applied_rounds, r.peer_id)):
                if await self._download_state(donor.peer_id):
                    self.state.copy_to(self.worker.module)
                    self.events.emit("state_loaded", source=donor.peer_id, round=self.state.round,
                                     applied_rounds=self.state.applied_rounds, digest=self.state.digest)
                    break
            else:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"could not download stage {self.stage} state from {len(donors)} replicas "
                                       f"within timeouts.state_download")
                await asyncio.sleep(0.5)
                continue
            break
        if self.epoch is not None:
            self.state.round = max(self.state.round, self._clock_round(get_dht_time()))

    async def _serve(self) -> None:
        contract = StageContract(stage=self.stage, n_stages=self.n_stages, max_batch=self.m.inner.microbatch_size,
                                 input_spec=lambda b: self.model.input_spec(self.stage, b),
                                 targets_spec=self.model.targets_spec,
                                 vocab_size=self.m.model.vocab_size if self.m.model.kind == "gpt" else None)
        grad_codec = parse_codec_spec(self.m.pipeline.gradient_codec)
        if self.stage > 0:
            self.server = StageServer(self.identity, contract, self.worker, self.downstream, grad_codec, self.max_numel,
                                      self._round_ahead)
            await self.rpc.add_handler("forward", pb.ForwardRequest, self.server.handle, refusal(pb.ForwardResponse))
        await self.rpc.add_handler("average", pb.AverageRequest, self.averager.handle, refusal(pb.AverageResponse))
        await self.rpc.add_handler("state", pb.StateRequest, self._handle_state, refusal(pb.StateResponse))

    async def _main(self, stop: asyncio.Event) -> None:
        self._round_started = time.monotonic()
        self._tasks.append(asyncio.create_task(self._heartbeat(), name="heartbeat"))
        rounds = asyncio.create_task(self._round_loop(stop), name="rounds")
        self._tasks.append(rounds)
        watched = [rounds]
        if self.stage == 0:
            driving = asyncio.create_task(self._drive(stop), name="driver")
            self._tasks.append(driving)
            watched.append(driving)
        elif self.max_rounds:
            orphan = asyncio.create_task(self._until_no_drivers(), name="orphan-watch")
            self._tasks.append(orphan)
            watched.append(orphan)
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

    async def _finish(self, stop: asyncio.Event) -> None:
        """The last round is done: drivers evaluate a final time; others keep serving them."""
        if self.driver is not None:
            self._stop_training.set()
            val = await self.driver.evaluate(self._val_batches)
            self._emit_eval(val, final=True)
            return
        deadline = time.monotonic() + self.opt.linger
        while not stop.is_set() and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                drivers = await self.swarm.stage_records(0)
                if not any(r.state == ONLINE for r in drivers):
                    return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.m.timeouts.heartbeat)

    async def _until_no_drivers(self) -> None:
        """In a bounded run (max_rounds), a later stage whose drivers are all gone for `linger`
        seconds will never see another round's work: return, so the peer stops."""
        last_seen = time.monotonic()
        while time.monotonic() - last_seen < self.opt.linger:
            await asyncio.sleep(self.m.timeouts.heartbeat)
            with contextlib.suppress(Exception):
                if any(r.state == ONLINE for r in await self.swarm.stage_records(0)):
                    last_seen = time.monotonic()
        logger.info("no driver online for %.0fs; leaving", self.opt.linger)

    async def _shutdown(self) -> None:
        self.state_name = LEAVING
        self._stop_training.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._announce(), self.m.timeouts.shutdown / 3)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if hasattr(self, "rpc"):
            await self.rpc.remove_handlers()
        if hasattr(self, "worker"):
            self.worker.close()
            self._save()
        self.events.emit("stopped", rounds=self.rounds_done, bytes_sent=self.traffic.sent,
                         bytes_recv=self.traffic.recv)
        self.events.close()

    # swarm records ------------------------------------------------------------------------------
    def _record(self) -> PeerRecord:
        return PeerRecord(peer_id=self.peer_id, stage=self.stage, state=self.state_name,
                          throughput=self.worker.rate.rate, round=self.state.round,
                          applied_rounds=self.state.applied_rounds, digest=self.state.digest,
                          manifest_hash=self.m.hash, driver=self.stage == 0,
                          maddrs=self._maddrs[:4])

    async def _announce(self) -> None:
        try:
            await self.swarm.announce(self._record())
        except Exception as e:
            logger.warning("announce failed: %s", e)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.m.timeouts.heartbeat)
            await self._announce()
            if self.epoch is not None:  # keep the run's clock alive as long as anyone runs
                with contextlib.suppress(Exception):
                    await self.swarm.refresh_epoch(self.epoch)

    # rounds ---------------------------------------------------------------------------------------
    def _clock_round(self, now: float) -> int:
        assert self.epoch is not None
        return max(0, math.floor((now - self.epoch) / self.m.rounds.round_seconds))

    def _round_ahead(self, round: int) -> bool:
        """A microbatch of a later round arrived: end ours (the caller answers NOT_READY meanwhile)."""
        if round <= self.state.round:
            return False
        self._seen_round = max(self._seen_round, round)
        self.worker.step_event.set()  # wakes _boundary
        return True

    async def _drivers_past(self, round: int) -> bool:
        with contextlib.suppress(Exception):
            drivers = [r for r in await self.swarm.stage_records(0) if r.state == ONLINE]
            return bool(drivers) and min(r.round for r in drivers) > round
        return False

    async def _boundary(self, round: int, stop: asyncio.Event) -> None:
        """Wait until round `round` ends, whichever comes first: its wall-clock end; on a driver, H inner
        steps; on a later stage, work (or records) from drivers already past it. Later stages do not
        count H themselves: how many microbatches reach a replica depends on routing, so their rounds
        follow the drivers' (each microbatch carries its driver's round)."""
        H = self.m.rounds.inner_steps
        while not stop.is_set():
            if self._seen_round > round:
                return
            if H and self.stage == 0 and self.worker.inner_steps >= H:
                return
            wait = 1.0
            if self.epoch is not None:
                remaining = self.epoch + (round + 1) * self.m.rounds.round_seconds - get_dht_time()
                if remaining <= 0:
                    return
                wait = min(wait, remaining)
            elif self.stage > 0 and await self._drivers_past(round):
                return
            self.worker.step_event.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.worker.step_event.wait(), wait)

    async def _round_loop(self, stop: asyncio.Event) -> None:
        """Run rounds until max_rounds have been counted. Counting starts with the first round in
        which the stage group trained at all: a swarm still assembling runs empty rounds (no-ops)
        that must not use up the run's budget."""
        counting = False
        while not stop.is_set():
            round = self.state.round
            await self._boundary(round, stop)
            if stop.is_set():
                return
            result = await self._run_round(round)
            counting = counting or (result.complete and result.total_weight > 0)
            if counting:
                self.rounds_done += 1
            if self.max_rounds and self.rounds_done >= self.max_rounds:
                # no more rounds: the worker must not pause itself after H more inner steps, or the
                # drivers' final evaluation would wait on a round that never comes
                self.worker.steps_per_round = 0
                if self.worker.paused:
                    await self.worker.resume()
                return

    async def _run_round(self, round: int) -> RoundResult:
        started = time.monotonic()
        await self.worker.pause()
        worker, state = self.worker, self.state
        samples, losses, steps = worker.samples, list(worker.losses), worker.inner_steps
        sent0, recv0 = self.traffic.sent, self.traffic.recv
        delta = await worker.run(state.pseudo_gradient, worker.module)
        result = await self.averager.run_round(round, delta, float(samples), state.digest, state.applied_rounds)
        next_round = max(round + 1, self._seen_round)
        if self.epoch is not None:
            next_round = max(next_round, self._clock_round(get_dht_time()))
        carry = False
        if result.complete:
            assert result.mean_delta is not None
            # A round in which the whole group trained on nothing is a no-op: an outer step on a zero
            # pseudo-gradient would still move θ_global by momentum alone, on no evidence.
            if result.total_weight > 0:
                await worker.run(state.apply_outer, result.mean_delta)
            state.round = next_round
            await worker.run(state.commit)
            await worker.run(state.copy_to, worker.module)
        else:
            logger.warning("stage %d round %d incomplete: %s", self.stage, round, result.reason)
            if await self._resync(round, result):
                await worker.run(state.copy_to, worker.module)
                self.averager.reset_feedback()
            else:
                carry = True  # nobody applied this round: θ_global unchanged everywhere, keep θ_local's work
                state.round = next_round
                await worker.run(state.commit)
        self.averager.current_round = state.round
        await self._announce()
        await worker.resume(carry_over=carry)
        self._report_round(round, result, samples, losses, steps, started, sent0, recv0)
        if self.opt.save_dir:
            self._save()
        last = bool(self.max_rounds) and self.rounds_done + 1 >= self.max_rounds  # the driver evaluates at the end anyway
        if self.stage == 0 and self.driver is not None and self.driver.running and self.m.data.eval_every and not last \
                and (self.rounds_done + 1) % self.m.data.eval_every == 0 and not self._evaluating:
            self._tasks.append(asyncio.create_task(self._eval_now(), name="eval"))
        return result

    def _report_round(self, round: int, result: RoundResult, samples: int, losses: list[float], steps: int,
                      started: float, sent0: int, recv0: int) -> None:
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
                         samples_per_s=samples / elapsed,
                         averaging_s=round_ms(time.monotonic() - started))
        logger.info("stage %d round %d: loss %s | %.1f samples/s | sent %.2f MB recv %.2f MB | group %d %s",
                    self.stage, round, f"{train_loss:.3f}" if losses else "-",
                    samples / elapsed, sent / 1e6, recv / 1e6, len(result.group),
                    "ok" if result.complete else f"INCOMPLETE ({result.reason})")

    async def _resync(self, round: int, result: RoundResult) -> bool:
        """After a failed round: adopt the state of a replica that completed it, if any did. Others
        may still be finishing the round, so wait until every other member has announced a later
        round (then, if none applied it, nobody did) or as long as a round may take."""
        deadline = time.monotonic() + self.m.timeouts.matchmaking + self.m.timeouts.allreduce
        others = set(result.group) - {self.peer_id}
        while time.monotonic() < deadline:
            records = await self.swarm.stage_records(self.stage)
            newer = [r for r in records if r.peer_id != self.peer_id and r.state == ONLINE and (
                r.applied_rounds > self.state.applied_rounds or (result.stale and r.peer_id in result.group))]
            for donor in sorted(newer, key=lambda r: (-r.applied_rounds, r.peer_id)):
                if await self._download_state(donor.peer_id):
                    self.events.emit("resynced", source=donor.peer_id, round=self.state.round,
                                     applied_rounds=self.state.applied_rounds, digest=self.state.digest)
                    return True
            finished = {r.peer_id for r in records if r.peer_id in others and r.round > round}
            if not newer and finished == others:
                return False
            await asyncio.sleep(0.5)
        return False

    # state transfer -------------------------------------------------------------------------------
    async def _handle_state(self, request: pb.StateRequest, caller: PeerID) -> pb.StateResponse:
        check_envelope(request.envelope, self.identity, [self.stage])
        snap = self.state.snapshot
        if snap is None or self.state_name != ONLINE:
            raise ProtocolError(pb.NOT_READY, "this replica has no committed state to share yet")
        if self.worker.paused:
            raise ProtocolError(pb.NOT_READY, "this replica is averaging; its state is about to change")
        return state_response(snap)

    async def _download_state(self, peer: str) -> bool:
        try:
            snap = await fetch_state(self.rpc, peer, self.identity, self.stage, self.state.shapes, self.max_numel,
                                     self.m.timeouts.state_download)
        except (RPCFailed, ProtocolError) as e:
            logger.info("state download from %s failed: %s", peer[-8:], e)
            return False
        self.state.load(snap.params, snap.momentum, snap.round, snap.applied_rounds)
        return True

    # driving ----------------------------------------------------------------------------------------
    async def _drive(self, stop: asyncio.Event) -> None:
        d = self.m.data
        train, val = await asyncio.get_running_loop().run_in_executor(
            None, lambda: load_corpora(d.source, d.paths, d.val_fraction, d.max_bytes or None))
        seed = self.opt.data_seed if self.opt.data_seed is not None else \
            int.from_bytes(PeerID.from_base58(self.peer_id).to_bytes()[-4:], "big") ^ self.m.seed
        stream = MicrobatchStream(train, self.m.model.seq_len, self.m.inner.microbatch_size, seed)
        self._val_batches = validation_batches(val, self.m.model.seq_len, self.m.inner.microbatch_size,
                                               d.eval_batches, seed=self.m.seed)
        self.driver = Driver(self.m, self.worker, self.downstream, self.peer_id, self.n_stages, stream,
                             self.events.emit, lambda: self.state.round)
        if self.n_stages > 1 and not await wait_for_pipeline(self.swarm, self.n_stages, self.m.timeouts.state_download):
            raise RuntimeError("no replica serves some stage; the pipeline is incomplete")
        await self._eval_now()
        await self.driver.run(self._stop_training)

    async def _eval_now(self) -> None:
        assert self.driver is not None
        self._evaluating = True
        try:
            self._emit_eval(await self.driver.evaluate(self._val_batches))
        finally:
            self._evaluating = False

    def _emit_eval(self, val_nats: float, final: bool = False) -> None:
        bpb = bits_per_byte(val_nats) if val_nats == val_nats else math.nan
        self.events.emit("eval", round=self.state.round, val_loss=bpb, val_nats=val_nats, final=final,
                         completed=self.driver.stats.completed if self.driver else 0,
                         retries=self.driver.stats.retries if self.driver else 0,
                         lost=self.driver.stats.lost if self.driver else 0)
        logger.info("stage %d eval at round %d: validation %.3f bits/byte", self.stage, self.state.round, bpb)

    def _save(self) -> None:
        if self.opt.save_dir:
            self.state.save(Path(self.opt.save_dir) / f"stage{self.stage}-{self.peer_id[-8:]}.safetensors",
                            {"stage": str(self.stage), "peer": self.peer_id})


def round_ms(seconds: float) -> float:
    return round(seconds, 3)
