"""Outer rounds (DiLoCo) for one stage group, built on hivemind's DHT and P2P layer.

A round r of stage s, on every replica:
1. matchmaking: register (digest, applied rounds, weight) under {run}/round/{s}/{r}; wait until
   every ONLINE replica of the stage has registered (or `patience`: timeouts.matchmaking, longer in
   H-step rounds where replicas reach the boundary at different times); the group is the
   registrants whose θ_global digest is the reference one (newest, then most common)
   (peer/averaging/matchmaking.py; a member whose last round completed sends its parts to that group
   meanwhile, and a reducer holds them until its own matchmaking is done);
2. reduce-scatter: the stage's tensors are split into one part per member (`partition`); member
   j reduces part j. Each member encodes its pseudo-gradient Δ once (codec, optional error
   feedback) and sends every reducer its part; the reducer waits for all members, takes the
   weighted mean of the *decoded* contributions in sorted member order, encodes it with the
   codec's reduce codec (compression.reduce_codec: for a sparse codec, every non-zero of the
   mean, i.e. the union of the members' supports, so nothing a member sent is cut again where
   no error feedback would carry it), and answers every member with the same bytes;
   (a group of at most averaging.gather_up_to members skips the mean: the reducer forwards the
   other members' encoded parts and every member aggregates them itself, peer/averaging/gather.py);
3. every member decodes the same bytes for every part (the reducer too: it applies the decoded
   value it sent, not its own unrounded one), so θ_global ← OuterOpt(θ_global, mean Δ) is
   bit-identical on all members.
   (This file is the member's side; the reducer's, the slots and the `average` handler, is
   peer/averaging/reducer.py.) With averaging.verify every part is signed by its member, the
   reducer forwards the signed parts with its answer, and every member recomputes each mean from
   them before it counts it (peer/averaging/verify.py): a reducer cannot choose its part's mean.
4. outcome vote (peer/averaging/outcome.py): every member posts its group's hash and the digest of the
   mean it decoded, or failed, and applies the round only once every member voted exactly that.
   A member that fails a part (a refusal, a reset stream, a timeout) votes failed at once and
   stops waiting for its other parts, and every member watches the votes while its parts are on
   the way, so one member's failure ends the round for the group within a poll instead of after
   timeouts.allreduce, and no member applies a round another member failed (a split outcome).
A round is complete only if every part came back with the full group as contributors and every
member voted the same digest. Anything less is a failed round, logged as such: nobody applies a
partial mean. A member that vanished fails the round for the others after at most `patience` +
timeouts.allreduce.

hivemind's DecentralizedAverager is not used: it returns partial results with only a warning,
lets each peer apply local + Q(avg − local), and its codec set is a closed enum (see the primer).
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarmgrad.compression import Encoded, ErrorFeedback, SizeAdaptive, decode, get_codec, parse_codec_spec
from swarmgrad.peer.averaging.aggregate import bound_weights
from swarmgrad.peer.averaging.group import Group, partition
from swarmgrad.peer.averaging import exclusion, outcome
from swarmgrad.peer.clock import RoundClock
from swarmgrad.peer.evidence import EvidenceLedger
from swarmgrad.peer.net.deadline import within
from swarmgrad.peer.averaging.gather import aggregate_gathered, gathers
from swarmgrad.peer.averaging.signed_parts import sign_part
from swarmgrad.peer.averaging.verify import Forged, PartChecker
from swarmgrad.peer.manifest import Manifest
from swarmgrad.peer.averaging.matchmaking import matchmake
from swarmgrad.peer.averaging.reducer import Reducer, RoundSlot
from swarmgrad.peer.net.rpc import FramedRPC, RPCFailed
from swarmgrad.peer.net.dht_view import SwarmView
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.framing import ProtocolError
from swarmgrad.protocol.codecs import averaging_codecs
from swarmgrad.protocol.framing import status_name
from swarmgrad.protocol.responses import AverageResult, validate_average_response, validate_gather_response
from swarmgrad.protocol.validation import RunIdentity, encoded_to_proto, envelope

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundResult:
    complete: bool
    reason: str
    group: tuple[str, ...]
    mean_delta: dict[str, torch.Tensor] | None
    stale: bool = False
    """This replica's θ_global was not the group's reference: it must re-sync."""
    total_weight: float = 0.0
    """Samples the whole group trained on this round; 0 means nobody trained, so nobody steps."""
    unreachable: tuple[str, ...] = ()
    """Members that did not answer at all (dead or cut off): a re-sync does not wait for them."""
    voted_digest: bool = False
    """This member voted for the mean (or may have: its vote's write failed). A failed round with a
    digest vote may have been applied by members that read every vote; otherwise (we voted
    failed, or never voted) no member of our group applied it."""
    forged: tuple[str, ...] = ()
    """Reducers whose answer this member showed false itself (averaging.verify): a mean that is not
    the aggregate of the signed parts they forwarded, or a part not signed by its member."""
    blamed: tuple[str, ...] = ()
    """Members this replica holds responsible for the round's failure, from what it observed
    itself (peer/averaging/exclusion.py `blame`): they sit out the next rounds' groups."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds of the round's phases that ran: `matchmaking` (Δ is encoded meanwhile), `exchange`
    (what is left of the encoding, the parts, combine), `vote` (where an averaging round's time
    goes; the round event reports them)."""


class Averager:
    """Runs outer rounds for one stage replica (the member's side); its `reducer` serves the others' parts."""

    def __init__(self, manifest: Manifest, stage: int, peer_id: str, shapes: dict[str, tuple[int, ...]],
                 rpc: FramedRPC, swarm: SwarmView, max_numel: int, clock: RoundClock,
                 key: Ed25519PrivateKey | None = None):
        """`key`: this peer's identity key (its id's private half); averaging.verify signs parts with it."""
        if manifest.averaging.verify and key is None:
            raise ValueError("averaging.verify needs the peer's key to sign its parts")
        self.m = manifest
        self.key = key
        self.stage = stage
        self.peer_id = peer_id
        self.shapes = shapes
        self.rpc = rpc
        self.swarm = swarm
        self.max_numel = max_numel
        self.identity = RunIdentity(manifest.run_id, manifest.hash)
        avg = manifest.averaging
        large = parse_codec_spec(avg.codec)
        self.codec = SizeAdaptive(avg.small_tensor_threshold, get_codec("fp32"), large)
        self.feedback = ErrorFeedback(self.codec, avg.feedback_decay) if avg.error_feedback else None
        self.reducer = Reducer(manifest, stage, self.identity, self.codec, max_numel, clock)
        """The reducer's side: the rounds' slots and the `average` handler (peer/averaging/reducer.py)."""
        self.mean_codecs = averaging_codecs(avg.codec, avg.small_tensor_threshold, mean=True,
                                            reducer_feedback=avg.reducer_feedback)
        """The reducer's answers come in the reduce codec's names."""
        self.gather_up_to = avg.gather_up_to
        """Groups this small exchange the members' own parts instead of a mean (peer/averaging/gather.py)."""
        self.verify = avg.verify
        """Sign our parts, and check every part we apply against the signed parts it came from."""
        self.checker = PartChecker(self.identity, stage, peer_id, max_numel, self.reducer.allowed_codecs,
                                   self.mean_codecs, self.reducer.reduce_codec, avg.gather_up_to,
                                   avg.robust_min_members, avg.max_weight_ratio)
        """How that check is made (peer/averaging/verify.py)."""
        self.ledger = EvidenceLedger(stage)
        """Whose word counts in this stage (peer/evidence.py): fed by the round runner (rounds
        applied) and state sync (states verified); read by matchmaking, donors and re-syncs."""
        self._last_members: tuple[str, ...] = ()
        """The members of our last round if it completed: this round's parts go to them early."""
        self.standings: dict[str, exclusion.Standing] = {}
        """What this replica holds against other members (peer/averaging/exclusion.py): those
        excluded for a round have their registrations dropped before its group is chosen."""

    @property
    def patience(self) -> float:
        """How long matchmaking waits for every online replica to register (the round runner
        raises it in H-step rounds, see decisions.matchmaking_patience); the reducer holds the
        others' requests as long."""
        return self.reducer.patience

    @patience.setter
    def patience(self, seconds: float) -> None:
        self.reducer.patience = seconds

    def reset_feedback(self) -> None:
        """Forget error-feedback residuals: after adopting another replica's θ_global, what our codec
        dropped from our own (discarded) updates no longer belongs to the state we continue from."""
        for feedback in (self.feedback, self.reducer.feedback):
            if feedback is not None:
                feedback.reset()

    # the member's side ------------------------------------------------------------------------
    async def matchmake(self, round_no: int, registration: dict[str, Any]
                        ) -> tuple[Group | None, dict[str, float], str]:
        """peer/averaging/matchmaking.py for our stage; requests for the round knock on its slot."""
        return await matchmake(self.swarm, self.stage, round_no, self.peer_id, registration, self.patience,
                               self.reducer.slot(round_no).knock,
                               exclude=exclusion.excluded(self.standings, round_no) - {self.peer_id},
                               evidence=self.ledger.snapshot())

    def _encode_delta(self, delta: dict[str, torch.Tensor]) -> tuple[dict[str, Encoded], dict[str, torch.Tensor]]:
        """Δ encoded, and the decodes error feedback computed on the way (none without it): our own
        contribution must be the value the others decode, not the unrounded one (`_own_decoded`)."""
        if self.feedback is None:
            return {name: self.codec.encode(delta[name]) for name in sorted(delta)}, {}
        encoded, decoded = {}, {}
        for name in sorted(delta):
            encoded[name], decoded[name] = self.feedback.encode_decoded(name, delta[name])
        return encoded, decoded

    @staticmethod
    def _own_decoded(names: Iterable[str], encoded: dict[str, Encoded], decoded: dict[str, torch.Tensor]
                     ) -> dict[str, torch.Tensor]:
        """Our Δ of `names` as every member decodes it: error feedback's decode where it made one,
        else decoded here (and kept, so a tensor is decoded once)."""
        for name in names:
            if name not in decoded:
                decoded[name] = decode(encoded[name])
        return {name: decoded[name] for name in names}

    async def run_round(self, round_no: int, delta: dict[str, torch.Tensor], weight: float, digest: str,
                        applied_rounds: int) -> RoundResult:
        """Average `delta` with the stage group; the returned mean is what every member applies."""
        registration = {"digest": digest, "applied_rounds": applied_rounds, "weight": float(weight)}
        # a round that does not complete must leave the residuals as they were: otherwise this
        # round's Δ stays in them and is sent again later, on top of the next round's
        # (likewise a reducer's: a round nobody applied must not use up what its residual held)
        saved = [(f, f.state_dict()) for f in (self.feedback, self.reducer.feedback) if f is not None]
        # Δ is encoded while matchmaking waits on the DHT (the encoding does not depend on the
        # group): the member that reaches the boundary last does not encode after it
        encoding = asyncio.get_running_loop().run_in_executor(None, self._encode_delta, delta)
        # Every member sends its parts to last round's group as soon as they are encoded, while
        # matchmaking runs: the first member's bytes are then at the others before they arrive, and
        # the last member's go out while its own matchmaking reads (sending them only after it cost
        # 0.07-0.08 s more per round over 20 Mbit: docs/measurements.md, "Alternating passes, and parts
        # sent early")
        expected = Group(self._last_members, digest, applied_rounds) \
            if len(self._last_members) > 1 and self.peer_id in self._last_members else None
        sending = asyncio.ensure_future(self._send_early(round_no, expected, encoding, weight, digest)) \
            if expected is not None else None
        early: dict[int, asyncio.Future] = {}
        started = time.monotonic()
        result: RoundResult | None = None
        phases: dict[str, float] = {}
        try:
            group, weights, superseded = await self.matchmake(round_no, registration)
            phases["matchmaking"] = time.monotonic() - started
            if group is None or self.peer_id not in group.members:
                result = RoundResult(False, superseded or "our θ_global is not the group's reference",
                                     group.members if group else (), None, stale=True)
                return dataclasses.replace(result, phases=phases)
            exchange_started = time.monotonic()  # what is left of the encoding counts as exchange
            # every member bounds every registered weight alike (aggregate.bound_weights): the mean
            # and the round's total (the schedule's position) both use the bounded ones
            registered = {p: weights.get(p, 0.0) for p in group.members}
            weights = bound_weights(registered, self.m.averaging.max_weight_ratio)
            weight = min(float(weight), weights[self.peer_id])
            self.reducer.slot(round_no).registered = registered
            encoded, decoded = await encoding
            if sending is not None and expected is not None and group.hash == expected.hash:
                early = await sending  # our parts are on their way already (or answered)
            elif sending is not None:  # sent to another group: its reducers refuse them; stop now
                await self._drop_early(sending)
                sending = None
            self.reducer.own.add(round_no)
            try:
                result = await self._average(round_no, group, weights, encoded, decoded, weight, digest, phases,
                                             exchange_started, early)
            finally:
                self.reducer.own.discard(round_no)
            return dataclasses.replace(result, phases=phases)
        finally:
            self._last_members = result.group if result is not None and result.complete else ()
            if result is not None and not result.stale:
                self.standings = exclusion.after_round(self.standings, round_no, result.blamed,
                                                       result.group if result.complete else ())
            await self._drop_early(sending)
            if result is None or not result.complete:
                # the encoding may still run (matchmaking failed or was cancelled): wait for it
                # to finish with the residuals before putting them back
                await asyncio.gather(asyncio.shield(encoding), return_exceptions=True)
                for feedback, residuals in saved:
                    feedback.load_state_dict(residuals)

    async def _average(self, round_no: int, group: Group, weights: dict[str, float], encoded: dict[str, Encoded],
                       decoded: dict[str, torch.Tensor], weight: float, digest: str,
                       phases: dict[str, float], started: float, early: dict[int, asyncio.Future]) -> RoundResult:
        parts = partition(self.shapes, len(group.members))
        my_part = group.members.index(self.peer_id)
        slot = self.reducer.slot(round_no)
        slot.group = group
        slot.weights = weights
        slot.my_part = my_part
        slot.part_names = {n: self.shapes[n] for n, p in parts.items() if p == my_part}
        slot.contributions[self.peer_id] = (float(weight), self._own_decoded(slot.part_names, encoded, decoded))
        if self.verify or gathers(len(group.members), self.gather_up_to):
            slot.encoded[self.peer_id] = [pb.NamedTensor(name=n, tensor=encoded_to_proto(encoded[n]))
                                          for n in sorted(slot.part_names)]
        if self.verify:
            slot.signed[self.peer_id] = (float(weight), self._sign(round_no, group.hash, my_part, float(weight),
                                                                   slot.encoded[self.peer_id]))
        slot.ready.set()
        self.reducer.maybe_reduce(slot)

        async def local() -> pb.AverageResponse:
            tensors, contributors, total = await within(asyncio.shield(slot.result),
                                                        self.patience + self.m.timeouts.allreduce)
            return self.reducer.answer(slot, tensors, contributors, total, self.peer_id)

        calls = [early[p] if p in early else asyncio.ensure_future(
                     local() if p == my_part else self._send_part(round_no, group, p, encoded, weight, digest))
                 for p in range(len(group.members))]
        results = await self._collect(round_no, group, calls)
        mine = (float(weight), self._own_decoded(self.shapes, encoded, decoded)) if self.verify or gathers(
            len(group.members), self.gather_up_to) else None
        # in the gather exchange every member computes the mean itself: the same function of the
        # same bytes, but a machine whose float kernels differ (FMA, vector width) would split
        # θ_global; the outcome vote below compares the digests in groups of 2 as well
        result = self._combine(group, parts, results, weights, mine, round_no)
        phases["exchange"] = time.monotonic() - started
        voted = None
        if len(group.members) > 1:
            started = time.monotonic()
            result, voted = await self._vote(round_no, group, result)
            phases["vote"] = time.monotonic() - started
        if not result.complete:
            result = dataclasses.replace(result, blamed=self._blame(group, slot, results, voted, result.forged))
        if not result.complete and not slot.result.done():
            slot.result.cancel()  # callers still waiting on our part get WRONG_ROUND now, not a timeout
        return result

    async def _send_part(self, round_no: int, group: Group, part: int, encoded: dict[str, Encoded], weight: float,
                         digest: str) -> pb.AverageResponse:
        """Our contribution to `part`, to its reducer; its answer (the mean, or the others' parts)."""
        parts = partition(self.shapes, len(group.members))
        request = pb.AverageRequest(
            envelope=envelope(self.identity, self.stage), round=round_no, group_hash=group.hash,
            state_digest=digest, weight=float(weight), part=part,
            tensors=[pb.NamedTensor(name=n, tensor=encoded_to_proto(encoded[n])) for n in sorted(parts) if parts[n] == part])
        if self.verify:
            request.signature = self._sign(round_no, group.hash, part, float(weight), request.tensors)
        # the slowest member may still be in matchmaking (or computing, for a part sent early)
        return await self.rpc.call(group.members[part], "average", request, pb.AverageResponse,
                                   timeout=self.patience + self.m.timeouts.allreduce)

    def _sign(self, round_no: int, group_hash: str, part: int, weight: float, tensors: Sequence[pb.NamedTensor]
              ) -> bytes:
        assert self.key is not None  # __init__ refuses verify without a key
        return sign_part(self.key, self.identity.run_id, self.identity.manifest_hash, self.stage, round_no, group_hash,
                         part, weight, tensors)

    async def _send_early(self, round_no: int, expected: Group, encoding: asyncio.Future, weight: float,
                          digest: str) -> dict[int, asyncio.Future]:
        """Start sending our parts to the members of `expected` (last round's group) as soon as Δ
        is encoded, before matchmaking has settled this round's group: a reducer holds a request
        until its own matchmaking is done and refuses it if its group differs. Returns the calls
        by part; `run_round` keeps them if the group is `expected`, else cancels them."""
        encoded, _ = await asyncio.shield(encoding)
        me = expected.members.index(self.peer_id)
        return {p: asyncio.ensure_future(self._send_part(round_no, expected, p, encoded, weight, digest))
                for p in range(len(expected.members)) if p != me}

    async def _drop_early(self, sending: asyncio.Future | None) -> None:
        """Cancel and await whatever of the early parts is still running: all of them when the
        group differed or the round ended before its exchange; none after an exchange that used
        them (`_collect` awaited them, or cancelled the ones still on the way)."""
        if sending is None:
            return
        leftovers: list[asyncio.Future] = [sending]
        if sending.done() and not sending.cancelled() and sending.exception() is None:
            leftovers += list(sending.result().values())
        for task in leftovers:
            task.cancel()  # a no-op for those done
        done, stuck = await asyncio.wait(leftovers, timeout=self.m.timeouts.dht)
        for task in done:
            if not task.cancelled():
                task.exception()  # retrieved: an early part refused or failed is not news
        if stuck:
            logger.warning("stage %d: %d early part(s) did not end within timeouts.dht of their cancel; left behind",
                           self.stage, len(stuck))

    async def _collect(self, round_no: int, group: Group, calls: list[asyncio.Future]) -> list[Any]:
        """Every part's answer, in part order; but as soon as one part failed, or another member
        voted anything but our group's digest, the parts still on the way are abandoned (Abandoned):
        the round has failed for everyone, and waiting for them would only stall this member."""
        watcher = asyncio.ensure_future(outcome.first_failure(self.swarm, self.stage, round_no, group.members, group.hash,
                                                              self.peer_id)) if len(group.members) > 1 else None
        pending: set[asyncio.Future] = set(calls)
        why, by = "", ()
        try:
            while pending:
                done, _ = await asyncio.wait(pending | ({watcher} if watcher else set()),
                                             return_when=asyncio.FIRST_COMPLETED)
                if watcher is not None and watcher in done:
                    why, by = watcher.result()
                    break
                pending -= done
                if any(_part_failed(c) for c in done):
                    why = "another part failed"
                    break
        finally:
            leftovers = [*pending, *([watcher] if watcher else [])]
            for task in leftovers:
                task.cancel()
            if leftovers:  # bounded: a task that lost its cancel must not hold the round (peer/net/deadline.py)
                done, stuck = await asyncio.wait(leftovers, timeout=self.m.timeouts.dht)
                for task in done:
                    if not task.cancelled():
                        task.exception()  # retrieved: a part that failed as it was abandoned is not news
                if stuck:
                    logger.warning("stage %d round %d: %d task(s) did not end within timeouts.dht of their "
                                   "cancel; left behind", self.stage, round_no, len(stuck))
        return [Abandoned(why, by) if c in pending else asyncio.CancelledError("our slot was dropped") if c.cancelled()
                else (c.exception() or c.result()) for c in calls]

    def _combine(self, group: Group, parts: dict[str, int], results: list[Any], weights: dict[str, float],
                 mine: tuple[float, dict[str, torch.Tensor]] | None, round_no: int = -1) -> RoundResult:
        """`mine`: our weight and decoded parts in the gather exchange or with averaging.verify
        (None: reducers send means, taken as they come)."""
        # A reducer we could not reach at all (not one that timed out: it may be waiting on
        # someone else's part) is dead or cut off; a re-sync will not wait for it.
        unreachable = tuple(group.members[p] for p, res in enumerate(results)
                            if isinstance(res, RPCFailed) and "timed out" not in str(res))
        mean: dict[str, torch.Tensor] = {}
        totals = set()
        # a part that really failed says why the round failed; the parts abandoned because of it do not
        order = sorted(range(len(results)), key=lambda p: isinstance(results[p], Abandoned))
        for part in order:
            res = results[part]
            reducer = group.members[part][-8:]
            if isinstance(res, Abandoned):
                return RoundResult(False, f"part {part} (reducer {reducer}) abandoned: {res.why}", group.members,
                                   None, unreachable=unreachable)
            if isinstance(res, asyncio.TimeoutError):
                return RoundResult(False, f"part {part} (reducer {reducer}): timed out", group.members, None,
                                   unreachable=unreachable)
            if isinstance(res, RPCFailed):
                return RoundResult(False, f"part {part} (reducer {reducer}): {res}", group.members, None,
                                   unreachable=unreachable)
            if isinstance(res, BaseException):
                return RoundResult(False, f"part {part}: {type(res).__name__}: {res}", group.members, None,
                                   unreachable=unreachable)
            expected = {n: self.shapes[n] for n, p in parts.items() if p == part}
            try:
                if self.verify and mine is not None:
                    checked = self.checker.check(res, expected, group, round_no, part, weights,
                                                 self.reducer.slot(round_no).registered or weights, mine)
                    if isinstance(checked, Forged):
                        logger.warning("stage %d round %d: reducer %s of part %d: %s", self.stage, round_no,
                                       reducer, part, checked.why)
                        return RoundResult(False, f"part {part} from {reducer}: {checked.why}", group.members, None,
                                           unreachable=unreachable, forged=(group.members[part],))
                elif mine is not None:
                    checked = self._gathered(res, expected, group, weights, mine, part)
                else:
                    checked = validate_average_response(res, expected, group.members, self.max_numel,
                                                        self.mean_codecs, what=f"mean of part {part}")
            except (ProtocolError, ValueError) as e:
                return RoundResult(False, f"part {part} from {reducer}: {e}", group.members, None,
                                   unreachable=unreachable)
            if not checked.ok:
                return RoundResult(False, f"part {part} refused by {reducer}: {status_name(checked.status)} "
                                          f"{checked.reason}", group.members, None,
                                   unreachable=unreachable)
            totals.add(checked.total_weight)
            mean.update(checked.tensors)
        if len(totals) != 1:
            return RoundResult(False, f"reducers report different total weights {sorted(totals)}", group.members, None)
        return RoundResult(True, "", group.members, mean, total_weight=totals.pop())

    def _gathered(self, res: pb.AverageResponse, expected: dict[str, tuple[int, ...]], group: Group,
                  weights: dict[str, float], mine: tuple[float, dict[str, torch.Tensor]], part: int) -> AverageResult:
        """The gather exchange's answer for one part, aggregated here as every member does."""
        got = validate_gather_response(res, expected, group.members, self.peer_id, weights, self.max_numel,
                                       self.reducer.allowed_codecs, what=f"part {part}")
        if not got.ok:
            return AverageResult(got.status, got.reason)
        own = {n: mine[1][n] for n in expected}
        avg = self.m.averaging
        tensors, total = aggregate_gathered(got, self.peer_id, mine[0], own, avg.robust_min_members,
                                            avg.max_weight_ratio)
        return AverageResult(pb.OK, "", tensors, got.contributors, total)

    async def _vote(self, round_no: int, group: Group, result: RoundResult
                    ) -> tuple[RoundResult, outcome.Outcome]:
        """The outcome vote (peer/averaging/outcome.py): ours is the digest of the mean we decoded, or failed."""
        digest = mean_digest(result.mean_delta) if result.complete and result.mean_delta is not None else None
        out = await outcome.agree(self.swarm, self.stage, round_no, group.members, group.hash, self.peer_id, digest,
                                  self.m.timeouts.allreduce, self.m.timeouts.dht, gone=self._gone)
        if out.applied or digest is None:
            return result, out
        return RoundResult(False, out.reason, group.members, None, unreachable=out.missing,
                           voted_digest=out.voted_digest), out

    def _blame(self, group: Group, slot: RoundSlot, results: list[Any],
               voted: outcome.Outcome | None, forged: Sequence[str] = ()) -> tuple[str, ...]:
        """Who failed this round, as far as this replica saw it itself (exclusion.blame)."""
        abandoned_by = {p for res in results if isinstance(res, Abandoned) for p in res.by}
        vote_first = bool(abandoned_by)  # a failed vote made us abandon the parts still on the way
        answered = all(isinstance(res, pb.AverageResponse) and res.status == pb.OK for res in results)
        silent = [group.members[p] for p, res in enumerate(results)
                  if isinstance(res, (RPCFailed, asyncio.TimeoutError))]
        blamed = exclusion.blame(
            me=self.peer_id, forged=forged, members=group.members, contributed=set(slot.contributions) | slot.arrived,
            part_failed=not answered and not vote_first, silent_reducers=silent,
            failed_votes=abandoned_by | set(voted.failed if voted else ()),
            missing_votes=voted.missing if voted is not None and answered else (),
            wrong_round=any(isinstance(res, pb.AverageResponse) and res.status == pb.WRONG_ROUND for res in results))
        if blamed:
            logger.info("stage %d: %s failed the round as seen here: left out of the next group(s)", self.stage,
                        ", ".join(sorted(p[-8:] for p in blamed)))
        return tuple(sorted(blamed))

    async def _gone(self, members: Sequence[str]) -> list[str]:
        """Of `members`, those we hold no connection to any more (outcome.agree: a member killed
        after the exchange, whose vote will never come)."""
        connected = await self.rpc.connected()
        return [p for p in members if p not in connected]


@dataclass(frozen=True)
class Abandoned:
    """A part this member stopped waiting for: the round had already failed (`why`)."""
    why: str
    by: tuple[str, ...] = ()
    """The members whose failed vote under our group's hash made us stop (none: a part failed)."""


def _part_failed(call: asyncio.Future) -> bool:
    if call.cancelled() or call.exception() is not None:
        return True
    return getattr(call.result(), "status", pb.OK) != pb.OK


def mean_digest(mean: dict[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=12)
    for name in sorted(mean):
        h.update(name.encode())
        h.update(mean[name].detach().contiguous().numpy().tobytes())
    return h.hexdigest()
