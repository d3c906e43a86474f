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
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any, Callable, Coroutine, Mapping, Sequence

from hivemind.p2p import PeerID

from swarmgrad.peer.decisions import next_push_at
from swarmgrad.peer.net.rpc import FramedRPC, RPCFailed
from swarmgrad.peer.state.stage_state import StateSnapshot, state_digest
from swarmgrad.peer.net.dht_view import SwarmView
from swarmgrad.peer.net.errors import BestEffort
from swarmgrad.peer.records import ONLINE, PeerRecord
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.codecs import FP32_ONLY
from swarmgrad.protocol.framing import ProtocolError
from swarmgrad.protocol.responses import validate_state_response
from swarmgrad.protocol.validation import RunIdentity, check_envelope, envelope

logger = logging.getLogger(__name__)

BACKUP_COPIES = 2
"""Holders per stage: one holder leaving does not lose the backup."""


def backup_holders(run_id: str, stage: int, view: Mapping[int, Sequence[PeerRecord]]) -> list[str]:
    """Online peers of other stages in rendezvous order for `stage` (best first). Pure."""
    peers = {r.peer_id for s, recs in view.items() if s != stage for r in recs if r.state == ONLINE}
    own = {r.peer_id for r in view.get(stage, ())}  # a peer moving between stages holds no backup of its own
    return sorted(peers - own, key=lambda p: hashlib.sha256(f"{run_id}/{stage}/{p}".encode()).digest(),
                  reverse=True)


class BackupStore:
    """The copies this peer holds for other stages, and the handlers that take and give them."""

    def __init__(self, identity: RunIdentity, n_stages: int, shapes_of: Callable[[int], dict[str, tuple[int, ...]]],
                 max_numel: int):
        self.identity = identity
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
        res = validate_state_response(request.state, self.shapes_of(stage), self.max_numel,
                                      digest_fn=state_digest, allowed_codecs=FP32_ONLY)
        if not res.ok:
            raise ProtocolError(pb.BAD_REQUEST, "a backup must carry a state (status OK)")
        held = self.copies.get(stage)
        if held is not None and held.applied_rounds > res.applied_rounds:
            return pb.BackupAck(status=pb.STALE_STATE, reason=f"we hold a newer copy ({held.applied_rounds} rounds)")
        self.copies[stage] = StateSnapshot(res.params, res.momentum, res.round, res.applied_rounds, res.digest,
                                           res.trained_samples)
        logger.info("holding a backup of stage %d (%d rounds) from %s", stage, res.applied_rounds, str(caller)[-8:])
        return pb.BackupAck(status=pb.OK)

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
