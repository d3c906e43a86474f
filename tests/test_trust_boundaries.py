"""Issue 43, attacks 2, 4 and 6 (docs/trust.md: "Backups", "Join hold", "Round boundaries"), each as
a stranger's (or one admitted peer's) probe of real code: the wire where a live replica is needed
(tests/support/swarm.py: real peers in one event loop, a stranger's client over the loopback
transport), the handler or the pure decision where that shows it."""
from __future__ import annotations

import asyncio
import dataclasses
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.utils import get_dht_time

from swarmgrad.compression import get_codec
from swarmgrad.peer.net.rpc import FramedRPC, Traffic, stage_namespace
from swarmgrad.peer.records import LEAVING
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.validation import encoded_to_proto, raw_from_tensor

from support.swarm import InProcessSwarm, step_manifest

pytestmark = pytest.mark.timeout(120)


# --- 6: rounds end on the driver's signature, never on the `driver` field -----------------------
def test_a_request_naming_a_driver_does_not_end_a_later_stages_round(inprocess) -> None:
    """A stranger sends stage 1 a forward request that names the run's listed driver and the next
    round. Before: the replica ended its round on it (one request per round and the stage runs ahead
    of its drivers, training without averaging). Now it is refused WRONG_ROUND unless the request
    carries the driver's signature of that round; a genuine ticket moves it one round, and the same
    ticket cannot move it a second time."""
    m = step_manifest(10_000)  # one long round: nothing but the probes may end it

    def sign(key: Ed25519PrivateKey, round_no: int) -> bytes:
        from swarmgrad.peer.net.round_tickets import RoundSigner  # here: the probe without one runs on any code
        return RoundSigner(key, m.run_id, m.hash).ticket(round_no)

    def request(driver: str, round_no: int, ticket: bytes = b"") -> pb.ForwardRequest:
        batch, seq = 2, m.model.seq_len
        x, y = torch.randn(batch, seq, m.model.d_model), torch.randint(0, 256, (batch, seq))
        req = pb.ForwardRequest(envelope=pb.Envelope(run_id=m.run_id, manifest_hash=m.hash, stage=1),
                                microbatch_id=7, driver=driver,
                                activations=encoded_to_proto(get_codec(m.pipeline.activation_codec).encode(x)),
                                targets=raw_from_tensor(y), deadline=get_dht_time() + 2.0, eval_only=True,
                                round=round_no)
        if ticket:
            req.round_ticket = ticket
        return req

    async def scenario() -> None:
        async with InProcessSwarm(m) as swarm:
            driver, stage1 = swarm.start(0), swarm.start(1)
            await swarm.wait_for(stage1, lambda e: e["event"] == "online", 30, "stage 1 online")
            await swarm.wait_for(driver, lambda e: e["event"] == "online", 30, "the driver online")
            clock = stage1.peer.replicas[0].clock
            now = clock.current
            rpc = FramedRPC(swarm.client("intruder"), stage_namespace(m.run_id, 1), Traffic(),
                            max_message_bytes=1 << 24)
            for ticket in (lambda: b"", lambda: sign(Ed25519PrivateKey.generate(), now + 1), lambda: b"\0" * 64):
                answer = await rpc.call(stage1.peer_id, "forward", request(driver.peer_id, now + 1, ticket()),
                                        pb.ForwardResponse, timeout=20)
                assert clock.seen <= now and clock.current == now, f"a stranger ended stage 1's round: {answer}"
                assert answer.status == pb.WRONG_ROUND and "ticket" in answer.reason, answer
            assert driver.alive and stage1.alive

            # the driver's own ticket of the next round does end it (what the driver's requests carry)
            genuine = sign(driver.key, now + 1)
            await rpc.call(stage1.peer_id, "forward", request(driver.peer_id, now + 1, genuine), pb.ForwardResponse,
                           timeout=20)
            assert clock.seen == now + 1
            await swarm.until(lambda: clock.current == now + 1, 30, "stage 1 in the next round")
            # replayed for the round after: it signs round now + 1 only
            answer = await rpc.call(stage1.peer_id, "forward", request(driver.peer_id, now + 2, genuine),
                                    pb.ForwardResponse, timeout=20)
            assert answer.status == pb.WRONG_ROUND and "ticket" in answer.reason, answer
            assert clock.seen == now + 1 and clock.current == now + 1

    inprocess(scenario)


# --- 2: backups only from a stage's current replicas, to its holders, at most a round ahead -------
def _planted(state: Any, round_no: int = 2**40) -> Any:
    """`state`'s committed snapshot claiming `round_no` rounds (the digest covers tensors and
    samples, not the counters: it still verifies)."""
    return dataclasses.replace(state.snapshot, round=round_no, applied_rounds=round_no)


def test_a_stranger_cannot_plant_a_backup(inprocess) -> None:
    """A stranger pushes a copy of stage 1 claiming 2^40 rounds to stage 1's backup holder (the driver),
    and one of stage 0 to stage 0's (stage 1's replica). Before: both were taken, the planted copy made every honest push STALE, and it was
    what an emptied stage would be restored from. Now both are refused and honest pushes land."""
    from swarmgrad.peer.state.backup import push_backup
    from swarmgrad.peer.state.stage_state import StageState
    from swarmgrad.peer.model import from_manifest
    from swarmgrad.protocol.validation import RunIdentity

    m = step_manifest(2, averaging={"backup_every": 1, "backup_link_share": 1.0})
    model, identity = from_manifest(m), RunIdentity(m.run_id, m.hash)

    def copy_of(stage: int) -> Any:
        state = StageState(model.build_stage(stage), m.outer)
        state.commit(0)
        return _planted(state)

    async def scenario() -> None:
        async with InProcessSwarm(m) as swarm:
            driver, stage1 = swarm.start(0), swarm.start(1)
            pushed = await swarm.wait_for(stage1, lambda e: e["event"] == "backup", 60, "stage 1's first push")
            assert pushed["holders"] == [driver.peer_id]
            store = driver.peer._backup_store
            rpc = FramedRPC(swarm.client("intruder"), f"swarmgrad/{m.run_id}/backup", Traffic(),
                            max_message_bytes=1 << 26)
            taken = await push_backup(rpc, driver.peer_id, identity, 1, copy_of(1), timeout=20)
            assert store.copies[1].applied_rounds < 2**40, "the planted copy is what stage 1 would restore"
            assert not taken
            taken = await push_backup(rpc, stage1.peer_id, identity, 0, copy_of(0), timeout=20)
            assert not taken and all(c.applied_rounds < 2**40 for c in stage1.peer._backup_store.copies.values())
            # honest pushes still land: the holder's copy follows stage 1's rounds
            held = store.copies[1].applied_rounds
            await swarm.until(lambda: store.copies[1].applied_rounds > held, 60, "a later honest push")

    inprocess(scenario)


def test_a_fresh_id_online_under_a_stage_of_two_cannot_plant_a_backup(inprocess) -> None:
    """The same through real peers: stage 1's two replicas average, a fresh id writes its own
    ONLINE record under stage 1 at their position and pushes the holder (the driver) a copy one
    round ahead. Before, the holder took it; now it reads stage 1's round votes, refuses the copy,
    and the replicas' pushes still land."""
    from swarmgrad.peer.state.backup import push_backup
    from swarmgrad.peer.state.stage_state import StageState
    from swarmgrad.peer.model import from_manifest
    from swarmgrad.protocol.validation import RunIdentity
    from support.hostile import Forgers

    m = step_manifest(2, averaging={"backup_every": 1, "backup_link_share": 1.0})
    model, identity = from_manifest(m), RunIdentity(m.run_id, m.hash)

    async def scenario() -> None:
        async with InProcessSwarm(m) as swarm:
            driver, a, b = swarm.start(0), swarm.start(1), swarm.start(1)
            await swarm.until(lambda: a.events("backup") or b.events("backup"), 60, "a push of stage 1's pair")
            store = driver.peer._backup_store
            assert [e["holders"] for e in a.events("backup") + b.events("backup")][0] == [driver.peer_id]
            held = store.copies[1]
            planter = Forgers(swarm, 1, "planter")
            await planter.announce(1, applied_rounds=held.applied_rounds, digest=held.digest, round_no=held.round)
            state = StageState(model.build_stage(1), m.outer)
            state.commit(0)
            copy = dataclasses.replace(state.snapshot, round=held.round + 1, applied_rounds=held.applied_rounds + 1)
            rpc = FramedRPC(swarm.client("planter"), f"swarmgrad/{m.run_id}/backup", Traffic(),
                            max_message_bytes=1 << 26)
            taken = await push_backup(rpc, driver.peer_id, identity, 1, copy, timeout=20)
            assert not taken and store.copies[1].digest != copy.digest, "a fresh id's copy is what stage 1 restores"
            now = store.copies[1].applied_rounds
            await swarm.until(lambda: store.copies[1].applied_rounds > now, 60, "a later honest push")

    inprocess(scenario)


def test_a_stage_of_one_replica_takes_backups_only_from_the_replica_that_serves_it(inprocess) -> None:
    """A lone replica posts no votes, so no completed round of its stage is ever seen. Its copies are
    taken once it has been the stage's one live record while the holder trained (a microbatch goes
    through every stage). A fresh id writing an ONLINE record beside it and pushing a copy one round
    ahead was taken before (and restored if the stage emptied); now it is refused, and the lone
    replica's pushes still land."""
    from swarmgrad.peer.state.backup import push_backup
    from swarmgrad.peer.state.stage_state import StageState
    from swarmgrad.peer.model import from_manifest
    from swarmgrad.protocol.validation import RunIdentity
    from support.hostile import Forgers

    m = step_manifest(2, averaging={"backup_every": 1, "backup_link_share": 1.0})
    model, identity = from_manifest(m), RunIdentity(m.run_id, m.hash)

    async def scenario() -> None:
        async with InProcessSwarm(m) as swarm:
            driver, lone = swarm.start(0), swarm.start(1)
            await swarm.wait_for(lone, lambda e: e["event"] == "backup", 60, "the lone replica's first push")
            store = driver.peer._backup_store
            held = store.copies[1]
            planter = Forgers(swarm, 1, "beside")
            await planter.announce(1, applied_rounds=held.applied_rounds, digest=held.digest, round_no=held.round)
            state = StageState(model.build_stage(1), m.outer)
            state.commit(0)
            copy = dataclasses.replace(state.snapshot, round=held.round + 1, applied_rounds=held.applied_rounds + 1)
            rpc = FramedRPC(swarm.client("beside"), f"swarmgrad/{m.run_id}/backup", Traffic(),
                            max_message_bytes=1 << 26)
            for _ in range(2):
                assert not await push_backup(rpc, driver.peer_id, identity, 1, copy, timeout=20)
                assert store.copies[1].digest != copy.digest, "a fresh id's copy is what stage 1 restores"
            now = store.copies[1].applied_rounds
            await swarm.until(lambda: store.copies[1].applied_rounds > now, 60, "a later push of the lone replica")

    inprocess(scenario)


def test_a_lone_replica_is_the_stages_pusher_once_the_holder_trained() -> None:
    """BackupStore over a scripted swarm: stage 1's one live record is "lone"; no completed round
    of it exists. Its first push is refused (the holder first sees it alone), taken once the holder
    trained since; a fresh id's record beside it gets nothing, nor alone in a stage nothing trains."""
    from swarmgrad.peer.state.backup import BackupStore, backup_holders, put_refusal
    from swarmgrad.peer.state.sync import state_response
    from swarmgrad.protocol.validation import RunIdentity, envelope
    from support.records import rec
    from support.state import trained

    identity = RunIdentity("run", "h" * 32)
    view = {0: [rec(f"d{i}", stage=0, round_no=9) for i in range(3)], 1: [rec("lone", round_no=9, applied=8)]}
    me = backup_holders("run", 1, view)[0]
    assert "not shown to serve" in put_refusal(view, "run", 1, "lone", me, 10, 9, served_alone=False)
    assert put_refusal(view, "run", 1, "lone", me, 10, 9, served_alone=True) is None
    honest = dataclasses.replace(trained(1).snapshot, round=9, applied_rounds=8)
    planted = dataclasses.replace(trained(2).snapshot, round=10, applied_rounds=9)
    microbatches = [0]

    async def swarm() -> dict:
        return view

    async def votes(stage: int, round_no: int) -> tuple[dict, dict]:
        return {}, {}

    async def main() -> None:
        store = BackupStore(identity, 2, lambda s: dict(trained().shapes), 1 << 22, peer_id=me, swarm=swarm,
                            timeout=1.0, votes=votes, trained=lambda: microbatches[0])

        def put(snapshot: Any, caller: str) -> Any:
            return store.handle_put(pb.BackupPut(envelope=envelope(identity, 1), state=state_response(snapshot)),
                                    caller)
        assert (await put(honest, "lone")).status == pb.UNAUTHORIZED
        microbatches[0] += 4
        assert (await put(honest, "lone")).status == pb.OK
        view[1] = [rec("lone", round_no=9, applied=8), rec("fresh", round_no=9, applied=8)]
        microbatches[0] += 4
        ack = await put(planted, "fresh")
        assert ack.status == pb.UNAUTHORIZED and "not shown to serve" in ack.reason, ack
        assert (await put(honest, "lone")).status == pb.OK  # the pusher of the copy held
        view[1] = [rec("fresh", round_no=9, applied=8)]  # the lone replica left: nothing trains now
        for _ in range(3):
            assert (await put(planted, "fresh")).status == pb.UNAUTHORIZED
        assert store.copies[1].digest == honest.digest

    asyncio.run(main())


def test_whose_backup_a_holder_takes() -> None:
    """backup.put_refusal over one snapshot of the swarm: a current replica of the stage, pushing to
    one of the stage's holders, at most one round ahead of what the stage's replicas announce (lower
    medians: one record claiming more moves nothing)."""
    from swarmgrad.peer.state.backup import RESTORE_HOLDERS, backup_holders, put_refusal
    from support.records import rec

    view = {0: [rec(f"d{i}", stage=0, round_no=9) for i in range(6)],
            1: [rec("r1", round_no=9, applied=8), rec("r2", round_no=9, applied=8),
                rec("liar", round_no=2**40, applied=2**40), rec("gone", state=LEAVING, round_no=9, applied=8)]}
    holders = backup_holders("run", 1, view)
    me, not_me = holders[0], holders[RESTORE_HOLDERS]
    assert put_refusal(view, "run", 1, "r1", me, 10, 9) is None  # the round just applied
    assert put_refusal(view, "run", 1, "liar", me, 10, 9) is None  # a replica's honest-looking copy
    assert "not an online replica" in put_refusal(view, "run", 1, "stranger", me, 10, 9)
    assert "not an online replica" in put_refusal(view, "run", 1, "gone", me, 10, 9)
    assert "not an online replica" in put_refusal(view, "run", 1, "d0", me, 10, 9)  # another stage's
    assert "does not hold" in put_refusal(view, "run", 1, "r1", not_me, 10, 9)
    assert "ahead" in put_refusal(view, "run", 1, "liar", me, 2**40, 2**40)
    assert "ahead" in put_refusal(view, "run", 1, "r1", me, 11, 10)  # two rounds ahead
    # an emptied stage whose one record is a forger's: its claims are bounded by the swarm's round
    emptied = {0: [rec(f"d{i}", stage=0, round_no=9) for i in range(6)],
               1: [rec("forger", round_no=2**40, applied=2**40)]}
    holder = backup_holders("run", 1, emptied)[0]
    assert "the swarm" in put_refusal(emptied, "run", 1, "forger", holder, 2**40, 2**40)
    assert put_refusal(emptied, "run", 1, "forger", holder, 10, 9) is None


def _completed(*members: str, applied: int = 8) -> tuple[dict[str, str], dict[str, dict]]:
    """The outcome votes and registrations of a round in which `members` averaged and all applied it."""
    from swarmgrad.peer.averaging.group import group_hash
    from swarmgrad.peer.averaging.outcome import vote
    ids = tuple(sorted(members))
    return ({p: vote(group_hash(ids), "mean") for p in ids},
            {p: {"digest": "theta", "applied_rounds": applied, "weight": 1.0} for p in ids})


def test_only_replicas_proven_by_voted_rounds_count_as_the_stages_pushers() -> None:
    """backup.put_refusal with the holder's evidence: once it saw a completed round of the stage,
    an ONLINE record is no longer enough (a fresh id writes its own), the pusher must have voted
    in a completed round of the stage; the pusher of the copy held stays one (a replica whose
    partners left posts no votes); before any completed round, every ONLINE record counts."""
    from swarmgrad.peer.state.backup import backup_holders, put_refusal
    from support.records import rec

    view = {0: [rec(f"d{i}", stage=0, round_no=9) for i in range(6)],
            1: [rec(p, round_no=9, applied=8) for p in ("r1", "r2", "fresh", "lone")]}
    me = backup_holders("run", 1, view)[0]
    proven = frozenset({"r1", "r2"})
    assert put_refusal(view, "run", 1, "r1", me, 10, 9, proven=proven) is None
    assert "not a proven replica" in put_refusal(view, "run", 1, "fresh", me, 10, 9, proven=proven)
    assert put_refusal(view, "run", 1, "fresh", me, 10, 9) is None  # no completed round seen yet: as before
    assert put_refusal(view, "run", 1, "lone", me, 10, 9, proven=frozenset(), held_from="lone") is None
    assert "not a proven replica" in put_refusal(view, "run", 1, "fresh", me, 10, 9, proven=frozenset(),
                                                  held_from="lone")
    assert "not an online replica" in put_refusal(view, "run", 1, "stranger", me, 10, 9, proven=proven | {"stranger"})


def test_a_fresh_id_with_its_own_record_cannot_plant_a_backup() -> None:
    """Stage 1's replicas r1 and r2 completed round 8; a fresh id writes its own ONLINE record under
    stage 1 and pushes a copy one round ahead to the stage's holder. Before, the copy was taken (it
    is a current replica by its record) and an emptied stage was restored from it in a public run.
    Now the holder reads the stage's round votes: the fresh id did no work there, and is refused;
    r1's honest push is still taken (BackupStore.handle_put over a scripted swarm)."""
    from swarmgrad.peer.state.backup import BackupStore, backup_holders
    from swarmgrad.peer.state.sync import state_response
    from swarmgrad.protocol.validation import RunIdentity, envelope
    from support.records import rec
    from support.state import trained

    identity = RunIdentity("run", "h" * 32)
    view = {0: [rec(f"d{i}", stage=0, round_no=9) for i in range(3)],
            1: [rec(p, round_no=9, applied=8) for p in ("r1", "r2", "fresh")]}
    me = backup_holders("run", 1, view)[0]
    honest = dataclasses.replace(trained(1).snapshot, round=9, applied_rounds=8)
    planted = dataclasses.replace(trained(2).snapshot, round=10, applied_rounds=9)
    reads: list[tuple[int, int]] = []

    async def swarm() -> dict:
        return view

    async def votes(stage: int, round_no: int) -> tuple[dict, dict]:
        reads.append((stage, round_no))
        return _completed("r1", "r2") if (stage, round_no) == (1, 8) else ({}, {})

    async def main() -> None:
        store = BackupStore(identity, 2, lambda s: dict(trained().shapes), 1 << 22, peer_id=me, swarm=swarm,
                            timeout=1.0, votes=votes)

        def put(snapshot: Any, caller: str) -> Any:
            return store.handle_put(pb.BackupPut(envelope=envelope(identity, 1), state=state_response(snapshot)),
                                    caller)
        ack = await put(planted, "fresh")
        assert ack.status == pb.UNAUTHORIZED and "not a proven replica" in ack.reason, ack
        assert 1 not in store.copies
        ack = await put(honest, "r1")
        assert ack.status == pb.OK and store.copies[1].digest == honest.digest
        assert (await put(planted, "fresh")).status == pb.UNAUTHORIZED and store.copies[1].digest == honest.digest
        assert (1, 8) in reads

    async def first_rounds() -> None:
        """Before the stage's first completed round a record is enough, as before; a copy taken so
        gives its pusher no standing once a completed round is seen."""
        seen: dict[tuple[int, int], Any] = {}

        async def later_votes(stage: int, round_no: int) -> tuple[dict, dict]:
            return seen.get((stage, round_no), ({}, {}))

        store = BackupStore(identity, 2, lambda s: dict(trained().shapes), 1 << 22, peer_id=me, swarm=swarm,
                            timeout=1.0, votes=later_votes)
        request = pb.BackupPut(envelope=envelope(identity, 1), state=state_response(honest))
        assert (await store.handle_put(request, "fresh")).status == pb.OK
        seen[(1, 8)] = _completed("r1", "r2")
        request = pb.BackupPut(envelope=envelope(identity, 1), state=state_response(planted))
        ack = await store.handle_put(request, "fresh")
        assert ack.status == pb.UNAUTHORIZED and store.copies[1].digest == honest.digest, ack

    asyncio.run(main())
    asyncio.run(first_rounds())


def test_a_restore_prefers_evidence_to_claims(monkeypatch: pytest.MonkeyPatch) -> None:
    """An emptied stage: one holder has a planted copy (2^40 rounds), another an honest one. Before,
    the planted one won (the most applied rounds), and moved the refill's clock 2^40 rounds ahead.
    Now it is not plausible (more than one round ahead of the swarm's corroborated round) and the
    honest one is restored; in a private run the coordinator's checkpoint wins over both."""
    from swarmgrad.peer.clock import RoundClock
    from swarmgrad.peer.compute.schedule import TrainingProgress
    from swarmgrad.peer.events import EventLog
    from swarmgrad.peer.manifest import RoundsConfig, ScheduleConfig, TimeoutsConfig
    from swarmgrad.peer.state import backup
    from swarmgrad.peer.state.phase import ReplicaPhase
    from swarmgrad.peer.state.sync import StateSync
    from support.records import rec
    from support.state import trained

    view = {0: [rec(f"d{i}", stage=0, round_no=10) for i in range(3)] + [rec("liar", stage=0, round_no=2**40)]}
    holders = backup.backup_holders("run", 1, view)
    honest = dataclasses.replace(trained(1).snapshot, round=10, applied_rounds=9)
    copies = {holders[0]: _planted(trained(2)), holders[1]: honest}

    async def fetch(rpc: Any, holder: str, *args: Any, **kwargs: Any) -> Any:
        return copies.get(holder)

    monkeypatch.setattr(backup, "fetch_backup", fetch)

    class Swarm:
        async def swarm(self) -> dict:
            return view

    def restore(checkpoint: Any = None) -> tuple[StateSync, bool]:
        clock = RoundClock(RoundsConfig(), counts_steps=False, max_rounds=0, epoch=None)
        s = StateSync(rpc=None, swarm=Swarm(), identity=SimpleNamespace(run_id="run"), peer_id="refill",  # type: ignore[arg-type]
                      stage=1, state=trained(3), worker=None, clock=clock, progress=TrainingProgress(ScheduleConfig()),  # type: ignore[arg-type]
                      events=EventLog(None), phase=ReplicaPhase(), timeouts=TimeoutsConfig(), max_numel=1 << 22,
                      backup_rpc=object())  # type: ignore[arg-type]
        if checkpoint is not None:
            async def checkpoints(stage: int) -> Any:
                return checkpoint
            s.checkpoints = checkpoints
        return s, asyncio.run(s.restore_backup())

    s, ok = restore()
    assert ok and s.state.applied_rounds == 9 and s.state.digest == honest.digest
    assert s.clock.current == 10  # the swarm's corroborated round, not the liar's record
    checkpoint = dataclasses.replace(trained(4).snapshot, round=8, applied_rounds=7)
    s, ok = restore(checkpoint)
    assert ok and s.state.applied_rounds == 7 and s.state.digest == checkpoint.digest


# --- 4: a join hold only for a plausible joiner, once per id, within a budget --------------------
def test_a_stranger_cannot_stall_a_stage_with_join_holds(inprocess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stranger announces itself JOINING under a stage and asks its replica for one small part of
    the state. Before: the replica held its next boundary for it (timeouts.join_hold; with fresh
    ids every round, the stage never trained). Now a part is no download: no hold. The whole state
    earns one hold, which ends once its download has not moved for JOIN_HOLD_STALL_SECONDS (here 1 s
    of the 2 s join_hold: the stranger never lands it); the same id asking again earns none, and
    fresh ids share what is left of the replica's hold budget (join_hold in all per 10 x join_hold)."""
    from swarmgrad.peer.rounds import runner

    monkeypatch.setattr(runner, "JOIN_HOLD_STALL_SECONDS", 1.0, raising=False)  # absent before this change
    from swarmgrad.peer.net.dht_view import SwarmView
    from swarmgrad.peer.records import JOINING, PeerRecord
    from support.swarm import peer_ids

    m = step_manifest(2, stages={"count": 1}, timeouts={"join_hold": 2.0})

    async def scenario() -> None:
        async with InProcessSwarm(m) as swarm:
            a = swarm.start(0)
            await swarm.wait_for(a, lambda e: e["event"] == "round" and e["round"] >= 2, 30, "A's rounds")
            replica = a.peer.replicas[0]
            shapes = replica.state.shapes
            clients: dict[str, FramedRPC] = {}

            async def ask(seed: str, part: list[str]) -> None:
                """As a joiner would: a JOINING record of stage 0, then a state request (retried
                while A is between rounds)."""
                peer = peer_ids(1, seed)[0]
                view = SwarmView(swarm.dht.node(peer), m.run_id, m.hash, 1, 5.0, m.timeouts.announce_ttl)
                await view.announce(PeerRecord(peer_id=peer, stage=0, state=JOINING, throughput=1.0, round=0,
                                               applied_rounds=0, digest="", manifest_hash=m.hash, driver=False))
                if seed not in clients:
                    clients[seed] = FramedRPC(swarm.client(seed), stage_namespace(m.run_id, 0), Traffic(),
                                              max_message_bytes=1 << 26)
                rpc = clients[seed]
                request = pb.StateRequest(envelope=pb.Envelope(run_id=m.run_id, manifest_hash=m.hash, stage=0),
                                          names=part)
                for _ in range(100):
                    answer = await rpc.call(a.peer_id, "state", request, pb.StateResponse, timeout=10)
                    if answer.status == pb.OK:
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError(f"A never served {seed}: {answer.status} {answer.reason}")

            def holds() -> list[dict]:
                return a.events("join_hold")

            async def rounds_after(n: int) -> None:
                start = replica.clock.current
                await swarm.until(lambda: replica.clock.current >= start + n, 30, f"{n} more rounds of A")

            await ask("stranger", [min(shapes, key=lambda n: math.prod(shapes[n]))])
            await rounds_after(3)
            assert not holds(), f"A held its boundary for one small part: {holds()}"
            stranger = peer_ids(1, "stranger")[0]
            await ask("stranger", [])  # the whole state: a joiner's download earns one hold
            await rounds_after(3)
            assert [h["joiners"] for h in holds()] == [[stranger]], holds()
            assert holds()[0]["held_s"] < 1.8, holds()  # ended by the stalled download, not join_hold
            await ask("stranger", [])  # not twice for one id
            for i in range(3):  # fresh ids share what is left of the budget: 2 s in all per 20 s
                await ask(f"fresh{i}", [])
                await rounds_after(2)
            assert sum(stranger in h["joiners"] for h in holds()) == 1, holds()
            assert sum(h["held_s"] for h in holds()) <= 2.0 + 0.5, holds()

    inprocess(scenario)


def test_who_a_boundary_is_held_for_and_for_how_long() -> None:
    """decisions.join_hold's gates and decisions.join_hold_left's budget, without a network."""
    from swarmgrad.peer import decisions
    from swarmgrad.peer.records import JOINING
    from support.records import rec

    served = {"whole": 100.0, "part": 100.0, "again": 100.0}
    records = [rec(p, state=JOINING, digest="seed") for p in served]
    shares = {"whole": 1.0, "part": 0.01, "again": 1.0}
    waiting, settled = decisions.join_hold(served, records, "ours", 105.0, 30.0, shares=shares, min_share=0.25,
                                           held_before={"again"})
    assert waiting == ["whole"] and settled == []  # the others are neither waited for nor forgotten
    # a download that has not moved for `stall` seconds: no longer waited for
    active = {"whole": 100.0}
    assert decisions.join_hold(served, records, "ours", 105.0, 30.0, shares=shares, min_share=0.25,
                               held_before={"again"}, active=active, stall=10.0)[0] == ["whole"]
    assert decisions.join_hold(served, records, "ours", 111.0, 30.0, shares=shares, min_share=0.25,
                               held_before={"again"}, active=active, stall=10.0)[0] == []
    # the budget: 30 s of holding in any 300 s, however the holds fall
    assert decisions.join_hold_left([], 1000.0, 30.0, 300.0) == 30.0
    assert decisions.join_hold_left([(900.0, 920.0)], 1000.0, 30.0, 300.0) == 10.0
    assert decisions.join_hold_left([(690.0, 730.0)], 1000.0, 30.0, 300.0) == 0.0  # 30 s of it fall inside
    assert decisions.join_hold_left([(600.0, 690.0)], 1000.0, 30.0, 300.0) == 30.0  # all before the window


def test_an_honest_drivers_requests_carry_its_tickets(inprocess, monkeypatch: pytest.MonkeyPatch) -> None:
    """The honest path: a driver's requests of each new round carry its ticket, relayed across
    stages, and every later stage verifies it once per round (none refused)."""
    from swarmgrad.peer.net import round_tickets

    checks: list[tuple[str, int, str | None]] = []
    original = round_tickets.VerifiedTickets.refusal

    def recording(self, driver: str, round_no: int, ticket: bytes) -> str | None:  # type: ignore[no-untyped-def]
        why = original(self, driver, round_no, ticket)
        checks.append((driver, round_no, why))
        return why

    monkeypatch.setattr(round_tickets.VerifiedTickets, "refusal", recording)
    m = step_manifest(2, stages={"count": 3}, model={"n_layers": 3})

    async def scenario() -> None:
        async with InProcessSwarm(m) as swarm:
            driver, _, last = swarm.start(0), swarm.start(1), swarm.start(2)
            await swarm.wait_for(last, lambda e: e["event"] == "round" and e["round"] >= 2 and e["samples"] > 0, 60,
                                 "two trained rounds on the last stage")
            assert checks and all(d == driver.peer_id and why is None for d, _, why in checks), checks
            assert {r for _, r, _ in checks} >= {1, 2}

    inprocess(scenario)
