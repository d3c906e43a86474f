"""The reducer's side of an outer round (peer/averaging/averager.py has the member's side).

Member j of a round's group reduces part j of the stage's tensors: every member's request for the
round lands in the round's slot, which the local member fills too once its matchmaking has settled
the group. A request waits until then (a reducer still in matchmaking, or still computing, holds
the parts sent early), is checked against the slot's group, digest and registered weight, and
is answered once every member's part is in: with the weighted mean of the decoded contributions,
encoded by the reduce codec (the same bytes to every member), or in a group of at most
averaging.gather_up_to members with the others' encoded parts as they came (peer/averaging/gather.py).
With averaging.verify every part must carry its sender's signature (peer/averaging/signed_parts.py),
checked here before it counts, and the answer carries the signed parts beside the mean, so every
member can recompute the mean and refuse one that is not the aggregate of those parts.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import torch
from hivemind.p2p import PeerID

from swarmgrad.compression import Encoded, ErrorFeedback, SizeAdaptive, reduce_codec
from swarmgrad.peer.averaging.aggregate import reduce_part
from swarmgrad.peer.averaging.group import Group
from swarmgrad.peer.clock import RoundClock
from swarmgrad.peer.net.deadline import within
from swarmgrad.peer.averaging.gather import gather_answer, gathers
from swarmgrad.peer.averaging.signed_parts import part_refusal
from swarmgrad.peer.manifest import Manifest
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.codecs import averaging_codecs
from swarmgrad.protocol.framing import ProtocolError
from swarmgrad.protocol.validation import RunIdentity, check_envelope, encoded_to_proto, validate_average


@dataclass
class RoundSlot:
    """One round as seen by this reducer: filled by the local member and by remote requests."""
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    knock: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when another member's request arrives: it has finished its matchmaking, so its
    registration is stored, and ours re-reads the registrations now instead of at its next poll."""
    group: Group | None = None
    weights: dict[str, float] = field(default_factory=dict)
    """Each member's bounded weight (aggregate.bound_weights): a contribution counts at most this."""
    registered: dict[str, float] = field(default_factory=dict)
    """What each member registered as its weight: a contribution may not claim more."""
    part_names: dict[str, tuple[int, ...]] = field(default_factory=dict)
    my_part: int = -1
    contributions: dict[str, tuple[float, dict[str, torch.Tensor]]] = field(default_factory=dict)
    arrived: set[str] = field(default_factory=set)
    """Members of our group whose part for this round reached us under another group's hash: they
    formed another group (their exclusions differ from ours), they did not withhold it
    (peer/averaging/exclusion.py)."""
    encoded: dict[str, list[pb.NamedTensor]] = field(default_factory=dict)
    """Each member's part as it encoded it: the gather exchange answers with these (peer/averaging/gather.py),
    and with averaging.verify every answer does."""
    signed: dict[str, tuple[float, bytes]] = field(default_factory=dict)
    """averaging.verify: each member's weight as it signed it, and its signature over its part."""
    result: asyncio.Future | None = None
    created: float = field(default_factory=time.monotonic)


class Reducer:
    """The rounds' slots of one stage replica and the `average` handler that fills them."""

    def __init__(self, manifest: Manifest, stage: int, identity: RunIdentity, codec: SizeAdaptive, max_numel: int,
                 clock: RoundClock):
        self.m = manifest
        self.stage = stage
        self.identity = identity
        self.max_numel = max_numel
        self.clock = clock
        """Requests for rounds far from the clock's are refused."""
        avg = manifest.averaging
        self.allowed_codecs = averaging_codecs(avg.codec, avg.small_tensor_threshold)
        """Only the manifest's codecs are decoded on the averaging path."""
        self.reduce_codec = reduce_codec(codec, feedback=avg.reducer_feedback)
        """What a reducer encodes the mean with: the union of sparse contributions, or with
        averaging.reducer_feedback the members' codec under `reducer_feedback`."""
        self.feedback = ErrorFeedback(self.reduce_codec) if avg.reducer_feedback else None
        """What this reducer's encodes of its part's mean dropped, added to its next mean."""
        self.gather_up_to = avg.gather_up_to
        """Groups this small exchange the members' own parts instead of a mean (peer/averaging/gather.py)."""
        self.verify = avg.verify
        """Parts must be signed by their members, and answers carry them (peer/averaging/signed_parts.py)."""
        self.patience = manifest.timeouts.matchmaking
        """The member's matchmaking patience (Averager.patience sets it): a request waits that long,
        plus timeouts.allreduce, for this replica to settle the round's group."""
        self.slots: dict[int, RoundSlot] = {}
        self.own: set[int] = set()
        """Rounds our own member is averaging: their slots outlive the clock (an overlapped round
        is still in flight when a re-sync moves the clock past it)."""

    def slot(self, round_no: int) -> RoundSlot:
        if round_no not in self.slots:
            self.slots[round_no] = RoundSlot(result=asyncio.get_running_loop().create_future())
            for old in [r for r in self.slots if r < self.clock.current - 2 and r not in self.own]:  # nobody waits on those
                slot = self.slots.pop(old)
                if slot.result is not None and not slot.result.done():
                    slot.result.cancel()
        return self.slots[round_no]

    async def handle(self, request: pb.AverageRequest, caller: PeerID) -> pb.AverageResponse:
        check_envelope(request.envelope, self.identity, [self.stage])
        if abs(request.round - self.clock.current) > 1:
            # a peer in another round (or one making up round numbers) gets no slot that could crowd ours out
            raise ProtocolError(pb.WRONG_ROUND, f"round {request.round} is not near ours ({self.clock.current})")
        slot = self.slot(request.round)
        slot.knock.set()
        timeouts = self.m.timeouts
        try:
            await within(slot.ready.wait(), self.patience + timeouts.allreduce)
        except asyncio.TimeoutError:
            raise ProtocolError(pb.WRONG_ROUND, f"this peer is not in round {request.round}") from None
        group = slot.group
        assert group is not None
        if request.group_hash != group.hash:
            if str(caller) in group.members:
                slot.arrived.add(str(caller))
            raise ProtocolError(pb.GROUP_MISMATCH, f"group {request.group_hash} differs from ours {group.hash}")
        if request.state_digest != group.digest:
            raise ProtocolError(pb.STALE_STATE, f"θ_global digest {request.state_digest} is not the group's")
        sender = str(caller)
        if sender not in group.members:
            raise ProtocolError(pb.GROUP_MISMATCH, "the caller is not a member of this round's group")
        inp = validate_average(request, self.identity, self.stage,
                               lambda part: slot.part_names if part == slot.my_part else None, self.max_numel,
                               allowed_codecs=self.allowed_codecs,
                               max_weight=slot.registered.get(sender, slot.weights.get(sender, 0.0)))
        if sender in slot.contributions:
            raise ProtocolError(pb.BAD_REQUEST, "a second contribution for the same round")
        if self.verify:
            refusal = part_refusal(sender, request.signature, self.identity.run_id, self.identity.manifest_hash,
                                   self.stage, request.round, request.group_hash, request.part, request.weight,
                                   request.tensors)
            if refusal is not None:
                raise ProtocolError(pb.UNAUTHORIZED, refusal)
            slot.signed[sender] = (float(request.weight), bytes(request.signature))
        # counted at its bounded weight: what it claimed above that moves neither the mean nor the schedule
        slot.contributions[sender] = (min(inp.weight, slot.weights.get(sender, 0.0)), inp.tensors)
        if self.verify or gathers(len(group.members), self.gather_up_to):
            slot.encoded[sender] = list(request.tensors)
        self.maybe_reduce(slot)
        assert slot.result is not None
        try:
            tensors, contributors, total = await within(asyncio.shield(slot.result), timeouts.allreduce)
        except asyncio.TimeoutError:
            raise ProtocolError(pb.DEADLINE_EXCEEDED, "not every member's part arrived in time") from None
        except asyncio.CancelledError:
            # the slot was dropped (we moved on two rounds): answer so, rather than close the
            # caller's stream without a word; our own cancellation still propagates
            task = asyncio.current_task()
            if slot.result.cancelled() and task is not None and not task.cancelling():
                raise ProtocolError(pb.WRONG_ROUND, f"round {request.round} was abandoned here") from None
            raise
        return self.answer(slot, tensors, contributors, total, sender)

    def answer(self, slot: RoundSlot, tensors: list[pb.NamedTensor] | None, contributors: list[str], total: float,
               caller: str) -> pb.AverageResponse:
        """The answer to `caller` (a remote member, or our own): the mean, or (`tensors` None) the
        gather exchange's other parts; with averaging.verify the others' signed parts in both."""
        if self.verify:
            answer = gather_answer(contributors, {p: slot.contributions[p][0] for p in contributors}, slot.encoded,
                                   caller, signed=slot.signed)
            if tensors is not None:
                answer.tensors.extend(tensors)
            return answer
        if tensors is None:  # the gather exchange
            return gather_answer(contributors, {p: slot.contributions[p][0] for p in contributors}, slot.encoded,
                                 caller)
        return pb.AverageResponse(status=pb.OK, tensors=tensors, contributors=contributors, total_weight=total)

    def maybe_reduce(self, slot: RoundSlot) -> None:
        """Answer the round once every member's part is in: the mean, or (gather) the parts."""
        group = slot.group
        if group is None or slot.result is None or slot.result.done():
            return
        if set(slot.contributions) != set(group.members):
            return
        order = sorted(slot.contributions)
        total = sum(slot.contributions[p][0] for p in order)
        if gathers(len(group.members), self.gather_up_to):
            slot.result.set_result((None, order, total))  # every member aggregates the parts itself
            return
        avg = self.m.averaging
        reduced = reduce_part([slot.contributions[p] for p in order], avg.robust_min_members, avg.max_weight_ratio)
        if self.feedback is not None:
            # a residual of a tensor another member now reduces (the group changed) would come
            # back late, on top of that tensor's later means: it is dropped instead
            for name in self.feedback.names():
                if name not in slot.part_names:
                    self.feedback.reset(name)
        tensors = [pb.NamedTensor(name=name, tensor=encoded_to_proto(self._encode_mean(name, reduced[name])))
                   for name in sorted(slot.part_names)]
        slot.result.set_result((tensors, order, total))

    def _encode_mean(self, name: str, mean: torch.Tensor) -> Encoded:
        if self.feedback is None:
            return self.reduce_codec.encode(mean)
        return self.feedback.encode(name, mean)
