"""State sync in one place: serving a stage's committed θ_global and outer momentum, a joiner's
first download, and the re-sync of a replica after a round it failed while others completed.

The receiver validates names and shapes against its own stage and recomputes the digest, so a
truncated, tampered or mismatched state is refused rather than trained on. Whether this replica
serves its state is its phase alone (peer/state/phase.py), which the round runner writes. Donors are chosen by
`policy` from what the stage's majority announces, never by who claims the most rounds.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Awaitable, Callable, Sequence

from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from swarmgrad.compression import get_codec
from swarmgrad.peer import decisions
from swarmgrad.peer.averaging.averager import RoundResult
from swarmgrad.peer.averaging.group import group_hash
from swarmgrad.peer.clock import RoundClock
from swarmgrad.peer.evidence import MAX_LEAD, Evidence, EvidenceLedger, Quorum, bounded_round, quorum
from swarmgrad.peer.net.deadline import within
from swarmgrad.peer.net.errors import NETWORK_FAILURES, BestEffort
from swarmgrad.peer.net.retry import Backoff
from swarmgrad.peer.events import EventLog
from swarmgrad.peer.manifest import TimeoutsConfig
from swarmgrad.peer.net.rpc import FramedRPC, RPCFailed
from swarmgrad.peer.compute.schedule import TrainingProgress
from swarmgrad.peer.state.phase import Phase, ReplicaPhase, serves_state
from swarmgrad.peer.state.stage_state import CheckpointError, StageState, StateSnapshot, state_digest
from swarmgrad.peer.net.dht_view import SwarmView
from swarmgrad.peer.records import ONLINE, PeerRecord
from swarmgrad.peer.compute.worker import StageWorker
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.framing import ProtocolError
from swarmgrad.protocol.codecs import FP32_ONLY
from swarmgrad.protocol.responses import validate_state_response
from swarmgrad.protocol.validation import RunIdentity, check_envelope, encoded_to_proto, envelope

logger = logging.getLogger(__name__)

PART_BYTES = 64 << 20
"""A state travels in parts of at most this many bytes (θ_global + momentum of a few tensors),
so no stage is capped by one message's size and two donors can each send half."""

MAX_JOIN_REFRESHES = 2
"""Downloads a joiner repeats because the state moved on while it travelled (decisions.join_superseded):
over a slow link a download can span a short round's boundary every time. Past them the joiner
keeps the state it has: its first round finds out it is stale and re-syncs."""

CHECKPOINT_WAIT = Backoff(first=2.0, cap=2.0)
"""A joiner of an empty stage whose coordinator did not answer asks again at this pace (its
newest checkpoint may be far ahead of the seed), until timeouts.state_download."""
DONOR_RETRY = Backoff(first=0.5, cap=0.5)
"""Between tries of a join or a re-sync: the donors were busy or the records unreadable; a round's
boundary or a DHT hiccup is over within a fraction of a second."""

REFUSED = {
    Phase.JOINING: "this replica has no committed state to share yet",
    Phase.AVERAGING: "this replica is averaging; its state is about to change",
    Phase.LEAVING: "this replica is leaving",
}
"""Why a state request is refused NOT_READY in each phase that does not serve it."""


def state_response(snapshot: StateSnapshot, names: Sequence[str] | None = None) -> pb.StateResponse:
    """The snapshot (or the tensors `names` of it) in full precision (fp32): state sync is the one
    place parameters travel whole. Digest and counters are always the whole snapshot's."""
    fp32 = get_codec("fp32")
    wanted = list(snapshot.params) if not names else list(names)

    def named(tensors: dict) -> list[pb.NamedTensor]:
        return [pb.NamedTensor(name=n, tensor=encoded_to_proto(fp32.encode(tensors[n]))) for n in wanted if n in tensors]

    return pb.StateResponse(status=pb.OK, round=snapshot.round, state_digest=snapshot.digest,
                            applied_rounds=snapshot.applied_rounds, params=named(snapshot.params),
                            momentum=named(snapshot.momentum), trained_samples=snapshot.trained_samples)


def plan_parts(shapes: dict[str, tuple[int, ...]], part_bytes: int) -> list[list[str]]:
    """Tensor names in parts of at most `part_bytes` of θ_global + momentum (a tensor larger than
    that travels alone). Pure; sorted, so every joiner asks for the same parts."""
    parts: list[list[str]] = [[]]
    size = 0
    for name in sorted(shapes):
        n = 8 * math.prod(shapes[name])  # fp32 θ_global and fp32 momentum
        if parts[-1] and size + n > part_bytes:
            parts.append([])
            size = 0
        parts[-1].append(name)
        size += n
    return parts


async def fetch_state(rpc: FramedRPC, donors: Sequence[str], identity: RunIdentity, stage: int,
                      shapes: dict[str, tuple[int, ...]], max_numel: int, timeout: float,
                      part_bytes: int = PART_BYTES) -> StateSnapshot:
    """Download a replica's state in parts, spread over up to two donors that announce the same
    digest, and check it whole at the end (protocol.responses.validate_state_response per part:
    names, shapes, fp32 only, bounded counters; then the recomputed digest of the assembled
    state). Raises RPCFailed or ProtocolError."""
    donors = list(donors)[:2]
    parts = plan_parts(shapes, part_bytes)

    async def one(i: int, names: list[str]):
        request = pb.StateRequest(envelope=envelope(identity, stage), names=names if len(parts) > 1 else [])
        resp = await rpc.call(donors[i % len(donors)], "state", request, pb.StateResponse, timeout=timeout)
        res = validate_state_response(resp, {n: shapes[n] for n in names}, max_numel, digest_fn=None,
                                      allowed_codecs=FP32_ONLY)
        if not res.ok:
            raise ProtocolError(res.status, res.reason)
        return res

    results = await asyncio.gather(*(one(i, names) for i, names in enumerate(parts)))
    first = results[0]
    if any((r.digest, r.round, r.applied_rounds, r.trained_samples) !=
           (first.digest, first.round, first.applied_rounds, first.trained_samples) for r in results):
        raise ProtocolError(pb.STALE_STATE, "the parts come from different states (a round ended meanwhile)")
    params = {n: t for r in results for n, t in r.params.items()}
    momentum = {n: t for r in results for n, t in r.momentum.items()}
    if momentum and momentum.keys() != params.keys():
        raise ProtocolError(pb.BAD_REQUEST, "momentum is missing for some tensors")
    digest = state_digest(params, momentum, first.trained_samples)
    if digest != first.digest:
        raise ProtocolError(pb.BAD_REQUEST, "the assembled state does not match its declared digest")
    return StateSnapshot(params, momentum, first.round, first.applied_rounds, digest, first.trained_samples)


def acceptable(snap: StateSnapshot, expected: Quorum, donors: Sequence[str]) -> bool:
    """Is a downloaded state one to adopt? The quorum's own state (its digest); or, from donors
    that all back the quorum with their voices, the state of the round after it (they moved on
    between our read of their records and the download: in a stage whose rounds are short,
    waiting for a record that matches would race them for ever). Never further ahead. Pure."""
    if snap.digest == expected.digest:
        return True
    return snap.applied_rounds == expected.applied_rounds + MAX_LEAD and bool(donors) \
        and all(d in expected.backers for d in donors)


class StateSync:
    """Join, re-sync and serve the state of one stage replica."""

    def __init__(self, *, rpc: FramedRPC, swarm: SwarmView, identity: RunIdentity, peer_id: str, stage: int,
                 state: StageState, worker: StageWorker, clock: RoundClock, progress: TrainingProgress,
                 events: EventLog, phase: ReplicaPhase, timeouts: TimeoutsConfig, max_numel: int,
                 backup_rpc: FramedRPC | None = None,
                 checkpoints: Callable[[int], Awaitable[StateSnapshot | None]] | None = None,
                 local_copy: Callable[[int, str | None], StateSnapshot | None] | None = None,
                 ledger: EvidenceLedger | None = None):
        self.rpc = rpc
        self.swarm = swarm
        self.identity = identity
        self.peer_id = peer_id
        self.stage = stage
        self.state = state
        self.worker = worker
        self.clock = clock
        self.progress = progress
        self.events = events
        self.phase = phase
        """The replica's phase (peer/state/phase.py), which alone decides whether the state is served."""
        self.t = timeouts
        self.max_numel = max_numel
        self.backup_rpc = backup_rpc
        """Client of the peer-level backup handlers: an empty stage is restored from a backup."""
        self.checkpoints = checkpoints
        """Private runs: the coordinator's newest checkpoint of a stage, the other source an empty
        stage restores from (it wins over any backup: restore_backup)."""
        self.local_copy = local_copy
        self.ledger = ledger if ledger is not None else EvidenceLedger(stage)
        """Whose word counts (peer/evidence.py): donors are the holders of a quorum's digest, and
        every state adopted here anchors it (`adopted`)."""
        """BackupStore.local_copy: this peer's backup of a stage, if it has the given digest."""
        self._checkpoint_unknown = False
        """The last look for a checkpoint failed (not 'there is none'): the seed is no fallback."""
        self.from_replica = False
        """`join` took the state a live replica holds (a download, or this peer's backup with the
        majority's digest), not the seed or a restore: its donors have evaluated that θ already."""
        self.served: dict[str, float] = {}
        """Peers that downloaded this replica's state -> when (monotonic) their first request
        arrived: the round runner holds its boundary for them (decisions.join_hold)."""
        self._asked: dict[str, set[str]] = {}
        """Peers in `served` -> the tensors they asked for (`shares`)."""
        self._active: dict[str, float] = {}
        """Peers in `served` -> when (monotonic) they last asked, or were last seen with a stream
        open to our handlers (`activity`)."""
        self._rereading = BestEffort(f"stage {stage}: re-reading the stage's records after a download", logger)
        self._finding_backups = BestEffort(f"stage {stage}: reading the swarm to find backups", logger)
        self._resync_records = BestEffort(f"stage {stage}: reading the stage's records to re-sync", logger)
        self._reading_votes = BestEffort(f"stage {stage}: reading a failed round's votes", logger)
        self._saying_abandoned = BestEffort(f"stage {stage}: saying a failed round was abandoned", logger)
        self._reading_abandoned = BestEffort(f"stage {stage}: reading who abandoned a failed round", logger)

    # serving ------------------------------------------------------------------------------------
    async def handle(self, request: pb.StateRequest, caller: PeerID) -> pb.StateResponse:
        check_envelope(request.envelope, self.identity, [self.stage])
        names = list(request.names)
        if len(set(names)) != len(names) or any(n not in self.state.shapes for n in names):
            raise ProtocolError(pb.BAD_REQUEST, "state request names unknown or repeated tensors")
        phase = self.phase.current
        if phase is Phase.OVERLAPPED:
            # An overlapped round in flight: answer with the state it produces. Polling for a gap
            # would starve a joiner when averaging takes a whole round (each ends as the next begins).
            # A stale replica re-syncs (JOINING) before its mean lands: the wait goes on through it.
            try:
                phase = await within(self.phase.wait_while((Phase.OVERLAPPED, Phase.JOINING)),
                                     self.t.matchmaking + self.t.allreduce)
            except asyncio.TimeoutError:
                raise ProtocolError(pb.NOT_READY, REFUSED[Phase.AVERAGING]) from None
            if phase is Phase.LEAVING:
                raise ProtocolError(pb.NOT_READY, REFUSED[phase])
            # landed, mid-round or at the boundary it ended in: the committed state is the one it made
        elif not serves_state(phase):
            raise ProtocolError(pb.NOT_READY, REFUSED[phase])
        snap = self.state.snapshot
        if snap is None:
            raise ProtocolError(pb.NOT_READY, REFUSED[Phase.JOINING])
        self.served.setdefault(str(caller), time.monotonic())
        self._asked.setdefault(str(caller), set()).update(names or self.state.shapes)
        self._active[str(caller)] = time.monotonic()
        return state_response(snap, names)

    def activity(self) -> dict[str, float]:
        """Peers in `served` -> when (monotonic) their download from us last moved: a request, or a
        stream of theirs still open (an answer on its way to them). A download that has not moved
        for a while has stalled or ended (decisions.join_hold)."""
        now = time.monotonic()
        for peer in self._active:
            if self.rpc is not None and self.rpc.open_streams_of(peer):
                self._active[peer] = now
        return dict(self._active)

    def shares(self) -> dict[str, float]:
        """Peers in `served` -> the fraction of the state (by elements) they asked us for: a joiner
        asks its donors for the whole state at once; one small part is no download to hold for."""
        sizes = {n: math.prod(shape) for n, shape in self.state.shapes.items()}
        total = sum(sizes.values()) or 1
        return {peer: sum(sizes.get(n, 0) for n in names) / total for peer, names in self._asked.items()}

    def forget_served(self, peers: Sequence[str]) -> None:
        """Drop peers the runner will not hold for again until they ask anew (they serve our state,
        left, or lost their connection: decisions.join_hold)."""
        for peer in peers:
            self.served.pop(peer, None)
            self._asked.pop(peer, None)
            self._active.pop(peer, None)

    # fetching -----------------------------------------------------------------------------------
    def evidence(self, records: Sequence[PeerRecord] = ()) -> Evidence:
        """Our ledger's evidence, with the anchors among `records` (the stage's, as just read)."""
        return self.ledger.snapshot().among(records)

    async def download(self, peers: Sequence[str], expected: Quorum) -> bool:
        """Download the state from `peers` (parts spread over the first two), adopt it if it is the
        state `expected` (a quorum of voices, peer/evidence.py) announces: its digest, its applied
        rounds. Its round moves our clock at most one round past the quorum's (`bounded_round`):
        a donor's word is no more than its own digest's contents."""
        try:
            snap = await fetch_state(self.rpc, peers, self.identity, self.stage, self.state.shapes, self.max_numel,
                                     self.t.state_download)
        except (RPCFailed, ProtocolError) as e:
            logger.info("stage %d: state download from %s failed: %s", self.stage,
                        ", ".join(p[-8:] for p in peers[:2]), e)
            return False
        if not acceptable(snap, expected, peers[:2]):
            logger.warning("stage %d: %s served a state of digest %s (%d applied rounds), not the quorum's %s (%d): "
                           "refused", self.stage, ", ".join(p[-8:] for p in peers[:2]), snap.digest,
                           snap.applied_rounds, expected.digest, expected.applied_rounds)
            return False
        self.state.load(snap.params, snap.momentum, snap.round, snap.applied_rounds, snap.trained_samples)
        self.progress.adopt(snap.trained_samples)
        self.clock.adopt(bounded_round(snap.round, expected.round), get_dht_time())
        self.ledger.adopted(snap.applied_rounds, expected.backers)
        return True

    async def join(self) -> None:
        """Take the stage's current state from a live replica, or start from the seed if none.

        A replica that is averaging refuses (NOT_READY): a joiner must not start from the state a
        round is about to replace (hivemind #445), so it retries until the round is over.
        """
        deadline = time.monotonic() + self.t.state_download
        checkpoint_waits, donor_waits = CHECKPOINT_WAIT.waits(), DONOR_RETRY.waits()
        while True:
            records = await self.swarm.stage_records(self.stage)
            found = quorum(records, self.evidence(records), exclude=(self.peer_id,))
            donors = list(found.holders) if found is not None else []
            if not donors and any(r.state == ONLINE and r.digest for r in records if r.peer_id != self.peer_id):
                # replicas are online but no digest has a strict majority (a tie, or a split):
                # nobody's word decides, so ask again rather than start from the seed
                if time.monotonic() > deadline:
                    raise RuntimeError(f"stage {self.stage}: no state is announced by a strict majority of its "
                                       "replicas within timeouts.state_download; not joining")
                logger.info("stage %d: no digest has a majority of the stage's voices yet; asking again", self.stage)
                await asyncio.sleep(next(donor_waits))
                continue
            if not donors:
                if await self.restore_backup():
                    await self.worker.run(self.state.copy_to, self.worker.module)
                elif self._checkpoint_unknown:
                    # a private run whose coordinator did not answer: its newest checkpoint may be far
                    # ahead of the seed, so wait for it (or for a replica) rather than start over
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"stage {self.stage} is empty and the coordinator, which holds its "
                                           "checkpoints, did not answer within timeouts.state_download; not "
                                           "starting the stage from the seed")
                    await asyncio.sleep(next(checkpoint_waits))
                    continue
                else:
                    self.clock.adopt(0, get_dht_time())
                    self.ledger.adopted(self.state.applied_rounds)
                    self.events.emit("state_initialised", round=self.clock.current, digest=self.state.digest)
                self.progress.expect_group(1 + sum(r.state == ONLINE for r in records if r.peer_id != self.peer_id))
                return
            assert found is not None
            if await self.join_local(records, found):
                await self.worker.run(self.state.copy_to, self.worker.module)
                self.progress.expect_group(1 + len(donors))
                self.from_replica = True
                return
            # two donors at once when there are two; else each in turn
            source = await self._download_any(donors, found)
            if source is not None:
                for _ in range(MAX_JOIN_REFRESHES):
                    newer = await self._superseded() if time.monotonic() < deadline else None
                    if newer is None:
                        break
                    logger.info("stage %d: the state downloaded for round %d was replaced while it travelled; "
                                "downloading the new one", self.stage, self.clock.current)
                    source = await self._download_any(list(newer.holders), newer) or source  # failed: keep ours
                await self.worker.run(self.state.copy_to, self.worker.module)
                self.progress.expect_group(1 + len(donors))
                self.from_replica = True
                self.events.emit("state_loaded", source=source, round=self.clock.current,
                                 applied_rounds=self.state.applied_rounds, digest=self.state.digest,
                                 trained_samples=self.state.trained_samples)
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"could not download stage {self.stage} state from {len(donors)} replicas "
                                   f"within timeouts.state_download")
            await asyncio.sleep(next(donor_waits))

    async def _download_any(self, donors: Sequence[str], expected: Quorum) -> str | None:
        """Download from the donors (two at once when there are two; else each in turn); the
        source(s) that served it, or None if every attempt failed."""
        for order in [donors[i:] + donors[:i] for i in range(len(donors))]:
            if await self.download(order, expected):
                return ",".join(order[:2])
        return None

    async def _superseded(self) -> Quorum | None:
        """The quorum to download again from if its state moved past the one just adopted
        (decisions.join_superseded), else None; a failed read says None: the first round then finds
        out whether the state is stale."""
        with self._rereading:
            records = await self.swarm.stage_records(self.stage)
            evidence = self.evidence(records)
            if decisions.join_superseded(records, self.peer_id, self.state.applied_rounds, evidence):
                return quorum(records, evidence, exclude=(self.peer_id,))
        return None

    async def join_local(self, records: Sequence, found: Quorum) -> bool:
        """A warm standby: this peer holds a backup of the stage (peer/state/backup.py) whose digest is
        the one the stage's majority announces, so it is the stage's current state; adopt it and
        download nothing. A stale or absent copy: False (download as usual)."""
        if self.local_copy is None:
            return False
        digest = found.digest
        snap = self.local_copy(self.stage, digest)
        if snap is None:
            return False
        self.state.load(snap.params, snap.momentum, snap.round, snap.applied_rounds, snap.trained_samples)
        if self.state.digest != digest:  # the copy was checked on arrival; a mismatch here is a bug
            logger.warning("stage %d: local backup does not reproduce its digest; downloading instead", self.stage)
            return False
        self.progress.trained = snap.trained_samples
        self.clock.adopt(bounded_round(max(snap.round, found.round), found.round), get_dht_time())
        self.ledger.adopted(snap.applied_rounds, found.backers)
        self.events.emit("state_loaded", source="local-backup", round=self.clock.current,
                         applied_rounds=self.state.applied_rounds, digest=self.state.digest,
                         trained_samples=self.state.trained_samples)
        logger.info("stage %d: joined from this peer's own backup (round %d), no download", self.stage,
                    snap.applied_rounds)
        return True

    async def restore_backup(self) -> bool:
        """The stage is empty: restore the state that survives it, from the coordinator's newest
        checkpoint (a private run) or the backups its holders have (peer/state/backup.py).
        Reports how many rounds of the stage were lost (the swarm's round against the state's).

        Evidence over claims (docs/trust.md, "Backups"): the coordinator's checkpoint, when it has
        one, wins over any backup, however newer the backup says it is. The coordinator took it from
        the stage's replicas by what their majority announced, and it comes from the run's owner; a
        backup is one replica's push, which the holder could check only for being a current
        replica's and at most one round ahead. A private run may lose the rounds since the last
        checkpoint; it cannot be handed one replica's state. Without a checkpoint (a public run, or
        the coordinator has none or did not answer) the newest backup that is plausible
        (backup.plausible: at most one round ahead of the swarm's corroborated round) is restored."""
        if self.backup_rpc is None and self.checkpoints is None:
            return False
        view: dict[int, list[PeerRecord]] = {}
        with self._finding_backups:  # unread: the coordinator's checkpoint is the one source left
            view = await self.swarm.swarm()
        best: tuple[str, StateSnapshot] | None = None
        if self.backup_rpc is not None and view:
            from swarmgrad.peer.state.backup import (RESTORE_HOLDERS, backup_holders, fetch_backup, lower_median,
                                                     plausible)
            others = [r.round for s, recs in view.items() if s != self.stage for r in recs if r.state == ONLINE]
            swarm_position = lower_median(others) if others else None
            holders = backup_holders(self.identity.run_id, self.stage, view)[:RESTORE_HOLDERS]
            for holder in holders:
                snap = await fetch_backup(self.backup_rpc, holder, self.identity, self.stage, self.state.shapes,
                                          self.max_numel, self.t.state_download)
                if snap is not None and not plausible(snap, swarm_position):
                    logger.warning("stage %d: the backup on %s claims round %d (%d applied), more than one round "
                                   "ahead of the swarm's (%s): not restored", self.stage, holder[-8:], snap.round,
                                   snap.applied_rounds, swarm_position)
                    continue
                if snap is not None and (best is None or snap.applied_rounds > best[1].applied_rounds):
                    best = (holder, snap)
        self._checkpoint_unknown = False
        if self.checkpoints is not None:
            try:
                snap = await self.checkpoints(self.stage)
            except (*NETWORK_FAILURES, CheckpointError) as e:  # down, or sent something unusable: backups only
                logger.warning("stage %d: no checkpoint from the coordinator: %s: %s", self.stage,
                               type(e).__name__, e)
                snap = None
                self._checkpoint_unknown = True
            if snap is not None:  # evidence over claims: the checkpoint wins over any backup (docstring)
                best = ("coordinator", snap)
        if best is None:
            return False
        source, snap = best
        self.state.load(snap.params, snap.momentum, snap.round, snap.applied_rounds, snap.trained_samples)
        self.progress.adopt(snap.trained_samples)
        online = [r.round for s, recs in view.items() if s != self.stage for r in recs if r.state == ONLINE]
        # the swarm's corroborated round (lower median), not its highest claim: one record saying
        # 2^40 must not move the restored stage's clock
        swarm_round = max(snap.round, sorted(online)[(len(online) - 1) // 2]) if online else snap.round
        self.clock.adopt(max(snap.round, swarm_round), get_dht_time())
        self.ledger.adopted(snap.applied_rounds)
        lost = max(0, swarm_round - snap.round)
        self.events.emit("state_restored", source=source, round=self.clock.current, backup_round=snap.round,
                         applied_rounds=snap.applied_rounds, rounds_lost=lost, digest=self.state.digest,
                         trained_samples=snap.trained_samples)
        logger.warning("stage %d was empty: restored its state from %s (%d applied rounds; %d rounds of the stage "
                       "lost)", self.stage, "a checkpoint of the coordinator" if source == "coordinator"
                       else f"a backup on {source[-8:]}", snap.applied_rounds, lost)
        return True

    async def resync(self, round_no: int, result: RoundResult, overlapped: bool = False) -> bool:
        """After a failed round: adopt the state of a replica that completed it, if any did. Others
        may still be finishing the round, so wait until every other member has announced a later
        round (then, if none applied it, nobody did) or as long as a round may take.

        `overlapped`: replicas announce round r + 1 as soon as r's boundary passes, while r still
        averages in the background; only round r + 2 (whose boundary waits for r) says they are done."""
        deadline = time.monotonic() + self.t.matchmaking + self.t.allreduce
        # members that never answered are dead or cut off: they will not announce a later round
        others = [p for p in result.group if p != self.peer_id and p not in result.unreachable]
        member = bool(result.group) and self.peer_id in result.group
        votes = await self._votes(round_no) if member else None
        if votes is not None and decisions.nobody_applied(votes, self.peer_id, group_hash(tuple(result.group)),
                                                       result.voted_digest):
            return False
        # members whose vote we could not read by now (our vote wait is over) are dead or cut off
        silent = [p for p in others if p not in votes] if votes is not None and result.voted_digest else []
        if member:
            await self._say_abandoned(round_no, group_hash(tuple(result.group)))
        waits = DONOR_RETRY.waits()
        while time.monotonic() < deadline:
            records = None
            with self._resync_records:
                records = await self.swarm.stage_records(self.stage)
            if records is None:
                await asyncio.sleep(next(waits))
                continue
            evidence = self.evidence(records)
            donors = decisions.resync_donors(records, self.peer_id, self.state.applied_rounds, result.group,
                                             result.stale, evidence)
            found = quorum([r for r in records if r.peer_id in donors], evidence) if donors else None
            for donor in donors:
                assert found is not None
                if await self.download([donor], found):
                    self.events.emit("resynced", source=donor, round=self.clock.current,
                                     applied_rounds=self.state.applied_rounds, digest=self.state.digest)
                    return True
            if not donors and decisions.resync_settled(records, others, round_no + 1 if overlapped else round_no,
                                                    abandoned=await self._abandoned(round_no) if member else (),
                                                    silent=silent):
                return False
            await asyncio.sleep(next(waits))
        return False

    async def _votes(self, round_no: int) -> dict[str, str] | None:
        """The round's outcome votes (None if they could not be read). If they say no replica
        applied it (decisions.nobody_applied), there is no donor to wait for: without them a failed
        round waits for the others to announce a later round, which they do only after their own
        wait (several seconds of stall)."""
        with self._reading_votes:
            return await within(self.swarm.round_checks(self.stage, round_no), self.t.dht)
        return None

    async def _say_abandoned(self, round_no: int, hash_: str) -> None:
        """Tell the other members that we did not apply the round and will not (decisions.resync_settled)."""
        with self._saying_abandoned:  # unsaid: the others wait for our later round instead
            await within(self.swarm.post_abandoned(self.stage, round_no, self.peer_id, hash_), self.t.dht)

    async def _abandoned(self, round_no: int) -> list[str]:
        """The members that said they abandoned round `round` (none if that could not be read)."""
        with self._reading_abandoned:
            return list(await within(self.swarm.round_abandoned(self.stage, round_no), self.t.dht))
        return []
