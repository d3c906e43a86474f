"""Backups of each stage's state on peers of other stages, so a stage survives its last replica.

Where backups live: every `averaging.backup_every` complete rounds, the first member (by peer id)
of the round's group pushes the committed state (θ_global, outer momentum, counters, digest) to
the BACKUP_COPIES peers of *other* stages that rank highest for the stage under rendezvous hashing
(highest hash of run, stage and peer id). Rendezvous hashing needs no coordination: every peer
computes the same order from the same records, and when a holder leaves only the stages it held
move. A replica that finds its stage empty (a newcomer, or a peer moving in to refill it) asks the
holders in that order and restores the newest copy whose digest verifies, instead of starting the
stage from the seed while every other stage keeps its trained weights.

A push is the whole state in one message, which fills the pusher's link while it lasts (a
pipeline's microbatches queue behind it), so pushes are paced: after one that took d seconds the
next waits d / `averaging.backup_link_share` (decisions.next_push_at), skipping the rounds between.

Holders keep one copy per stage in memory (the newest by applied rounds), validate it like any
state download (names, shapes, fp32, bounded counters, recomputed digest) and serve it back.

Whose copies a holder takes (`put_refusal`, docs/trust.md "Backups"): a copy is a claim by one peer,
so a holder takes it only from a peer whose signed record is ONLINE under that stage (a current
replica) and, once the holder has seen a completed round of the stage, that voted in one lately
(a proven replica: a record is a claim anyone writes, a vote in a completed round is work), or,
before that, that has been the stage's only record while the holder's own replicas trained (a
microbatch goes through every stage: a lone replica, which posts no votes, shows so), only for a stage it is itself a rendezvous holder of (one of the RESTORE_HOLDERS a refill
asks), and only if the copy is at most one round ahead of what the stage's replicas announce
(`stage_position`: the lower medians of their rounds and applied rounds, so one record claiming
more moves nothing) and of the swarm's round (`swarm_round`, which bounds a stage whose only
records are one writer's). A copy it holds that the stage has fallen behind (more than one round ahead of
the stage) no longer blocks a newer push. So a stranger plants nothing, nobody makes a peer hold a
copy of a stage it does not hold for, and storage is one copy per stage it holds for.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any, Awaitable, Callable, Collection, Coroutine, Mapping, Sequence

from hivemind.p2p import PeerID

from swarmgrad.peer.averaging.group import completed_voters
from swarmgrad.peer.decisions import next_push_at
from swarmgrad.peer.evidence import WINDOW, WorkSeen
from swarmgrad.peer.net.rpc import FramedRPC, RPCFailed
from swarmgrad.peer.state.stage_state import StateSnapshot, state_digest
from swarmgrad.peer.net.dht_view import SwarmView
from swarmgrad.peer.net.deadline import within
from swarmgrad.peer.net.errors import NETWORK_FAILURES, BestEffort
from swarmgrad.peer.records import ONLINE, PeerRecord
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.codecs import FP32_ONLY
from swarmgrad.protocol.framing import ProtocolError
from swarmgrad.protocol.responses import validate_state_response
from swarmgrad.protocol.validation import RunIdentity, check_envelope, envelope

logger = logging.getLogger(__name__)

BACKUP_COPIES = 2
"""Holders per stage: one holder leaving does not lose the backup."""
RESTORE_HOLDERS = 2 * BACKUP_COPIES
"""Holders a refill asks, in rendezvous order, and so the peers that may hold a stage's copy (a
pusher's view of the swarm may differ a little from the holder's)."""


def backup_holders(run_id: str, stage: int, view: Mapping[int, Sequence[PeerRecord]]) -> list[str]:
    """Online peers of other stages in rendezvous order for `stage` (best first). Pure."""
    peers = {r.peer_id for s, recs in view.items() if s != stage for r in recs if r.state == ONLINE}
    own = {r.peer_id for r in view.get(stage, ())}  # a peer moving between stages holds no backup of its own
    return sorted(peers - own, key=lambda p: hashlib.sha256(f"{run_id}/{stage}/{p}".encode()).digest(),
                  reverse=True)


def lower_median(values: Sequence[int]) -> int:
    """The lower median: at least half of the values are at or above it, so values raised by less
    than half of those counted do not raise it (and ties decide nothing)."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def stage_position(records: Sequence[PeerRecord]) -> tuple[int, int] | None:
    """(round, applied rounds) that the ONLINE records of a stage corroborate (lower medians of what
    each announces), or None when none is online. Pure."""
    online = [r for r in records if r.state == ONLINE]
    if not online:
        return None
    return lower_median([r.round for r in online]), lower_median([r.applied_rounds for r in online])


def swarm_round(view: Mapping[int, Sequence[PeerRecord]]) -> int | None:
    """The round the whole swarm corroborates (lower median over every stage's ONLINE records; all
    stages share the drivers' rounds), or None when nobody is online. A stage whose only records are
    one writer's cannot lift it. Pure."""
    rounds = [r.round for recs in view.values() for r in recs if r.state == ONLINE]
    return lower_median(rounds) if rounds else None


def put_refusal(view: Mapping[int, Sequence[PeerRecord]], run_id: str, stage: int, caller: str, self_id: str,
                claim_round: int, claim_applied: int, *, proven: Collection[str] | None = None,
                held_from: str | None = None, served_alone: bool | None = None) -> str | None:
    """Why this peer (`self_id`) must not take `caller`'s copy of `stage` (None: it may). Pure.

    `proven`: the ids this peer saw vote in a completed round of `stage` lately (WorkSeen); only
    they count as the stage's current replicas, so a fresh id that writes its own ONLINE record is
    none. None where this peer never saw a completed round of `stage` (a swarm's first rounds, a
    stage only ever served by one replica, which posts no votes): every ONLINE record counts, as
    placement counts records before its first completed round. `held_from`: who pushed the copy
    held now, if it was proven when it pushed it; that pusher stays a replica for its own next
    copies (a replica left alone by its partners posts no votes and would otherwise lose its
    backups once its proof aged out).

    `served_alone`, where `proven` is None: whether the caller has been the stage's one live record
    while this peer's own replica trained (a microbatch goes through every stage, so the stage was
    served, and by it: it was the only one there). A record written beside a lone replica, or
    into a stage its replicas left (nothing trains then), is not; None: not known (every ONLINE
    record counts, as before)."""
    records = view.get(stage, ())
    if not any(r.peer_id == caller and r.state == ONLINE for r in records):
        return f"{caller[-8:]} is not an online replica of stage {stage}"
    if proven is not None and caller not in proven and caller != held_from:
        return (f"{caller[-8:]} is not a proven replica of stage {stage}: this peer saw it in no completed, "
                f"voted round of the stage")
    if proven is None and served_alone is False and caller != held_from:
        return (f"{caller[-8:]} is not shown to serve stage {stage}: no completed round of it seen, and it has "
                f"not been its one live replica while this peer trained")
    if self_id not in backup_holders(run_id, stage, view)[:RESTORE_HOLDERS]:
        return f"this peer does not hold backups of stage {stage}"
    position = stage_position(records)
    assert position is not None  # the caller's own record is online
    if claim_round > position[0] + 1 or claim_applied > position[1] + 1:
        return (f"the copy claims round {claim_round} ({claim_applied} applied), more than one round ahead of "
                f"stage {stage}'s replicas (round {position[0]}, {position[1]} applied)")
    swarm = swarm_round(view)
    if claim_applied > claim_round or (swarm is not None and claim_round > swarm + 1):
        # a stage whose records are all one writer's (an emptied stage, a forger's) is bounded by
        # the swarm: rounds are the drivers', shared by every stage
        return (f"the copy claims round {claim_round} ({claim_applied} applied), more than one round ahead of "
                f"the swarm (round {swarm})")
    return None


def plausible(snapshot: StateSnapshot, swarm_round: int | None) -> bool:
    """Whether a backup fetched for a restore may be adopted: its round at most one ahead of the
    swarm's (the lower median of the other stages' ONLINE records; None: unknown, no bound) and no
    more applied rounds than rounds. A copy a holder took passed `put_refusal` when it arrived;
    this bounds one that did not (a holder of an older version, or a hostile holder)."""
    if snapshot.applied_rounds > snapshot.round:
        return False
    return swarm_round is None or snapshot.round <= swarm_round + 1


class BackupStore:
    """The copies this peer holds for other stages, and the handlers that take and give them."""

    def __init__(self, identity: RunIdentity, n_stages: int, shapes_of: Callable[[int], dict[str, tuple[int, ...]]],
                 max_numel: int, *, peer_id: str,
                 swarm: Callable[[], Awaitable[Mapping[int, Sequence[PeerRecord]]]], timeout: float,
                 votes: Callable[[int, int], Awaitable[tuple[Mapping[str, str], Mapping[str, Mapping[str, Any]]]]]
                 | None = None, trained: Callable[[], int] | None = None):
        """`swarm`: reads every stage's records (SwarmView.swarm), which decide whose copies are
        taken (`put_refusal`); `votes(stage, round)`: that round's outcome votes and registrations
        (SwarmView.round_checks, round_registrations), which prove who is a replica (None: nobody
        is proven, every ONLINE record counts); `trained()`: the microbatches this peer's replicas
        trained ever, which show a stage of one replica served (`put_refusal`'s `served_alone`;
        None: not known); `timeout`: the deadline of each read (timeouts.dht)."""
        self.identity = identity
        self.peer_id = peer_id
        self.swarm = swarm
        self.votes = votes
        self.timeout = timeout
        self.work = WorkSeen(window=WINDOW)
        """Who this peer saw complete voted rounds of the stages it holds for, remembered for the
        window a voice lasts (evidence.WINDOW: 64 rounds, not placement's 10): a replica whose
        partners left stays proven until its first push alone, even where pushes are paced or
        `backup_every` is large, and is then the pusher of the copy held (`put_refusal`)."""
        self.pushers: dict[int, str] = {}
        """Stage -> who pushed the copy held of it, if it was proven or served alone then."""
        self.trained = trained
        self._alone: dict[int, tuple[str, int]] = {}
        """Stage -> (its one live record's id, `trained()` when this peer first saw it so)."""
        self.n_stages = n_stages
        self.shapes_of = shapes_of
        self.max_numel = max_numel
        self.copies: dict[int, StateSnapshot] = {}

    def held(self, exclude: int | None = None) -> tuple[tuple[int, int], ...]:
        """(stage, applied_rounds) of the copies held, for this peer's record (placement reads it
        to prefer a holder of a stage's current state when the stage needs a replica)."""
        return tuple(sorted((s, c.applied_rounds) for s, c in self.copies.items() if s != exclude))

    def local_copy(self, stage: int, digest: str | None) -> StateSnapshot | None:
        """The copy of `stage` if its digest is `digest` (the stage's majority's): then a replica
        of that stage can start from it without downloading anything."""
        held = self.copies.get(stage)
        return held if held is not None and digest and held.digest == digest else None

    async def handle_put(self, request: pb.BackupPut, caller: PeerID) -> pb.BackupAck:
        check_envelope(request.envelope, self.identity, range(self.n_stages))
        stage = request.envelope.stage
        # who may push, before the state is decoded and hashed: a refused caller costs a DHT read
        try:
            view = await within(self.swarm(), self.timeout)
        except NETWORK_FAILURES:
            return pb.BackupAck(status=pb.NOT_READY, reason="cannot read the swarm to check the pusher; try later")
        why = put_refusal(view, self.identity.run_id, stage, str(caller), self.peer_id, request.state.round,
                          request.state.applied_rounds)
        proven: frozenset[str] | None = None
        alone: bool | None = None
        if why is None:  # the claims hold: now whether the caller did the stage's work
            try:
                proven = await self._proven(stage, request.state.round, swarm_round(view))
            except NETWORK_FAILURES:
                return pb.BackupAck(status=pb.NOT_READY, reason="cannot read the stage's round votes; try later")
            alone = self._served_alone(view, stage, str(caller)) if proven is None else None
            why = put_refusal(view, self.identity.run_id, stage, str(caller), self.peer_id, request.state.round,
                              request.state.applied_rounds, proven=proven, held_from=self.pushers.get(stage),
                              served_alone=alone)
        if why is not None:
            logger.info("refused a backup of stage %d from %s: %s", stage, str(caller)[-8:], why)
            return pb.BackupAck(status=pb.UNAUTHORIZED, reason=why)
        res = validate_state_response(request.state, self.shapes_of(stage), self.max_numel,
                                      digest_fn=state_digest, allowed_codecs=FP32_ONLY)
        if not res.ok:
            raise ProtocolError(pb.BAD_REQUEST, "a backup must carry a state (status OK)")
        self._forget_unheld(view)
        held = self.copies.get(stage)
        position, swarm = stage_position(view.get(stage, ())), swarm_round(view)
        # a held copy the stage has fallen behind (restored from an older state) blocks nothing
        current = held is not None and position is not None and held.applied_rounds <= position[1] + 1 and (
            swarm is None or held.round <= swarm + 1)
        if held is not None and current and held.applied_rounds > res.applied_rounds:
            return pb.BackupAck(status=pb.STALE_STATE, reason=f"we hold a newer copy ({held.applied_rounds} rounds)")
        self.copies[stage] = StateSnapshot(res.params, res.momentum, res.round, res.applied_rounds, res.digest,
                                           res.trained_samples)
        if (proven is not None and str(caller) in proven) or (proven is None and alone):
            self.pushers[stage] = str(caller)
        elif proven is None:
            # taken on its record alone (no completed round of the stage seen): no standing later
            self.pushers.pop(stage, None)
        logger.info("holding a backup of stage %d (%d rounds) from %s", stage, res.applied_rounds, str(caller)[-8:])
        return pb.BackupAck(status=pb.OK)

    async def _proven(self, stage: int, round_no: int, swarm: int | None) -> frozenset[str] | None:
        """The ids proven on `stage` by the completed rounds this peer saw (`put_refusal`'s
        `proven`), after reading the votes of the two rounds before the copy's round (a copy's round
        is the one after the round it applied; `put_refusal` bounded it) and before the swarm's
        (`swarm_round`: a pusher choosing an old round does not choose which rounds are read), not
        already seen complete. None while no completed round of the stage was ever seen."""
        if self.votes is None:
            return None
        rounds = sorted({r for x in (round_no, swarm) if x is not None for r in (x - 1, x - 2)
                         if r >= 0 and not self.work.settled(stage, r)})
        votes = self.votes
        found = await within(asyncio.gather(*(votes(stage, r) for r in rounds)), self.timeout)
        for r, (checks, registrations) in zip(rounds, found):
            self.work.observe(stage, r, completed_voters(checks, registrations))
        if not self.work.seen(stage):
            return None
        return frozenset(p for p, s in self.work.proven(max(round_no, swarm or 0)) if s == stage)

    def _served_alone(self, view: Mapping[int, Sequence[PeerRecord]], stage: int, caller: str) -> bool | None:
        """`put_refusal`'s `served_alone`: `caller` is the stage's one record and this peer
        trained since it first saw it so (the first push after that is refused; the pusher tries
        again after its next round). None without `trained`."""
        if self.trained is None:
            return None
        # any other record, LEAVING too: a leaving replica serves its last round's microbatches,
        # which would show the stage served while only the caller is live
        if {r.peer_id for r in view.get(stage, ())} != {caller}:
            self._alone.pop(stage, None)
            return False
        count = self.trained()
        seen = self._alone.get(stage)
        if seen is None or seen[0] != caller:
            self._alone[stage] = (caller, count)
            return False
        return count > seen[1]

    def _forget_unheld(self, view: Mapping[int, Sequence[PeerRecord]]) -> None:
        """Drop the copies of stages this peer no longer holds for (the holders moved): storage stays
        one copy per stage it holds for."""
        for stage in list(self.copies):
            if self.peer_id not in backup_holders(self.identity.run_id, stage, view)[:RESTORE_HOLDERS]:
                del self.copies[stage]
                self.pushers.pop(stage, None)

    async def handle_get(self, request: pb.BackupGet, caller: PeerID) -> pb.StateResponse:
        from swarmgrad.peer.state.sync import state_response  # state_sync restores from backups: import late
        check_envelope(request.envelope, self.identity, range(self.n_stages))
        held = self.copies.get(request.envelope.stage)
        if held is None:
            raise ProtocolError(pb.NOT_READY, f"no backup of stage {request.envelope.stage} here")
        return state_response(held)


async def push_backup(rpc: FramedRPC, holder: str, identity: RunIdentity, stage: int, snapshot: StateSnapshot,
                      timeout: float) -> int:
    """Bytes of the copy if `holder` took it, else 0."""
    from swarmgrad.peer.state.sync import state_response
    request = pb.BackupPut(envelope=envelope(identity, stage), state=state_response(snapshot))
    try:
        ack = await rpc.call(holder, "put", request, pb.BackupAck, timeout=timeout)
    except RPCFailed as e:
        logger.info("backup of stage %d to %s failed: %s", stage, holder[-8:], e)
        return 0
    return request.ByteSize() if ack.status == pb.OK else 0


async def fetch_backup(rpc: FramedRPC, holder: str, identity: RunIdentity, stage: int,
                       shapes: dict[str, tuple[int, ...]], max_numel: int, timeout: float) -> StateSnapshot | None:
    """A holder's copy of `stage`, checked; None if it has none or its answer fails a check."""
    try:
        resp = await rpc.call(holder, "get", pb.BackupGet(envelope=envelope(identity, stage)), pb.StateResponse,
                              timeout=timeout)
        res = validate_state_response(resp, shapes, max_numel, digest_fn=state_digest, allowed_codecs=FP32_ONLY)
    except (RPCFailed, ProtocolError) as e:
        logger.info("backup of stage %d from %s: %s", stage, holder[-8:], e)
        return None
    if not res.ok:
        return None
    return StateSnapshot(res.params, res.momentum, res.round, res.applied_rounds, res.digest, res.trained_samples)


class BackupPusher:
    """The round runner's side: after a complete round, the group's first member pushes the
    committed state to the stage's holders, in a task the replica owns (the round does not wait)."""

    def __init__(self, rpc: FramedRPC, swarm: SwarmView, identity: RunIdentity, stage: int, every: int,
                 timeout: float, spawn: Callable[[Coroutine[Any, Any, Any], str], asyncio.Task],
                 link_share: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, emit: Callable[..., None] | None = None):
        self.rpc = rpc
        self.swarm = swarm
        self.identity = identity
        self.stage = stage
        self.every = every
        self.timeout = timeout
        self.spawn = spawn
        """The replica's Replica.spawn: a push is its task (cancelled and awaited on its way out)."""
        self._pushing: asyncio.Task | None = None
        self.link_share = link_share
        self.clock = clock
        self.emit = emit
        self.pushed = 0
        self.paced = 0
        """Rounds whose push was skipped because the last push's time, over `link_share`, had
        not yet passed."""
        self.due = -float("inf")
        self._reading = BestEffort(f"stage {stage}: reading the swarm to push a backup", logger)

    def after_round(self, peer_id: str, group: Sequence[str], snapshot: StateSnapshot | None) -> None:
        if not self.every or snapshot is None or not group or peer_id != min(group):
            return
        if snapshot.applied_rounds == 0 or snapshot.applied_rounds % self.every:
            return
        if self._pushing is not None and not self._pushing.done():
            return  # the previous push is still going: skip this one rather than pile up
        if self.clock() < self.due:
            self.paced += 1
            return
        self._pushing = self.spawn(self._push(snapshot), "backup")

    async def _push(self, snapshot: StateSnapshot) -> None:
        view: dict[int, list[PeerRecord]] = {}
        with self._reading:
            view = await self.swarm.swarm()
        if not self._reading.ok:
            return
        started, landed, sent = self.clock(), [], 0
        for holder in backup_holders(self.identity.run_id, self.stage, view)[:BACKUP_COPIES]:
            if nbytes := await push_backup(self.rpc, holder, self.identity, self.stage, snapshot, self.timeout):
                landed.append(holder)
                sent += nbytes
        self.pushed += len(landed)
        if not landed:
            return  # a push that failed everywhere is tried again next round, not paced
        took = self.clock() - started
        self.due = next_push_at(started, took, self.link_share)
        if self.emit is not None:
            self.emit("backup", applied_rounds=snapshot.applied_rounds, holders=landed, bytes=sent,
                      seconds=round(took, 3), next_in_s=round(max(0.0, self.due - self.clock()), 3), paced=self.paced)
