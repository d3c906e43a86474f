"""What a driver (a stage-0 replica) does besides computing: read its data shard, wait until
every stage is served, push microbatches through the pipeline, and evaluate on held-out text
at the start, every `data.eval_every` rounds, and once more after the last round."""
from __future__ import annotations

import asyncio
import logging
import math
from typing import Any, Callable, Coroutine

from hivemind.p2p import PeerID

from swarmgrad.peer import decisions
from swarmgrad.peer.averaging.averager import RoundResult
from swarmgrad.peer.clock import RoundClock
from swarmgrad.peer.model.subspace import TokenCarry
from swarmgrad.peer.text.run_data import RunData, load_run_data
from swarmgrad.peer.text.units import eval_units
from swarmgrad.peer.pipeline.driver import Batch, Driver
from swarmgrad.peer.events import EventLog
from swarmgrad.peer.manifest import Manifest
from swarmgrad.peer.model import StagedModel
from swarmgrad.peer.pipeline.stage_server import Downstream, wait_for_pipeline
from swarmgrad.peer.placement.cost import stage_costs
from swarmgrad.peer.net.dht_view import SwarmView
from swarmgrad.peer.pipeline.window import memory_window
from swarmgrad.peer.shards.leaser import LeaseSettings, LeasedStream, ShardLeaser
from swarmgrad.peer.shards.saved import load_position, save_position
from swarmgrad.peer.shards.source import ByteShards, ShardSource, TextShards
from swarmgrad.peer.data import MicrobatchStream
from swarmgrad.peer.compute.worker import StageWorker

logger = logging.getLogger(__name__)

STEP_GAP_HINT = 0.25
"""A driver whose uplink waits this share of the time between inner steps says, once, what shortens it."""
SHARED_CORE = 0.8
"""Below this share of a core for its compute thread (a CPU device that other processes share), a
driver does not suggest finer microbatches: the others already use its waits. Measured with `swarmgrad
demo` on 2 cores (docs/measurements.md): with 4 peers the compute threads got 0.69–0.73 of a core and
4 × 8 ran at 0.91–0.98× the samples/s of 2 × 16; with 2 peers they got 0.96–0.98 and 4 × 8 ran at 1.19×."""


def pipeline_hint(report: dict, microbatches_per_step: int, microbatch_size: int) -> str | None:
    """What a driver says once about its pipeline's waits between inner steps, from a `pipeline`
    report (``Driver.report``); None when there is nothing to say."""
    gap, share = report["step_gap_share"], report.get("core_share")
    if gap < STEP_GAP_HINT or microbatch_size <= 1:
        return None
    if share is not None and share < SHARED_CORE:
        return (f"the uplink waited {100 * gap:.0f}% of the time between inner steps, but the compute thread ran "
                f"on {100 * share:.0f}% of a core: other processes share this machine's cores and use those "
                f"waits, so more, smaller microbatches would not make the swarm faster here")
    return (f"the uplink waited {100 * gap:.0f}% of the time between inner steps (each exact step's fill and "
            f"drain); more, smaller microbatches per step shorten it, with the same samples per step "
            f"(inner.microbatches_per_step × inner.microbatch_size, now {microbatches_per_step} × "
            f"{microbatch_size}; raise pipeline.max_in_flight with them)")


def data_seed(manifest: Manifest, peer_id: str, override: int | None) -> int:
    """A driver's shard: --data-seed if given, else derived from the peer id and the run's seed."""
    if override is not None:
        return override
    return int.from_bytes(PeerID.from_base58(peer_id).to_bytes()[-4:], "big") ^ manifest.seed


def shard_source(manifest: Manifest, data: RunData) -> ShardSource:
    """The training corpus as shards for the leases (peer/shards/source.py): the byte corpus cut
    into `data.shards` ranges, or the streaming path's shards as they are listed."""
    if data.corpus is None:
        assert isinstance(data.stream, MicrobatchStream)
        return ByteShards(data.stream.corpus, manifest.data.shards, manifest.model.seq_len, seed=manifest.seed)
    return TextShards(data.corpus, data.stream)


def driver_memory_window(manifest: Manifest, offered_bytes: int | None, model: StagedModel | None = None) -> int | None:
    """Microbatches in flight whose stage-0 activations fit in what this peer offers (the
    window's memory bound), from the stage's estimated needs (peer/placement/cost.py)."""
    try:
        need = stage_costs(manifest, model)[0].memory
    except ValueError:  # an entry-point model without its StagedModel: unknown
        return None
    per_microbatch = need.activations // manifest.pipeline.max_in_flight
    return memory_window(offered_bytes, need.total - need.activations, per_microbatch)


class DrivingLoop:
    def __init__(self, *, manifest: Manifest, worker: StageWorker, downstream: Downstream | None, peer_id: str,
                 n_stages: int, swarm: SwarmView, clock: RoundClock, events: EventLog, seed: int,
                 spawn: Callable[[Coroutine[Any, Any, Any], str], asyncio.Task],
                 report_stats: Callable[..., None] | None = None, memory_window: int | None = None,
                 save_dir: str | None = None, token_carry: TokenCarry | None = None):
        self.m = manifest
        self.token_carry = token_carry
        """The model's StagedModel.token_carry, for the driver."""
        self.save_dir = save_dir
        """--save-dir: the data position is saved there after every round and on leave, and resumed from."""
        self.leaser: ShardLeaser | None = None
        """The shard leases (data.shards > 0), run as the replica's task `_leasing`."""
        self._leasing: asyncio.Task | None = None
        self.memory_window = memory_window
        """Microbatches in flight the memory this peer offers holds (peer/pipeline/window.py); None: unknown."""
        self.report_stats = report_stats
        """Presence.set_stats: each evaluation's score goes into the replica's record."""
        self.worker = worker
        self.downstream = downstream
        self.peer_id = peer_id
        self.n_stages = n_stages
        self.swarm = swarm
        self.clock = clock
        self.events = events
        self.seed = seed
        self.spawn = spawn
        """Replica.spawn: evaluations started here are the replica's tasks (cancelled, awaited by it)."""
        self.driver: Driver | None = None
        self.stop_training = asyncio.Event()
        """Set after the last round: no more training microbatches (evaluation goes on)."""
        self._val: list[Batch] = []
        self._val_tokens = self._val_bytes = 0
        """Target tokens of the validation batches and the bytes of text they stand for (eval units)."""
        self._evaluating = False
        self._hinted = False
        self.evaluate_at_start = True
        """False for a joiner that took a live replica's state (StateSync.from_replica): its donors
        evaluated that θ, and its replicas, which count it ONLINE, would wait for it in matchmaking
        while it evaluated the same θ again."""

    async def run(self) -> None:
        data = await asyncio.get_running_loop().run_in_executor(None, lambda: load_run_data(self.m, self.seed))
        try:
            await self._drive(data)
        finally:
            data.close()

    async def _drive(self, data: RunData) -> None:
        self._val = data.validation
        self._val_tokens, self._val_bytes = data.val_tokens, data.val_bytes
        stream: Any = data.stream
        d = self.m.data
        if d.shards:
            source = shard_source(self.m, data)
            block = self.m.inner.microbatches_per_step * self.m.inner.microbatch_size
            position = load_position(self.save_dir, len(source.shard_ids()))
            if position is not None:
                logger.info("data: resuming from the position saved in %s (%s)", self.save_dir, position.summary())
            self.leaser = ShardLeaser(source, self.swarm, LeaseSettings(d.lease_seconds, d.lease_settle, block),
                                      position=position, emit=self.events.emit)
            stream = LeasedStream(self.leaser)
        self.driver = Driver(self.m, self.worker, self.downstream, self.peer_id, self.n_stages, stream,
                             self.events.emit, self.clock, memory_window=self.memory_window,
                             token_carry=self.token_carry)
        # a stage may be empty for a while (peers still joining, or one moving in to fill it):
        # wait, saying so, rather than give up on a swarm that is still assembling
        while self.n_stages > 1 and not await wait_for_pipeline(self.swarm, self.n_stages,
                                                                self.m.timeouts.state_download):
            logger.warning("no replica serves some stage yet; the pipeline is incomplete (still waiting)")
        if self.evaluate_at_start:
            await self.evaluate()
        else:
            logger.info("stage 0: no start evaluation (the state came from a live replica, which evaluated it)")
        if self.leaser is not None and not self.stop_training.is_set():
            self._leasing = self.spawn(self.leaser.run(), "shard-leases")
        self.events.emit("driving", round=self.clock.current, evaluated_at_start=self.evaluate_at_start)
        await self.driver.run(self.stop_training)

    async def after_round(self, round_no: int, result: RoundResult) -> None:
        """Called by the round runner after each round: report what limited the pipeline in it
        (the `pipeline` event and a progress line), start an evaluation when one is due and this
        driver is one of the round's evaluators (`data.evaluators`, chosen from its group)."""
        if self.driver is not None and self.driver.running and self.n_stages > 1:
            self.report_pipeline()
        self.save_position()
        group = result.group if result.complete else ()
        # in a group, count by the round number its members share: a joiner's own count of rounds
        # differs from the others', and they would disagree on which rounds are due
        done = round_no + 1 if group else self.clock.rounds_done
        if decisions.eval_due(is_driver=True, driving=self.driver is not None and self.driver.running,
                           evaluating=self._evaluating, eval_every=self.m.data.eval_every,
                           rounds_done=done, finished=self.clock.finished) \
                and decisions.evaluates(me=self.peer_id, group=group, run_id=self.m.run_id, round_no=round_no,
                                     evaluators=self.m.data.evaluators):
            self.spawn(self.evaluate(after_round=round_no), "eval")

    def report_pipeline(self) -> None:
        assert self.driver is not None
        r = self.driver.report()
        self.events.emit("pipeline", round=self.clock.current, **r)
        rate = lambda v: "?" if v is None else f"{v / 1e6:.2f}"  # noqa: E731
        logger.info("stage 0 pipeline: window %d of %d (%s) | link %.0f%% (up %.2f of %s MB/s, down %.2f of %s MB/s) "
                    "| compute %.0f%% (driver %.0f%%%s) | bottleneck %s | uplink waits between steps %.0f%%%s",
                    r["window"], r["max_in_flight"],
                    r["window_limited_by"], 100 * r["link_util"], r["up_bytes_per_s"] / 1e6, rate(r["up_rate"]),
                    r["down_bytes_per_s"] / 1e6, rate(r["down_rate"]), 100 * r["compute_util"],
                    100 * r["driver_compute_util"],
                    "" if r["core_share"] is None else f", on {100 * r['core_share']:.0f}% of a core",
                    r["bottleneck"], 100 * r["step_gap_share"],
                    f" | {100 * r['ahead_share']:.0f}% ran ahead" if self.m.pipeline.lookahead else "")
        hint = None if self._hinted else pipeline_hint(r, self.m.inner.microbatches_per_step,
                                                       self.m.inner.microbatch_size)
        if hint is not None:
            self._hinted = True  # once per run: the figures are in every pipeline event
            logger.info("stage 0 pipeline: %s", hint)

    async def evaluate(self, final: bool = False, after_round: int | None = None) -> None:
        """Score θ_global on the held-out batches; `after_round`: the round whose end made it due
        (None for the start and final evaluations), in the event."""
        assert self.driver is not None
        self._evaluating = True
        try:
            val_nats = await self.driver.evaluate(self._val)
        finally:
            self._evaluating = False
        # a lost batch leaves the mean over those that came back: their share of bytes is the whole set's
        units = eval_units(val_nats, self._val_tokens, self._val_bytes)
        bpb = units.bits_per_byte
        if self.report_stats is not None:
            finite = lambda v: v if math.isfinite(v) else None  # noqa: E731
            self.report_stats(val_loss=finite(bpb), val_nats=finite(units.nats_per_token),
                              val_ppl=finite(units.perplexity))
        stats = self.driver.stats
        self.events.emit("eval", round=self.clock.current, val_loss=bpb, **units.fields(), final=final,
                         after_round=after_round,
                         completed=stats.completed, retries=stats.retries, lost=stats.lost,
                         commit_failures=stats.commit_failures)
        logger.info("stage 0 eval at round %d: validation %.3f bits/byte, %.3f nats/token, perplexity %.2f",
                    self.clock.current, bpb, units.nats_per_token, units.perplexity)

    def save_position(self) -> None:
        """Write the data position into --save-dir (when leasing and given one)."""
        if self.leaser is not None and self.save_dir:
            try:
                save_position(self.save_dir, self.peer_id, self.leaser.position)
            except OSError as e:
                logger.warning("data: could not save the data position in %s: %s", self.save_dir, e)

    async def release(self) -> None:
        """Leaving: stop leasing and give the held shard back at once (within timeouts.shutdown / 3),
        so another driver goes on with it without waiting for the lease to expire."""
        if self._leasing is not None:
            self._leasing.cancel()
            await asyncio.gather(self._leasing, return_exceptions=True)
        if self.leaser is not None:
            await self.leaser.release(self.m.timeouts.shutdown / 3)
            self.save_position()

    async def finish(self) -> None:
        """The last round is done: stop training and evaluate a final time."""
        self.stop_training.set()
        if self.driver is not None:
            await self.evaluate(final=True)
