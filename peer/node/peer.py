"""The peer daemon's life cycle: one process, one device, one stage replica at a time.

`Peer` is built from its collaborators (manifest, model, the network it reaches the swarm
through: `PeerNetwork.from_dht` for a started hivemind DHT). It chooses a
stage (placement policy over the swarm's records and its own benchmarked rates), runs a
`Replica` of it (peer/node/replica.py: round clock, worker, state, averager, presence, state sync,
round runner, driving loop), and, when the placement policy confirms a move, moves
make-before-break: the new stage's replica joins and serves before the old one finishes its
round and leaves. `run()` returns when the run is over or `stop` is set, after every replica
announced LEAVING and removed its handlers; the caller shuts the DHT down.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Coroutine

from hivemind import DHT
from hivemind.p2p import P2P

from swarmgrad.peer.private.admission import Admission
from swarmgrad.peer.net.deadline import within
from swarmgrad.peer.net.errors import NETWORK_FAILURES
from swarmgrad.peer.state.stage_state import StateSnapshot

from swarmgrad.peer.net.dial_out import DialOut
from swarmgrad.peer.events import EventLog, EventSink
from swarmgrad.peer.manifest import Manifest
from swarmgrad.peer.node.metrics import PeerMetrics
from swarmgrad.peer.model import StagedModel
from swarmgrad.peer.placement.rules import MoveDecision, PeerFigures, SWARM_POLICY, choose_stage_for_newcomer
from swarmgrad.peer.net.reachability import visible_maddrs
from swarmgrad.peer.placement.evidence import WorkSeen, likely_round, unserved_after
from swarmgrad.peer.placement.rebalancer import DEFAULT_BANDWIDTH, Rebalancer, read_work, snapshot_from_view
from swarmgrad.peer.node.replica import PeerContext, Replica
from swarmgrad.peer.state.backup import BackupStore
from swarmgrad.peer.public.tokenizer_share import serve_tokenizer
from swarmgrad.peer.pipeline.stage_server import refusal
from swarmgrad.peer.net.rpc import FramedRPC, Traffic
from swarmgrad.peer.compute.precision import precision_name, resolve_compute_dtype
from swarmgrad.peer.placement.bench import device_memory, stage_rate, stage_rates
from swarmgrad.peer.placement.cost import StageCost, stage_costs
from swarmgrad.peer.net.dht_view import SwarmView
from swarmgrad.peer.net.vouchers import OwnVoucher, check_voucher
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.validation import RunIdentity

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerNetwork:
    """What a peer reaches the swarm through: the DHT its records live in and the P2P instance its
    RPC streams ride. `from_dht` is the real one (a hivemind DHT process and its p2pd); anything
    with the same small interfaces will do (tests/support runs whole swarms in one event loop over
    an in-memory DHT and a loopback transport)."""
    dht: Any
    """A hivemind DHT built with the record signer, or an object with the `peer_id`, `store` and
    `get` that SwarmView uses (and `run_coroutine` for a NATed peer's dial-out)."""
    p2p: Callable[[], Awaitable[P2P]]
    """The P2P instance, asked for once the peer runs."""
    maddrs: Callable[[], tuple[str, ...]]
    """The addresses the peer announces, asked for once, while the DHT surely runs."""
    key: Any = None
    """The Ed25519 key whose public half is the peer id (the one p2pd and the record signer run
    with): a driver signs its round tickets with it (peer/net/round_tickets.py). None: its requests
    carry none, and later stages end their rounds only from the drivers' records."""

    @classmethod
    def from_dht(cls, dht: DHT, key: Any = None) -> "PeerNetwork":
        return cls(dht=dht, p2p=dht.replicate_p2p, maddrs=lambda: visible_maddrs(dht), key=key)


@dataclass(frozen=True, kw_only=True)
class PeerOptions:
    stage: int | None = None
    """Stage to serve; None lets the placement policy choose."""
    device: str = "cpu"
    compute_dtype: str = "auto"
    """What the forwards compute in: "auto" (the manifest's model.dtype on CUDA, float32 elsewhere),
    "float32" or "bfloat16" (peer/compute/precision.py)."""
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
    rate_clock: str = "wall"
    """Testing aid: "cpu" measures the announced rate in the compute thread's CPU time (see
    peer/compute/thread.py RATE_CLOCKS), for several peers sharing one machine's cores."""
    byzantine: str | None = None
    """TESTING AID: send corrupted pseudo-gradients ("scale" or "random"; benchmarks/byzantine.py)."""
    max_memory: int | None = None
    """Bytes this peer offers for a stage; None: what the device has."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port (0: a free one, reported in the `started` event); None: off."""
    metrics_host: str = "127.0.0.1"
    reachability: str = "public"
    """How others reach this peer (peer/net/reachability.py: public, relay, client or auto); reported
    in the `started` event."""
    initial_peer_ids: tuple[str, ...] = ()
    """The peer ids of --initial-peers: a NATed peer keeps them in its DHT's routing table."""
    rebalance: str = "auto"
    """"on": move between stages when the placement policy says it pays; "off": stay; "auto": on
    unless a stage was given (a user who chose a stage keeps it, as Petals servers with explicit
    blocks do)."""

    voucher: bytes = b""
    """The run owner's voucher for this peer (`swarmgrad peer --voucher FILE`, peer/net/vouchers.py):
    announced with its records, it makes this peer an anchor of a public run."""
    owner_key: Any = None
    """The run owner's Ed25519 key (`--owner-key`): this peer vouches for itself with it."""

    event_sink: EventSink | None = None
    """Sees every event as it is emitted, beside --events and the metrics (an embedding program or
    a test follows the peer live)."""

    @property
    def rebalancing(self) -> bool:
        return self.rebalance == "on" or (self.rebalance == "auto" and self.stage is None)


def own_voucher(options: PeerOptions, manifest: Manifest, peer_id: str) -> OwnVoucher | None:
    """The voucher this peer announces (None: none). A given one must hold for this run, manifest
    and peer id now: raises vouchers.VoucherRefused (the CLI checks it first and says so in one
    line). With the owner key (public runs only) the peer signs its own, renewed as it runs."""
    if options.voucher:
        check_voucher(options.voucher, manifest.run_id, peer_id, time.time(), manifest.hash)
        return OwnVoucher(options.voucher)
    if options.owner_key is not None:
        voucher = OwnVoucher(owner_key=options.owner_key, run_id=manifest.run_id, peer_id=peer_id,
                             manifest_hash=manifest.hash)
        voucher.current(time.time())  # signs now: a key that is not the run owner's fails here (ValueError)
        return voucher
    return None


class Peer:
    def __init__(self, manifest: Manifest, model: StagedModel, network: PeerNetwork, options: PeerOptions,
                 admission: Admission | None = None,
                 checkpoints: Callable[[int], Awaitable[StateSnapshot | None]] | None = None,
                 resume_round: int = 0):
        """`admission` and `checkpoints` make it a peer of a private run (peer/private/join.py builds
        them): every RPC server checks callers' certificates, and an empty stage can restore from
        the coordinator's newest checkpoint."""
        self.m = manifest
        self.admission = admission
        self.checkpoints = checkpoints
        self.resume_round = resume_round
        """The round of the private run's newest checkpoint (0: none): where a swarm that starts
        again puts its wall clock."""
        self._tasks: list[asyncio.Task] = []
        """The peer's own tasks (admission, revocation watch, dial-out), started through `_spawn`;
        each replica owns its own (Replica.spawn)."""
        self.revoked = False
        """True when the run's coordinator revoked this peer and it stopped for that reason."""
        self.model = model
        self.network = network
        self.dht = dht = network.dht
        self.opt = options
        self.peer_id = str(dht.peer_id)
        self.identity = RunIdentity(manifest.run_id, manifest.hash)
        self.n_stages = model.n_stages
        self.traffic = Traffic()
        self.swarm = SwarmView(dht, manifest.run_id, manifest.hash, self.n_stages, manifest.timeouts.dht,
                               manifest.timeouts.announce_ttl)
        if admission is not None:
            self.swarm.admitted = admission.admitted
        self.swarm.own_voucher = own_voucher(options, manifest, self.peer_id)
        self.max_message_bytes = int(manifest.pipeline.max_message_mb * 2**20)
        self.compute_dtype = precision_name(resolve_compute_dtype(manifest.model.dtype, options.device,
                                                                  options.compute_dtype))
        """What this peer's forwards compute in, resolved once (a ValueError here, before any task)."""
        self.events = EventLog(None)
        self.replicas: list[Replica] = []
        """The replica being served (two during a move)."""
        self.moves = 0
        self._trained_before = 0
        """Microbatches trained by the replicas this peer has left (`_trained`)."""
        self._maddrs: tuple[str, ...] = ()
        self._backup_rpc: FramedRPC | None = None
        self._tokenizer_rpc: FramedRPC | None = None
        """Serves the run's tokenizer file to joiners (peer/public/tokenizer_share.py); None: no file."""
        self.metrics = PeerMetrics(self.traffic) if options.metrics_port is not None else None
        self.metrics_port: int | None = None
        """The port metrics are served on, once they are."""

    @property
    def max_rounds(self) -> int:
        """Rounds to run (0: until stopped): --max-rounds if given, else rounds.max_rounds."""
        return self.opt.max_rounds if self.opt.max_rounds is not None else self.m.rounds.max_rounds

    async def run(self, stop: asyncio.Event) -> None:
        try:
            if self.admission is not None:
                await self.admission.step()  # publish our certificate and learn the others' first
                self._spawn(self.admission.run(), "admission")
                self._spawn(self._stop_when_revoked(stop), "revoked")
            ctx, costs, rates = await self._context()
            stage = await self._choose_stage(costs, rates, ctx.memory)
            expected_rate = rates[stage] if rates else await self._pinned_rate(stage)
            self.events.emit("started", stage=stage, maddrs=list(self._maddrs), run_id=self.m.run_id,
                             manifest_hash=self.m.hash, stage_rates=list(rates), expected_rate=expected_rate,
                             memory=ctx.memory, metrics_port=self.metrics_port,
                             reachability=self.opt.reachability, compute_dtype=self.compute_dtype,
                             activation_checkpointing=self.m.model.activation_checkpointing)
            if self.opt.reachability in ("relay", "client"):  # behind NAT: open the connections ourselves
                dial_out = DialOut(ctx.p2p, self.swarm, peer_id=self.peer_id,
                                   stage=lambda: self.replicas[-1].stage if self.replicas else None,
                                   interval=self.m.timeouts.heartbeat, timeout=self.m.timeouts.dht, events=self.events,
                                   dht=self.dht, initial_peers=self.opt.initial_peer_ids)
                self._spawn(dial_out.run(), "dial-out")
            replica = Replica(ctx, stage, expected_rate)
            self.replicas.append(replica)
            await replica.start()
            rebalancer = Rebalancer(swarm=self.swarm, peer_id=self.peer_id, costs=costs, bench_rates=rates,
                                    memory=ctx.memory, interval_s=self.m.timeouts.rebalance_check,
                                    policy=SWARM_POLICY,
                                    bandwidth=lambda: self.traffic.link.estimate(DEFAULT_BANDWIDTH),
                                    unserved_after=unserved_after(self.m.timeouts)) \
                if self.opt.rebalancing else None
            await self._serve(replica, rebalancer, stop)
        finally:
            await self._shutdown()

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        """Run `coro` as a task of the peer: `_shutdown` cancels and awaits it after the replicas."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.append(task)
        return task

    async def _context(self) -> tuple[PeerContext, tuple[StageCost, ...], tuple[float, ...]]:
        p2p = await self.network.p2p()
        # get_visible_maddrs blocks on the DHT process: ask once, while it is surely alive
        maddrs = self._maddrs = self.network.maddrs()
        if self.metrics is not None:
            self.metrics_port = self._serve_metrics(self.metrics)
        sink = _fan_out([s for s in (self.metrics.observe if self.metrics else None, self.opt.event_sink) if s])
        self.events = EventLog(self.opt.events_path, sink=sink, peer=self.peer_id)
        memory = self.opt.max_memory or device_memory(self.opt.device)
        backup_rpc = await self._backups(p2p)
        self._tokenizer_rpc = await serve_tokenizer(p2p, self.m, self.traffic,
                                                    gate=self.admission.check if self.admission is not None else None)
        ctx = PeerContext(manifest=self.m, model=self.model, dht=self.dht, p2p=p2p, swarm=self.swarm,
                          traffic=self.traffic, identity=self.identity, peer_id=self.peer_id, maddrs=maddrs,
                          events=self.events, device=self.opt.device, save_dir=self.opt.save_dir,
                          compute_dtype=self.compute_dtype,
                          data_seed=self.opt.data_seed, max_rounds=self.max_rounds, linger=self.opt.linger,
                          slowdown=self.opt.slowdown, rate_clock=self.opt.rate_clock, memory=memory,
                          max_message_bytes=self.max_message_bytes,
                          backup_rpc=backup_rpc, backup_store=self._backup_store, pinned=not self.opt.rebalancing,
                          gate=self.admission.check if self.admission is not None else None,
                          checkpoints=self.checkpoints, byzantine=self.opt.byzantine,
                          resume_round=self.resume_round, key=self.network.key)
        costs = stage_costs(self.m, self.model, compute_dtype=self.compute_dtype)
        rates: tuple[float, ...] = ()
        if self.opt.stage is None or self.opt.rebalancing:
            rates = await asyncio.get_running_loop().run_in_executor(
                None, stage_rates, self.m, self.model, self.opt.device, self.opt.slowdown)
        return ctx, costs, rates

    async def _pinned_rate(self, stage: int) -> float:
        """A pinned peer's benchmarked rate on its own stage (it skipped the every-stage benchmark,
        having no choice to weigh), announced until it has measured itself."""
        return await asyncio.get_running_loop().run_in_executor(
            None, stage_rate, self.m, self.model, self.opt.device, stage, self.opt.slowdown)

    def _serve_metrics(self, metrics: PeerMetrics) -> int:
        host, port = self.opt.metrics_host, self.opt.metrics_port
        assert port is not None
        try:
            return metrics.serve(host, port)
        except OSError as e:
            raise RuntimeError(f"--metrics-port {port}: cannot serve metrics on {host}: {e.strerror or e}") from None

    def _trained(self) -> int:
        """Microbatches this peer's replicas trained ever (never decreases, across moves too): a
        backup holder's and the rebalancer's evidence that the pipeline, so every stage, is served
        (peer/state/backup.py, peer/placement/evidence.py `StageService`)."""
        return self._trained_before + sum(r.worker.microbatches_total for r in self.replicas if r.worker is not None)

    async def _backups(self, p2p) -> FramedRPC:
        """Serve the backups this peer holds for other stages (peer/state/backup.py)."""
        shapes: dict[int, dict[str, tuple[int, ...]]] = {}

        def shapes_of(stage: int) -> dict[str, tuple[int, ...]]:
            if stage not in shapes:
                shapes[stage] = {n: tuple(p.shape) for n, p in self.model.build_stage(stage).named_parameters()}
            return shapes[stage]

        async def votes(stage: int, round_no: int) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
            # who did a stage's work, for whose backups this peer takes (docs/trust.md "Backups")
            checks, registrations = await asyncio.gather(self.swarm.round_checks(stage, round_no),
                                                         self.swarm.round_registrations(stage, round_no))
            return checks, registrations

        self._backup_store = BackupStore(self.identity, self.n_stages, shapes_of, self.max_message_bytes,
                                         peer_id=self.peer_id, swarm=self.swarm.swarm, timeout=self.m.timeouts.dht,
                                         votes=votes, trained=self._trained)
        rpc = FramedRPC(p2p, f"swarmgrad/{self.m.run_id}/backup", self.traffic, self.max_message_bytes,
                        read_timeout=self.m.timeouts.state_download,
                        gate=self.admission.check if self.admission is not None else None)
        await rpc.add_handler("put", pb.BackupPut, self._backup_store.handle_put, refusal(pb.BackupAck))
        await rpc.add_handler("get", pb.BackupGet, self._backup_store.handle_get, refusal(pb.StateResponse))
        self._backup_rpc = rpc
        return rpc

    async def _choose_stage(self, costs: tuple[StageCost, ...], rates: tuple[float, ...], memory: int) -> int:
        if self.opt.stage is not None:
            if not 0 <= self.opt.stage < self.n_stages:
                raise ValueError(f"--stage {self.opt.stage} is outside 0..{self.n_stages - 1}")
            stage = self.opt.stage
        else:
            view = await self.swarm.swarm()
            me = PeerFigures(peer_id=self.peer_id, rates=rates, memory=memory, bandwidth=DEFAULT_BANDWIDTH,
                             tenure=3600.0)
            # forged records must not steer a newcomer either: count what the last rounds' votes
            # prove (peer/placement/evidence.py); votes that cannot be read prove nothing
            work, round_no = WorkSeen(), likely_round(view)
            try:
                await read_work(self.swarm, work, self.n_stages, round_no)
            except NETWORK_FAILURES as e:
                logger.info("choosing a stage without the last rounds' votes: %s", e)
            choice = choose_stage_for_newcomer(snapshot_from_view(view, costs, work, round_no), me)
            if choice is None:
                need = min(c.memory_bytes for c in costs)
                raise RuntimeError(f"no stage fits in the memory this peer offers ({memory / 2**30:.1f} GiB; the "
                                   f"smallest stage needs {need / 2**30:.1f} GiB): raise --max-memory")
            stage = choice
        return stage

    async def _serve(self, replica: Replica, rebalancer: Rebalancer | None, stop: asyncio.Event) -> None:
        stopper = asyncio.create_task(stop.wait(), name="stop")
        try:
            while True:
                main = replica.launch(stop)
                mover = None
                if rebalancer is not None and replica.clock is not None:
                    clock, worker = replica.clock, replica.worker
                    assert worker is not None
                    mover = asyncio.create_task(rebalancer.next_move(
                        replica.stage, lambda w=worker: w.rate.rate, lambda c=clock: c.current, self._trained),
                        name="rebalance")
                waiting = [main, stopper] + ([mover] if mover is not None else [])
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if mover is not None and mover not in done:
                    mover.cancel()
                    await asyncio.gather(mover, return_exceptions=True)
                if stop.is_set():
                    return
                if main in done:
                    if main.result() and not stop.is_set():  # the rounds are done: final eval / linger
                        await replica.finish(stop)
                    return
                assert mover is not None
                assert rebalancer is not None
                replica = await self._move(replica, mover.result(), rebalancer, stop)
        finally:
            stopper.cancel()

    async def _move(self, old: Replica, decision: MoveDecision, rebalancer: Rebalancer, stop: asyncio.Event
                    ) -> Replica:
        """Make-before-break: the new stage's replica joins (JOINING, state download) and serves
        (ONLINE) while the old one finishes its current round; then the old one leaves."""
        # a gain of 0 filling a stage: the stages it leaves behind have not measured their rates yet
        unmeasured = decision.gain <= 0 and decision.reason == "fill-empty"
        gain = "the other stages' rates not measured yet" if unmeasured else \
            f"expected gain {decision.gain:.1f} samples/s"
        logger.info("moving from stage %d to stage %d (%s, %s)", decision.source, decision.target, decision.reason, gain)
        assert old.worker is not None
        new = Replica(old.ctx, decision.target, rebalancer.figures(old.stage, old.worker.rate.rate).rates[decision.target])
        self.replicas.append(new)
        try:
            await new.start()
        except Exception:  # the whole join (state download, handlers, ...): the old stage serves on
            logger.exception("could not join stage %d; staying on stage %d", decision.target, old.stage)
            self.replicas.remove(new)
            await new.close()
            return old
        new.launch(stop)
        await old.leave_after_round()
        assert old.main is not None
        try:
            await within(asyncio.shield(old.main), self.m.timeouts.move)
        except asyncio.TimeoutError:
            logger.warning("stage %d's round did not end within timeouts.move; leaving it anyway", old.stage)
        except NETWORK_FAILURES as e:
            logger.warning("stage %d ended with %s: %s", old.stage, type(e).__name__, e)
        except Exception as e:  # the old replica's whole run: a bug there must not stop the move
            logger.error("stage %d ended with %s: %s", old.stage, type(e).__name__, e, exc_info=e)
        await old.close()
        self._trained_before += old.worker.microbatches_total if old.worker is not None else 0
        self.replicas.remove(old)
        self.moves += 1
        rebalancer.moved()
        self.events.emit("moved", stage=decision.target, from_stage=decision.source, to_stage=decision.target,
                         reason=decision.reason, expected_gain=decision.gain, throughput=decision.throughput,
                         new_throughput=decision.new_throughput, reachable=decision.reachable,
                         bandwidth=rebalancer.bandwidth())
        return new

    async def _stop_when_revoked(self, stop: asyncio.Event) -> None:
        """A revoked peer is refused by every other peer within a heartbeat: leave rather than
        train alone on a stage nobody averages with."""
        assert self.admission is not None
        await self.admission.self_revoked.wait()
        self.revoked = True
        self.events.emit("revoked")
        stop.set()

    async def _shutdown(self) -> None:
        rounds = max((r.clock.rounds_done for r in self.replicas if r.clock is not None), default=0)
        stage = self.replicas[-1].stage if self.replicas else None
        for replica in list(self.replicas):
            await replica.close()
        for rpc in (self._backup_rpc, self._tokenizer_rpc):
            if rpc is not None:
                await rpc.remove_handlers()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.events.emit("stopped", stage=stage, rounds=rounds, moves=self.moves, bytes_sent=self.traffic.sent,
                         bytes_recv=self.traffic.recv, peak_rss=_peak_rss())
        self.events.close()
        if self.metrics is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.metrics.close)


def _fan_out(sinks: list[EventSink]) -> EventSink | None:
    """One sink that hands each event to every one of `sinks` (None for none)."""
    if len(sinks) <= 1:
        return sinks[0] if sinks else None

    def emit(record: dict[str, Any]) -> None:
        for sink in sinks:
            sink(record)
    return emit


def _peak_rss() -> int:
    """This process's peak resident memory in bytes (Linux reports KiB), for comparison with
    placement's estimate (benchmarks/scale.py); the DHT child's is its own."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
