"""The driver: a stage-0 replica that reads its data shard and pushes microbatches through the
pipeline, several in flight, each with a deadline, retried along another route when it fails.

Every microbatch is either trained on (its loss came back, stage 0 ran its backward) or retried;
after pipeline.max_retries failed attempts it is given up and logged as lost, never silently.
What is not guaranteed: a microbatch whose answer was lost after a later stage had already run
its backward (the link broke on the way back) is retried along another route, so that later
replica keeps one extra sample in its gradients. Removing it needs commit-on-acknowledgement
(accumulate a microbatch's gradients only once the driver confirms it), which is not built.
An attempt that fails releases its stage-0 graph before the retry waits, so a driver never holds
a round boundary hostage to a slow retry.

How many microbatches are in flight is the adaptive window (peer/pipeline/window.py): sized from the
measured link and compute so that the slowest of them stays busy, at most pipeline.max_in_flight.
Requests go on the link one after another (the send slot): a request starts once the one before
it is written and, at the measured rate, on the wire. Sent all at once they would share the link
and all arrive at the end, and the next stage would wait for the first of them as long as for the
last; in order, it computes on the first while the others are still arriving, and the driver
computes its next forward while the link carries this one. With pipeline.lookahead the window
also runs on across inner steps: the next step's microbatches go out while this step drains
(peer/compute/lookahead.py).

A lane draws its batch once its microbatch has a place in an inner step, at the size of that
place (inner.microbatch_sizes, when a step's microbatches differ in size), and keeps it for the
microbatch's retries.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
from hivemind.utils import get_dht_time

from swarmgrad.peer.clock import RoundClock
from swarmgrad.peer.compute.lookahead import Slot
from swarmgrad.peer.manifest import Manifest
from swarmgrad.peer.model.subspace import TokenCarry
from swarmgrad.peer.pipeline.stage_server import Downstream, Hop
from swarmgrad.peer.pipeline.routing import DeadlineEstimator
from swarmgrad.peer.net.retry import Backoff
from swarmgrad.peer.net.rpc import CallTiming
from swarmgrad.peer.pipeline.window import PipelineEstimator, StepGaps, WindowChoice, choose_window, utilisation
from swarmgrad.peer.compute.worker import NonFiniteLoss, StageWorker
from swarmgrad.protocol import wire_pb2 as pb

logger = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]


class BatchStream(Protocol):
    """Where a driver's lanes take their training batches: `draw(size)`, a stream that never waits
    (`MicrobatchStream`: random windows from the driver's seed; the streaming path's `TokenStream`),
    or `async take(size)`, one that may (`LeasedStream`: the shards it leases, peer/shards/leaser.py,
    waiting while its next claim is stored). A stream that can run dry for a while (a leased one at
    an epoch's end) also has `ready`, an asyncio.Event set while a batch can be taken: a lane waits
    for it before it is admitted, since an admitted microbatch holds the round boundary."""

    def draw(self, size: int) -> Batch: ...

NOT_READY_BACKOFF = Backoff(first=0.2, cap=1.0, growth=1.5)
"""Waits before re-sending a microbatch that every replica refused NOT_READY (between rounds, or
none there yet): not a failure, so the wait stays short, and grows while the stage stays busy."""
NOT_READY_QUICK_S = 0.02
"""The wait when a busy replica was named: routing passes it over now, so another may take it."""


class Pending:
    """One microbatch's batch: given (an evaluation, a caller's), or drawn by its first admitted
    attempt (`Driver._draw`) and kept for its retries."""

    def __init__(self, batch: Batch | None = None) -> None:
        self.batch = batch


@dataclass
class DriverStats:
    completed: int = 0
    retries: int = 0
    lost: int = 0
    not_ready_waits: int = 0
    ahead: int = 0
    """Microbatches trained that ran ahead, against the stash (pipeline.lookahead): one step stale."""
    commit_failures: int = 0
    """Replicas a commit did not reach: they dropped that microbatch (lost there, not trained twice)."""
    failed_peers: set[str] = field(default_factory=set)


class Driver:
    def __init__(self, manifest: Manifest, worker: StageWorker, downstream: Downstream | None, peer_id: str,
                 n_stages: int, stream: BatchStream | None, emit: Callable[..., None], clock: RoundClock,
                 memory_window: int | None = None, token_carry: TokenCarry | None = None):
        self.m = manifest
        self.token_carry = token_carry
        """Set when later stages need the token ids (StagedModel.token_carry): the targets sent are its
        wire_targets."""
        self.worker = worker
        self.downstream = downstream
        self.peer_id = peer_id
        self.n_stages = n_stages
        self.stream = stream
        """Where lanes draw their training batches (None: a caller passes them, train_microbatch)."""
        self.sizes = manifest.inner.step_sizes
        self.emit = emit
        self.clock = clock
        """The driver's round is sent with every microbatch, so later stages follow its rounds."""
        t = manifest.timeouts
        self.deadlines = DeadlineEstimator(minimum=t.min_microbatch, maximum=t.microbatch)
        self.stats = DriverStats()
        self._ids = itertools.count()
        self._commits: set[asyncio.Task] = set()
        """Commits on their way (owned here: finished or cancelled when the driver stops)."""
        self.running = False
        self._lookahead = manifest.pipeline.lookahead and n_stages > 1
        """Run the next step's microbatches ahead (a whole-model replica has no pipeline to drain)."""
        """True once the driver is sending training microbatches."""
        self.memory_window = memory_window
        """Microbatches whose stage-0 activations the memory this peer offers holds (None: unknown)."""
        self.estimator = PipelineEstimator()
        self.choice: WindowChoice = choose_window(self.estimator.measure(), manifest.pipeline.max_in_flight,
                                                  memory_window)
        self._in_flight = 0
        self._window_changed = asyncio.Condition()
        self._send_slot = asyncio.Lock()
        """Held while a request goes onto the link (asyncio's lock is FIFO: requests leave in order)."""
        self._compute_marks: list[tuple[int, float]] = []
        self._trips = 0
        """Training microbatches answered (the next stage's busy time is this × its service time)."""
        self._up_bytes = self._down_bytes = 0
        """Bytes of training requests and their answers (the link utilisation report)."""
        self.step_gaps = StepGaps()
        """The uplink's waits between inner steps (the report's `step_gap_share`)."""
        self._report_mark = self._marks()
        self._routes_mark: Counter[str] = Counter()

    @property
    def window(self) -> int:
        return self.choice.size

    async def run(self, stop: asyncio.Event) -> None:
        """Keep the adaptive window's microbatches in flight (at most pipeline.max_in_flight) until
        `stop` is set."""
        self.running = True
        lanes = [asyncio.create_task(self._lane(stop), name=f"driver-lane-{i}")
                 for i in range(self.m.pipeline.max_in_flight)]
        try:
            await asyncio.gather(*lanes)
        finally:
            for lane in lanes:
                lane.cancel()
            await asyncio.gather(*lanes, return_exceptions=True)
            await self.flush_commits()

    async def flush_commits(self) -> None:
        """Let commits on their way finish (each has its timeouts.commit deadline)."""
        if self._commits:
            await asyncio.gather(*list(self._commits), return_exceptions=True)

    async def _lane(self, stop: asyncio.Event) -> None:
        ready: asyncio.Event | None = getattr(self.stream, "ready", None)
        while not stop.is_set():
            if ready is not None and not ready.is_set():
                await self._until_ready(ready, stop)
                continue
            async with self._window_changed:  # a lane beyond the window waits for it to grow
                await self._window_changed.wait_for(lambda: self._in_flight < self.window)
                self._in_flight += 1
            try:
                await self._train(Pending(), stop)
            finally:
                self._in_flight -= 1
                await asyncio.shield(self._rewindow())

    @staticmethod
    async def _until_ready(ready: asyncio.Event, stop: asyncio.Event) -> None:
        """Wait, not admitted, until the stream has data or training stops."""
        waits = [asyncio.ensure_future(ready.wait()), asyncio.ensure_future(stop.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def _rewindow(self) -> None:
        """Re-size the window from the latest measurements and wake lanes that may now go."""
        self.choice = choose_window(self.estimator.measure(), self.m.pipeline.max_in_flight, self.memory_window)
        async with self._window_changed:
            self._window_changed.notify_all()

    async def _send(self, mb: int, attempt: int, h: torch.Tensor, targets: torch.Tensor, eval_only: bool,
                    step: int, remaining: int | None = None) -> tuple[Hop, CallTiming]:
        """Send through the send slot (module docstring): hold it until the request is written and,
        at the measured uplink rate, has had time to leave; then wait for the answer without it.
        `step`: the inner step the microbatch trains in (the report's waits between steps);
        `remaining`: its step's microbatches not sent yet, this one included (routing; the first
        of a step may probe a replica not measured yet)."""
        assert self.downstream is not None
        timing = CallTiming()
        encoded = await self.downstream.encode(h)  # before the slot: the link need not wait for the codec
        async with self._send_slot:
            round_no = self.clock.current
            if not eval_only:
                self.step_gaps.starting(step, round_no, time.monotonic())
            call = asyncio.ensure_future(self.downstream.forward(
                1, h, targets, mb, attempt, self.peer_id, get_dht_time() + self.deadlines.deadline(), eval_only,
                round_no, timing=timing, encoded=encoded, remaining=remaining,
                explore=remaining is None or remaining >= self.m.inner.microbatches_per_step))
            sent = asyncio.ensure_future(timing.sent.wait())
            try:
                await asyncio.wait([call, sent], return_when=asyncio.FIRST_COMPLETED)
                rate = self.estimator.measure().up_rate
                if rate and not call.done() and timing.started:
                    on_wire = timing.started + timing.request_bytes / rate - time.monotonic()
                    if on_wire > 0:
                        await asyncio.wait([call], timeout=on_wire)
            except BaseException:
                call.cancel()
                raise
            finally:
                sent.cancel()  # no request went out (no replica to send to): nothing will set it
                if not eval_only and timing.started:
                    self.step_gaps.sent(step, round_no, time.monotonic())
        return await call, timing

    def _observe(self, hop: Hop, timing: CallTiming) -> None:
        if not (timing.started and timing.done):
            return
        self.estimator.observe_trip(request_bytes=timing.request_bytes, response_bytes=timing.response_bytes,
                                    trip_s=timing.done - timing.started, request_s=hop.request_s,
                                    response_s=timing.done - timing.first_byte if timing.first_byte else 0.0,
                                    serve_s=hop.serve_s, answered_at=timing.first_byte or timing.done)
        self._trips += 1
        self._up_bytes += timing.request_bytes
        self._down_bytes += timing.response_bytes

    def _observe_compute(self) -> None:
        """The driver's compute per microbatch over its last few completions (forward, backward
        and its share of inner steps: everything its compute thread did)."""
        self._compute_marks.append((self.stats.completed, self.worker.compute_total))
        del self._compute_marks[:-9]
        (n0, c0), (n1, c1) = self._compute_marks[0], self._compute_marks[-1]
        if n1 > n0:
            self.estimator.observe_compute((c1 - c0) / (n1 - n0))

    def _marks(self) -> tuple[float, float, int, int, int, int, float, float, float]:
        return (time.monotonic(), self.worker.compute_total, self._up_bytes, self._down_bytes, self._trips,
                self.stats.ahead, self.step_gaps.total, *self.worker.core_time)

    def report(self) -> dict[str, float | int | str | None]:
        """What limited the pipeline since the last report: the window, the measured link rates,
        link and compute utilisation and the bottleneck (the `pipeline` event's fields)."""
        now = self._marks()
        (t0, c0, up0, down0, r0, a0, g0, cpu0, el0), self._report_mark = self._report_mark, now
        m, choice = self.estimator.measure(), self.choice
        use = utilisation(wall_s=now[0] - t0, up_bytes=now[2] - up0, down_bytes=now[3] - down0, up_rate=m.up_rate,
                          down_rate=m.down_rate, local_compute_s=now[1] - c0,
                          remote_compute_s=(now[4] - r0) * m.remote_compute)
        return {"window": choice.size, "window_needed": None if math.isinf(choice.needed) else round(choice.needed, 2),
                "window_limited_by": choice.limited_by, "max_in_flight": self.m.pipeline.max_in_flight,
                "bottleneck": use.bottleneck, "link_util": round(use.link, 3), "compute_util": round(use.compute, 3),
                "driver_compute_util": round(min(1.0, (now[1] - c0) / max(1e-9, now[0] - t0)), 3),
                "up_rate": m.up_rate, "down_rate": m.down_rate, "up_bytes_per_s": (now[2] - up0) / max(1e-9, now[0] - t0),
                "down_bytes_per_s": (now[3] - down0) / max(1e-9, now[0] - t0),
                "local_compute_s": round(m.local_compute, 4), "remote_s": round(m.remote_compute, 4),
                "latency_s": round(m.latency, 4), "interval_s": round(choice.interval, 4), "trip_s": round(choice.trip, 4),
                "samples": self.estimator.samples,
                "ahead_share": round((now[5] - a0) / (now[4] - r0), 3) if now[4] > r0 else 0.0,
                "step_gap_share": round(min(1.0, (now[6] - g0) / max(1e-9, now[0] - t0)), 3),
                "core_share": round(min(1.0, (now[7] - cpu0) / (now[8] - el0)), 3)
                if self.worker.device.type == "cpu" and now[8] > el0 else None,
                "routes": self._routes()}

    def _routes(self) -> dict[str, dict[str, float]]:
        """Where this report's training microbatches went (Downstream.routes)."""
        if self.downstream is None:
            return {}
        since, self._routes_mark = self._routes_mark, Counter(self.downstream.answered)
        return self.downstream.routes(since)

    async def _draw(self, slot: Slot) -> Batch:
        """A training batch of the size of the slot's place in its step."""
        assert self.stream is not None, "a driver without a stream is given its batches"
        size = self.sizes[slot.position % len(self.sizes)]
        take = getattr(self.stream, "take", None)
        return await take(size) if take is not None else self.stream.draw(size)

    async def _attempt(self, mb: int, attempt: int, pending: Pending, eval_only: bool) -> tuple[int, float, str, str]:
        """One trip through the pipeline: (status, loss, reason, failed peer)."""
        async with self.worker.admitted(wait=True, train=not eval_only, ahead=self._lookahead) as slot:
            if pending.batch is None:
                pending.batch = await self._draw(slot)
            inputs, targets = pending.batch
            if self.n_stages == 1:
                try:
                    loss, _ = await self.worker.forward_loss(inputs, targets, train=not eval_only)
                except NonFiniteLoss as e:
                    return pb.INTERNAL, math.nan, str(e), ""
                return pb.OK, loss, "", ""
            assert self.downstream is not None
            x, h = await self.worker.forward(inputs, train=not eval_only, slot=slot)
            started = time.monotonic()
            sent = targets if self.token_carry is None else self.token_carry.wire_targets(inputs, targets)
            hop, timing = await self._send(mb, attempt, h, sent, eval_only, slot.step,
                                           self._remaining(slot, eval_only))
            if hop.status != pb.OK:
                return hop.status, math.nan, hop.reason, hop.failed_peer
            self.deadlines.observe(time.monotonic() - started)
            if not eval_only:  # an evaluation's answer carries no gradient: not a training trip's bytes
                self._observe(hop, timing)
            if not eval_only:
                assert hop.grad is not None
                await self.worker.backward(x, h, hop.grad, inputs.shape[0], slot=slot)
                self.stats.ahead += int(slot.ahead)
                self.worker.record_loss(hop.loss)
                self._commit(hop.route, mb, attempt)
            return pb.OK, hop.loss, "", ""

    def _remaining(self, slot: Slot, eval_only: bool) -> int | None:
        """The microbatches of this one's inner step not sent yet, itself included: its place in
        its step (the next one's, for a microbatch admitted ahead) says how many went before.
        None for an evaluation: no step waits for it."""
        if eval_only:
            return None
        return max(1, self.m.inner.microbatches_per_step - slot.position)

    def _commit(self, route: str, mb: int, attempt: int) -> None:
        """The answer came back and our backward ran: let every replica of the route train on it
        (peer/compute/commits.py, commit on acknowledgement). In the background: the lane goes on."""
        assert self.downstream is not None
        peers = tuple(p for p in route.split(",") if p)
        task = asyncio.create_task(self.downstream.commit(peers, 1, mb, attempt, self.m.timeouts.commit),
                                   name=f"commit-{mb}")
        self._commits.add(task)

        def done(t: asyncio.Task) -> None:
            self._commits.discard(t)
            if t.cancelled():
                return
            if t.exception() is not None:  # a bug, not a network failure (those are counted)
                logger.error("commit of microbatch %d failed: %r", mb, t.exception())
                self.stats.commit_failures += len(peers)
            else:
                self.stats.commit_failures += len(peers) - t.result()

        task.add_done_callback(done)

    async def _through(self, pending: Pending, eval_only: bool, stop: asyncio.Event | None) -> float | None:
        mb = next(self._ids)
        attempt = 0
        waits = NOT_READY_BACKOFF.waits()
        quick = 0
        # Waiting on NOT_READY is not a failure, but an evaluation must not wait forever on a stage
        # that is gone (the final eval would hang the peer): eval microbatches give up after
        # timeouts.microbatch of waiting. Training ones wait for as long as the swarm assembles
        # (they stop with `stop`).
        wait_until = time.monotonic() + self.m.timeouts.microbatch
        while attempt < self.m.pipeline.max_retries:
            status, loss, reason, failed = await self._attempt(mb, attempt, pending, eval_only)
            if status == pb.OK:
                return loss
            if stop is not None and stop.is_set():
                return None
            if status == pb.NOT_READY and not (eval_only and time.monotonic() > wait_until):
                # a replica is between rounds (or none is there yet): not a failure. If a busy replica
                # was named, routing now passes it over, so try again at once; else back off.
                self.stats.not_ready_waits += 1
                quick += 1
                await asyncio.sleep(NOT_READY_QUICK_S if failed and quick <= 3 else next(waits))
                continue
            attempt += 1
            self.stats.retries += 1
            if failed:
                self.stats.failed_peers.add(failed)
            self.emit("retry", microbatch=mb, attempt=attempt, reason=reason[:200], failed_peer=failed)
            logger.info("microbatch %d attempt %d failed (%s); re-sending on another route", mb, attempt, reason[:120])
        self.stats.lost += 1
        self.emit("lost", microbatch=mb, attempts=attempt)
        logger.warning("microbatch %d given up after %d attempts", mb, attempt)
        return None

    async def train_microbatch(self, inputs: torch.Tensor, targets: torch.Tensor,
                               stop: asyncio.Event | None = None) -> float | None:
        """Train on this batch (retried like a lane's); its loss, or None if it was given up."""
        return await self._train(Pending((inputs, targets)), stop)

    async def _train(self, pending: Pending, stop: asyncio.Event | None) -> float | None:
        loss = await self._through(pending, eval_only=False, stop=stop)
        if loss is not None:
            self.stats.completed += 1
            self._observe_compute()
            await self.worker.maybe_step()
        return loss

    async def evaluate(self, batches: list[Batch]) -> float:
        """Mean validation loss in nats over `batches`, forward only, through the live pipeline."""
        losses = []
        for inputs, targets in batches:
            loss = await self._through(Pending((inputs, targets)), eval_only=True, stop=None)
            if loss is not None:
                losses.append(loss)
        return sum(losses) / len(losses) if losses else math.nan
