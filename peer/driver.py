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
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from hivemind.utils import get_dht_time

from swarmgrad.peer.clock import RoundClock
from swarmgrad.peer.manifest import Manifest
from swarmgrad.peer.pipeline import Downstream
from swarmgrad.peer.routing import DeadlineEstimator
from swarmgrad.peer.worker import NonFiniteLoss, StageWorker
from swarmgrad.protocol import wire_pb2 as pb

logger = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class DriverStats:
    completed: int = 0
    retries: int = 0
    lost: int = 0
    not_ready_waits: int = 0
    commit_failures: int = 0
    """Replicas a commit did not reach: they dropped that microbatch (lost there, not trained twice)."""
    failed_peers: set[str] = field(default_factory=set)


class Driver:
    def __init__(self, manifest: Manifest, worker: StageWorker, downstream: Downstream | None, peer_id: str,
                 n_stages: int, stream: Iterator[Batch], emit: Callable[..., None], clock: RoundClock):
        self.m = manifest
        self.worker = worker
        self.downstream = downstream
        self.peer_id = peer_id
        self.n_stages = n_stages
        self.stream = stream
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
        """True once the driver is sending training microbatches."""

    async def run(self, stop: asyncio.Event) -> None:
        """Keep pipeline.max_in_flight microbatches going until `stop` is set."""
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
        while not stop.is_set():
            inputs, targets = next(self.stream)
            await self.train_microbatch(inputs, targets, stop)

    async def _attempt(self, mb: int, attempt: int, inputs: torch.Tensor, targets: torch.Tensor,
                       eval_only: bool) -> tuple[int, float, str, str]:
        """One trip through the pipeline: (status, loss, reason, failed peer)."""
        async with self.worker.admitted(wait=True, train=not eval_only):
            if self.n_stages == 1:
                try:
                    loss, _ = await self.worker.forward_loss(inputs, targets, train=not eval_only)
                except NonFiniteLoss as e:
                    return pb.INTERNAL, math.nan, str(e), ""
                return pb.OK, loss, "", ""
            assert self.downstream is not None
            x, h = await self.worker.forward(inputs, train=not eval_only)
            started = time.monotonic()
            hop = await self.downstream.forward(1, h, targets, mb, attempt, self.peer_id,
                                                get_dht_time() + self.deadlines.deadline(), eval_only, self.clock.current)
            if hop.status != pb.OK:
                return hop.status, math.nan, hop.reason, hop.failed_peer
            self.deadlines.observe(time.monotonic() - started)
            if not eval_only:
                assert hop.grad is not None
                await self.worker.backward(x, h, hop.grad, inputs.shape[0])
                self.worker.record_loss(hop.loss)
                self._commit(hop.route, mb, attempt)
            return pb.OK, hop.loss, "", ""

    def _commit(self, route: str, mb: int, attempt: int) -> None:
        """The answer came back and our backward ran: let every replica of the route train on it
        (peer/worker.py, commit on acknowledgement). In the background: the lane goes on."""
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

    async def _through(self, inputs: torch.Tensor, targets: torch.Tensor, eval_only: bool,
                       stop: asyncio.Event | None) -> float | None:
        mb = next(self._ids)
        attempt = 0
        backoff = 0.2
        quick = 0
        # Waiting on NOT_READY is not a failure, but an evaluation must not wait forever on a stage
        # that is gone (the final eval would hang the peer): eval microbatches give up after
        # timeouts.microbatch of waiting. Training ones wait for as long as the swarm assembles
        # (they stop with `stop`).
        wait_until = time.monotonic() + self.m.timeouts.microbatch
        while attempt < self.m.pipeline.max_retries:
            status, loss, reason, failed = await self._attempt(mb, attempt, inputs, targets, eval_only)
            if status == pb.OK:
                return loss
            if stop is not None and stop.is_set():
                return None
            if status == pb.NOT_READY and not (eval_only and time.monotonic() > wait_until):
                # a replica is between rounds (or none is there yet): not a failure. If a busy replica
                # was named, routing now passes it over, so try again at once; else back off.
                self.stats.not_ready_waits += 1
                quick += 1
                if failed and quick <= 3:
                    await asyncio.sleep(0.02)
                else:
                    await asyncio.sleep(backoff)
                    backoff = min(1.0, backoff * 1.5)
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
        loss = await self._through(inputs, targets, eval_only=False, stop=stop)
        if loss is not None:
            self.stats.completed += 1
            await self.worker.maybe_step()
        return loss

    async def evaluate(self, batches: list[Batch]) -> float:
        """Mean validation loss in nats over `batches`, forward only, through the live pipeline."""
        losses = []
        for inputs, targets in batches:
            loss = await self._through(inputs, targets, eval_only=True, stop=None)
            if loss is not None:
                losses.append(loss)
        return sum(losses) / len(losses) if losses else math.nan
