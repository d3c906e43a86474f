"""The pipeline: a stage server (stages ≥ 1) and the downstream client that drivers and
servers both use to hand a microbatch to the next stage.

A forward request stays open while the microbatch travels on: stage k runs forward, sends its
output to a replica of stage k+1 it picks (SWARM's stochastic wiring), gets back the gradient
w.r.t. that output, runs backward and answers with the gradient w.r.t. its own input. So
activations cross each boundary once, gradients come back along the same route, and backward
always runs on the replica that ran the forward (replicas drift between DiLoCo rounds).
A stage that cannot reach its next stage answers DOWNSTREAM_FAILED naming the failed peer; the
driver re-sends the microbatch along another route. A stage does not retry itself: one owner
(the driver) decides, so no microbatch is trained twice by two retry loops. And a stage trains on
a microbatch only when the driver commits it (peer/compute/commits.py): if an answer is lost and the
driver re-sends the microbatch elsewhere, the first route's gradients are dropped, not added.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Awaitable, Callable, TypeVar

import torch
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from swarmgrad.compression import Codec
from swarmgrad.peer.clock import RoundClock
from swarmgrad.peer.compute.lookahead import Slot
from swarmgrad.peer.model.subspace import TokenCarry
from swarmgrad.peer.pipeline.routing import (ANNOUNCED, MEASURED, BanList, Candidate, ReplicaMeter, choose_replica, intervals,
                                             next_back, route_deadline)
from swarmgrad.peer.net.rpc import REQUEST_READ_S, CallTiming, FramedRPC, RPCFailed, stage_namespace
from swarmgrad.peer.net.dht_view import SwarmView
from swarmgrad.peer.net.errors import BestEffort
from swarmgrad.peer.net.round_tickets import RoundSigner, VerifiedTickets
from swarmgrad.peer.records import ONLINE
from swarmgrad.peer.compute.worker import NonFiniteLoss, NotReady, StageWorker
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.framing import ProtocolError, status_name
from swarmgrad.protocol.responses import validate_forward_response
from swarmgrad.protocol.validation import (RunIdentity, StageContract, encoded_to_proto, envelope, narrow_integers,
                                           raw_from_tensor, validate_commit, validate_forward)

logger = logging.getLogger(__name__)

M = TypeVar("M")

DEADLINE_FACTOR = 4.0
"""A driver's deadline for a microbatch is at least this × when its replica is expected to return it
(DeadlineEstimator's factor over the recent p90 trip)."""

NOT_READY_DEFER_SECONDS = 1.0
"""How long a replica that answered NOT_READY (between rounds) is passed over by routing."""


@dataclass(frozen=True)
class Hop:
    """What came back from the next stage."""
    status: int
    reason: str = ""
    loss: float = math.nan
    n_targets: int = 0
    grad: torch.Tensor | None = None
    failed_peer: str = ""
    route: str = ""
    request_s: float = 0.0
    """What the next stage reported: seconds our request took to reach it, first frame to last."""
    serve_s: float = 0.0
    """What the next stage reported: seconds from our whole request to its answer."""


def _fp32_on_cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float32)


class Downstream:
    """Sends microbatches to the next stage: replica choice, bans, queue counts, validation of answers."""

    def __init__(self, identity: RunIdentity, rpc: FramedRPC, swarm: SwarmView, bans: BanList,
                 activation_codec: Codec, max_numel: int, refresh_seconds: float = 1.0, seed: int | None = None,
                 gradient_codecs: frozenset[str] | None = None, self_id: str | None = None,
                 boundary: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 signer: RoundSigner | None = None, routing: str = ANNOUNCED, max_deadline_s: float = 30.0):
        """`boundary`: what an activation becomes before its codec (Precision.boundary: the CPU,
        float32, holding values of the compute dtype); default: the CPU in float32. `routing`:
        pipeline.routing (peer/pipeline/routing.py). `max_deadline_s`: timeouts.microbatch, the
        most a driver's deadline is stretched to for a slow replica (routing.route_deadline)."""
        self.identity = identity
        self.routing = routing
        self.max_deadline_s = max_deadline_s
        self.meter = ReplicaMeter()
        """What our answered microbatches measured of each replica (the weights of `measured` routing)."""
        self.answered: Counter[str] = Counter()
        """Training microbatches each replica answered, ever (the driver's `routes` report)."""
        self.boundary = boundary or _fp32_on_cpu
        self.signer = signer
        """A driver's: signs the round ticket its own requests carry (peer/net/round_tickets.py).
        None at later stages, which relay the ticket that came with the request."""
        self.self_id = self_id
        """This peer's id: never a candidate. A peer moving from stage s to s + 1 runs both
        replicas for a while, and libp2p cannot dial itself ("dial to self attempted")."""
        self.gradient_codecs = gradient_codecs
        """Codecs the next stage may answer gradients in (the manifest's gradient codec); None: any."""
        self.rpc = rpc
        self.swarm = swarm
        self.bans = bans
        self.codec = activation_codec
        self.max_numel = max_numel
        self.refresh_seconds = refresh_seconds
        self.in_flight: dict[str, int] = {}
        self.rng = random.Random(seed)
        self._cache: dict[int, tuple[float, list[Candidate]]] = {}
        self._stage_rpcs: dict[int, FramedRPC] = {}
        self._reading: dict[int, BestEffort] = {}

    async def candidates(self, stage: int) -> list[Candidate]:
        """The ONLINE replicas of `stage` (not us), re-read at most every `refresh_seconds`; when the
        DHT is slow or gone, the last list rather than a failure."""
        now = time.monotonic()
        cached = self._cache.get(stage)
        if cached is None or now - cached[0] > self.refresh_seconds:
            reading = self._reading.get(stage)
            if reading is None:
                reading = self._reading[stage] = BestEffort(f"refreshing the replicas of stage {stage}", logger)
            found = cached[1] if cached else []
            with reading:
                records = await self.swarm.stage_records(stage)
                found = [Candidate(r.peer_id, r.throughput) for r in records
                         if r.state == ONLINE and r.peer_id != self.self_id]
            cached = (now, found)
            self._cache[stage] = cached
        return cached[1]

    async def encode(self, output: torch.Tensor) -> pb.EncodedTensor:
        """`output` in the activation codec, encoded off the event loop: a heavy codec (low-rank,
        rotations) must not hold up the bytes of requests and answers already on their way."""
        return await asyncio.get_running_loop().run_in_executor(
            None, lambda: encoded_to_proto(self.codec.encode(self.boundary(output))))

    async def forward(self, stage: int, output: torch.Tensor, targets: torch.Tensor, microbatch_id: int,
                      attempt: int, driver: str, deadline: float, eval_only: bool, round_no: int,
                      timing: CallTiming | None = None, encoded: pb.EncodedTensor | None = None,
                      round_ticket: bytes | None = None, remaining: int | None = None,
                      explore: bool = True) -> Hop:
        """Send a microbatch to a replica of `stage` and wait for its answer. `encoded`: `output`
        already encoded (by `encode`); `timing`, if given, is filled in by the call (the driver
        paces its sends and estimates its link with it). `round_ticket`: the one the request
        being relayed came with; None: our signer's for `round_no` (a driver's own requests).
        `remaining`: the microbatches of the sender's inner step not sent yet, this one included
        (None: not known); with `measured` routing a step's last ones go where they come back
        first, and only a microbatch that may `explore` probes a replica not measured yet
        (routing.choose_replica)."""
        now = time.monotonic()
        candidates = await self.candidates(stage)
        if self.routing == MEASURED:
            candidates = self.meter.measured(candidates, now)
        else:
            remaining = None
        batch = int(output.shape[0]) if output.dim() else 1
        peer = choose_replica(candidates, self.in_flight, self.bans.banned(now), self.rng, remaining=remaining,
                              batch=batch, explore=explore)
        if peer is None:
            return Hop(pb.NOT_READY, f"no reachable replica of stage {stage}", failed_peer="")
        if self.routing == MEASURED and round_ticket is None and any(c.measured for c in candidates):
            # our own request (a relayed one keeps its driver's deadline): give a slow replica its time
            back = next_back(candidates, self.in_flight, intervals(candidates, batch))[peer]
            deadline = route_deadline(deadline, get_dht_time(), back, DEADLINE_FACTOR, self.max_deadline_s)
        activations = encoded if encoded is not None else await self.encode(output)
        if round_ticket is None:
            round_ticket = self.signer.ticket(round_no) if self.signer is not None else b""
        request = pb.ForwardRequest(
            envelope=envelope(self.identity, stage), microbatch_id=microbatch_id, attempt=attempt, driver=driver,
            activations=activations, targets=raw_from_tensor(narrow_integers(targets)), deadline=deadline, eval_only=eval_only,
            round=round_no, round_ticket=round_ticket)
        timing = timing if timing is not None else CallTiming()
        self.in_flight[peer] = self.in_flight.get(peer, 0) + 1
        try:
            response = await self.rpc.call(peer, "forward", request, pb.ForwardResponse,
                                           timeout=max(0.1, deadline - get_dht_time()), timing=timing)
        except RPCFailed as e:
            self.bans.ban(peer, time.monotonic())
            return Hop(pb.DOWNSTREAM_FAILED, str(e), failed_peer=peer)
        finally:
            self.in_flight[peer] -= 1
        hop = self._check(peer, response, tuple(output.shape), eval_only)
        if hop.status == pb.OK and not eval_only:
            self._measure(peer, hop, timing)
        return hop

    def _measure(self, peer: str, hop: Hop, timing: CallTiming) -> None:
        """A training microbatch's answer: what it says of that replica's route (an evaluation's
        answer carries no gradient, so its bytes say nothing of a training trip's)."""
        self.answered[peer] += 1
        if not (timing.started and timing.done):
            return
        self.meter.observe(peer, time.monotonic(), request_bytes=timing.request_bytes,
                           response_bytes=timing.response_bytes, trip_s=timing.done - timing.started,
                           request_s=hop.request_s, serve_s=hop.serve_s,
                           response_s=timing.done - timing.first_byte if timing.first_byte else 0.0,
                           answered_at=timing.first_byte or timing.done)

    async def commit(self, route: tuple[str, ...], first_stage: int, microbatch_id: int, attempt: int,
                     timeout: float) -> int:
        """Commit a microbatch on every replica of its route (route[i] serves stage first_stage + i),
        in parallel. Returns how many replicas trained on it; a failed commit is logged (that
        replica drops the microbatch after timeouts.commit: lost there, never trained twice)."""
        async def one(stage: int, peer: str) -> int:
            request = pb.CommitRequest(envelope=envelope(self.identity, stage), microbatch_ids=[microbatch_id],
                                       attempts=[attempt])
            try:
                response = await self._rpc_for(stage).call(peer, "commit", request, pb.CommitResponse, timeout)
            except RPCFailed as e:
                logger.info("commit of microbatch %d on %s failed: %s", microbatch_id, peer[-8:], e)
                return 0
            if response.status != pb.OK or response.committed != 1:
                logger.info("commit of microbatch %d on %s: %s %s (committed %d)", microbatch_id, peer[-8:],
                            status_name(response.status), response.reason[:120], response.committed)
            return int(response.status == pb.OK and response.committed == 1)
        results = await asyncio.gather(*(one(first_stage + i, peer) for i, peer in enumerate(route)))
        return sum(results)

    def routes(self, since: Counter[str]) -> dict[str, dict[str, float]]:
        """Per replica (the last 8 characters of its id), the share of our training microbatches it
        answered since `since` (a copy of `answered`), and its measured link_s and trip_s."""
        now, answered = time.monotonic(), self.answered - since
        total = sum(answered.values())
        out = {}
        for peer, count in sorted(answered.items()):
            link, trip = self.meter.figures(peer, now)
            out[peer[-8:]] = {"share": round(count / total, 3), "link_s": round(link, 4), "trip_s": round(trip, 4)}
        return out

    def _rpc_for(self, stage: int) -> FramedRPC:
        """A client of `stage`'s handlers (commits go to every stage of a route, not only the next)."""
        if stage not in self._stage_rpcs:
            rpc = self.rpc
            if rpc.namespace == stage_namespace(self.identity.run_id, stage):  # the next stage: ours
                return rpc
            self._stage_rpcs[stage] = FramedRPC(rpc.p2p, stage_namespace(self.identity.run_id, stage), rpc.traffic,
                                                rpc.max_message_bytes)
        return self._stage_rpcs[stage]

    def _check(self, peer: str, response: pb.ForwardResponse, shape: tuple[int, ...], eval_only: bool) -> Hop:
        now = time.monotonic()
        try:
            res = validate_forward_response(response, shape, eval_only, self.max_numel, self.gradient_codecs)
        except ProtocolError as e:  # a reply that fails a check is a failed call, like a dead peer
            self.bans.ban(peer, now)
            return Hop(pb.DOWNSTREAM_FAILED, f"bad answer from {peer[-8:]}: {e.reason}", failed_peer=peer)
        route = ",".join((peer, *res.route))
        if res.status in (pb.NOT_READY, pb.BUSY, pb.WRONG_ROUND):
            # busy, between rounds, or a round behind and catching up: pass it over for a moment,
            # it has not failed (counting these as failures lost microbatches in the chaos soak)
            busy = res.failed_peer or peer
            if busy == peer:  # this replica itself is between rounds (or full): try its siblings first
                self.bans.defer(peer, now, NOT_READY_DEFER_SECONDS)
            return Hop(pb.NOT_READY, res.reason, failed_peer=busy)
        if not res.ok:
            failed = res.failed_peer if res.status == pb.DOWNSTREAM_FAILED and res.failed_peer else peer
            self.bans.ban(failed, now)
            return Hop(pb.DOWNSTREAM_FAILED, f"{status_name(res.status)}: {res.reason}", failed_peer=failed)
        self.bans.succeeded(peer)
        return Hop(pb.OK, loss=res.loss, n_targets=res.n_targets, grad=res.grad, route=route,
                   request_s=res.request_s, serve_s=res.serve_s)


class StageServer:
    """Serves forward requests for one stage ≥ 1 replica."""

    def __init__(self, identity: RunIdentity, contract: StageContract, worker: StageWorker,
                 downstream: Downstream | None, gradient_codec: Codec, max_numel: int, clock: RoundClock, *,
                 activation_codecs: frozenset[str] | None = None, max_deadline_s: float = 30.0,
                 drivers: Callable[[str], Awaitable[bool]] | None = None, lookahead: bool = False,
                 hold_s: float = 0.0, boundary: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 tickets: VerifiedTickets | None = None, token_carry: TokenCarry | None = None):
        self.identity = identity
        self.token_carry = token_carry
        """Set when the module needs the token ids (StagedModel.token_carry): its input is built from
        the activations and the targets that came, and the gradient sent back is z's alone."""
        self.boundary = boundary or _fp32_on_cpu
        """What a gradient sent upstream becomes before its codec (as Downstream.boundary)."""
        self.hold_s = hold_s
        """timeouts.between_rounds: how long a request of the next round, arriving while this
        replica ends its round, waits for it to resume. Refused at once (NOT_READY), the driver would
        send its activations again after a pause (the reply defers this replica for
        NOT_READY_DEFER_SECONDS), and this replica would start the next round idle, waiting for the
        re-sent request to arrive."""
        self.lookahead = lookahead
        """pipeline.lookahead: take the next step's microbatches while this step waits for its
        commits (peer/compute/lookahead.py)."""
        self.drivers = drivers
        """Whether a peer id is a driver listed in the stage-0 records (DriverList.listed): only
        such a driver's round may end ours. None: any (tests without a swarm)."""
        self.tickets = tickets
        """Checks the round ticket of a request of a later round than ours (peer/net/round_tickets.py):
        only the driver's own signature may end our round. None: not checked (tests without keys)."""
        self.activation_codecs = activation_codecs
        """Codecs the previous stage may send activations in (the manifest's); None: any."""
        self.max_deadline_s = max_deadline_s
        """A request's deadline is capped at now + this (timeouts.microbatch): nobody makes us hold
        a microbatch's graph for longer than a microbatch may take."""
        self.contract = contract
        self.worker = worker
        self.downstream = downstream
        self.codec = gradient_codec
        self.max_numel = max_numel
        self.clock = clock
        """A request of a later round than ours makes us end ours first (and answer NOT_READY meanwhile)."""
        self.served = 0
        self.refused = 0

    @property
    def last(self) -> bool:
        return self.contract.stage == self.contract.n_stages - 1

    async def handle(self, request: pb.ForwardRequest, caller: PeerID) -> pb.ForwardResponse:
        """Serve one forward request; an OK answer says how long the request took to arrive and
        how long we took from there (the driver's link estimate, peer/pipeline/window.py)."""
        read_s, started = REQUEST_READ_S.get(), time.monotonic()
        response = await self._handle(request)
        if response.status == pb.OK:
            response.request_s, response.serve_s = read_s, time.monotonic() - started
        return response

    async def _handle(self, request: pb.ForwardRequest) -> pb.ForwardResponse:
        inp = validate_forward(request, self.identity, self.contract, self.max_numel,
                               allowed_codecs=self.activation_codecs)
        now = get_dht_time()
        if now > inp.deadline:
            raise ProtocolError(pb.DEADLINE_EXCEEDED, "the microbatch's deadline has passed")
        if inp.deadline > now + self.max_deadline_s:
            inp = dataclasses.replace(inp, deadline=now + self.max_deadline_s)
        train = not inp.eval_only
        if inp.round > self.clock.current + 1:
            # a request may move a replica at most one round ahead: a made-up round number must
            # not make us skip rounds (and everyone who follows us)
            raise ProtocolError(pb.WRONG_ROUND, f"round {inp.round} is more than one round ahead of ours "
                                                f"({self.clock.current})")
        if inp.round > self.clock.current and self.tickets is not None and (
                why := self.tickets.refusal(inp.driver, inp.round, inp.round_ticket)) is not None:
            # the `driver` field is the sender's word; the ticket is the driver's: checked first, as
            # it needs no DHT read
            raise ProtocolError(pb.WRONG_ROUND, f"round {inp.round} is ahead of ours ({self.clock.current}) and the "
                                                f"request {why}")
        if inp.round > self.clock.current and self.drivers is not None and not await self.drivers(inp.driver):
            # a later round ends ours only on the word of a driver the swarm lists: anyone else
            # could otherwise cut every replica's rounds short with one request each
            raise ProtocolError(pb.WRONG_ROUND, f"round {inp.round} is ahead of ours ({self.clock.current}) and "
                                                f"{inp.driver[-8:]} is not a driver of this run")
        ending = self.clock.observe(inp.round)  # a later round than ours: ours ends first
        # Hold a request of the next round until ours is over rather than refuse it, but leave it at
        # least half of its deadline for the trip after the wait. A late one of our own round is
        # refused at once: its driver holds a place in flight for it, and holding it here
        # would keep that driver from pausing for its own round boundary until we resume.
        hold = max(0.0, min(self.hold_s, (inp.deadline - get_dht_time()) / 2)) if ending else 0.0
        try:
            async with self.worker.admitted(wait=False, train=train, ahead=self.lookahead, hold=hold,
                                            round_no=inp.round if ending else None) as slot:
                response = await self._serve(inp, train, slot)
        except NotReady as e:
            self.refused += 1
            return pb.ForwardResponse(status=pb.NOT_READY, reason=str(e))
        except NonFiniteLoss as e:  # our model diverged on this input: not trained, the driver retries elsewhere
            self.refused += 1
            return pb.ForwardResponse(status=pb.INTERNAL, reason=str(e))
        if train and response.status == pb.OK:
            self.served += 1
        return response

    async def commit(self, request: pb.CommitRequest, caller: PeerID) -> pb.CommitResponse:
        """The driver got these microbatches' answers: train on them here (peer/compute/commits.py)."""
        keys = validate_commit(request, self.identity, self.contract.stage, str(caller))
        committed = await self.worker.commit(keys)
        if committed:
            await self.worker.maybe_step()
        return pb.CommitResponse(status=pb.OK, committed=committed)

    def _grad_message(self, grad_x: torch.Tensor) -> pb.EncodedTensor:
        if self.token_carry is not None:
            grad_x = self.token_carry.input_grad(grad_x)
        return encoded_to_proto(self.codec.encode(self.boundary(grad_x)))

    async def _serve(self, inp, train: bool, slot: Slot) -> pb.ForwardResponse:
        batch = inp.activations.shape[0]
        key = (inp.driver, inp.microbatch_id, inp.attempt)
        x_in = (inp.activations if self.token_carry is None
                else self.token_carry.stage_input(inp.activations, inp.targets))
        if self.last:
            if train:
                loss, grad_x = await self.worker.forward_loss_held(key, x_in, inp.targets, slot)
            else:
                loss, grad_x = await self.worker.forward_loss(x_in, inp.targets, False)
            response = pb.ForwardResponse(status=pb.OK, loss=loss, n_targets=inp.targets.numel())
            if grad_x is not None:
                response.grad_input.CopyFrom(self._grad_message(grad_x))
            return response
        assert self.downstream is not None
        x, y = await self.worker.forward(x_in, train, slot)
        hop = await self.downstream.forward(self.contract.stage + 1, y, inp.targets, inp.microbatch_id, inp.attempt,
                                            inp.driver, inp.deadline, inp.eval_only, inp.round,
                                            round_ticket=inp.round_ticket)
        if hop.status != pb.OK:
            status = pb.NOT_READY if hop.status == pb.NOT_READY else pb.DOWNSTREAM_FAILED
            return pb.ForwardResponse(status=status, reason=hop.reason, failed_peer=hop.failed_peer)
        response = pb.ForwardResponse(status=pb.OK, loss=hop.loss, n_targets=hop.n_targets, route=hop.route)
        if train:
            assert hop.grad is not None
            grad_x = await self.worker.backward_held(key, x, y, hop.grad, batch, hop.loss, slot)
            assert grad_x is not None
            response.grad_input.CopyFrom(self._grad_message(grad_x))
        return response


class DriverList:
    """The drivers (stage-0 replicas) the DHT lists, cached for `refresh_s`; a peer not in the
    cache triggers one re-read, at most every `refresh_s` (a driver that just joined is listed
    before it sends anything: it announces, then waits for the pipeline). Callers that arrive while
    a read is under way wait for it instead of answering from the list it is replacing: a driver's
    first requests of a round come back to back, and all but the first were refused otherwise."""

    def __init__(self, swarm: SwarmView, refresh_s: float = 2.0):
        self.swarm = swarm
        self.refresh_s = refresh_s
        self._ids: frozenset[str] = frozenset()
        self._read_at = -1e9
        self._reading = asyncio.Lock()
        self._listing = BestEffort("reading the drivers' records", logger)

    async def listed(self, peer_id: str) -> bool:
        if peer_id in self._ids:
            return True
        async with self._reading:
            if peer_id not in self._ids and time.monotonic() - self._read_at >= self.refresh_s:
                try:
                    with self._listing:  # a slow DHT: keep the last list
                        self._ids = frozenset(r.peer_id for r in await self.swarm.stage_records(0))
                finally:
                    self._read_at = time.monotonic()
        return peer_id in self._ids


def refusal(response_type: type[M]) -> Callable[[int, str], M]:
    """How a handler of `response_type` refuses: the response with a status and a reason."""
    def make(status: int, reason: str) -> M:
        return response_type(status=status, reason=reason)
    return make


async def wait_for_pipeline(swarm: SwarmView, n_stages: int, timeout: float, poll: float = 0.5) -> bool:
    """True once every stage has an ONLINE replica (drivers wait for this before sending); False
    after `timeout`."""
    deadline = time.monotonic() + timeout
    reading = BestEffort("reading the swarm while waiting for the pipeline", logger)
    while time.monotonic() < deadline:
        with reading:
            view = await swarm.swarm()
            if all(any(r.state == ONLINE for r in view.get(s, [])) for s in range(1, n_stages)):
                return True
        await asyncio.sleep(poll)
    return False
