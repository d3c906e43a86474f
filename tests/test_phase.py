"""A replica's phase (peer/state/phase.py): the allowed transitions, what each phase announces and
whether it serves the state, the one writer, and the state server reading it."""
from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from swarmgrad.peer.manifest import TimeoutsConfig
from swarmgrad.peer.records import JOINING, LEAVING, ONLINE, STATES
from swarmgrad.peer.state.phase import TRANSITIONS, Phase, ReplicaPhase, presence_status, serves_state
from swarmgrad.peer.state.sync import StateSync
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.framing import ProtocolError
from swarmgrad.protocol.validation import RunIdentity, envelope

from support.state import trained

PEER = Path(__file__).resolve().parent.parent / "peer"
ID = RunIdentity("run", "h" * 32)


def at(*path: Phase) -> ReplicaPhase:
    """A phase walked from JOINING along `path`."""
    phase = ReplicaPhase()
    for p in path:
        phase.enter(p)
    return phase


# a way to reach each phase from the start
ROUTE = {
    Phase.JOINING: (),
    Phase.SERVING: (Phase.SERVING,),
    Phase.AVERAGING: (Phase.SERVING, Phase.AVERAGING),
    Phase.HOLDING: (Phase.SERVING, Phase.AVERAGING, Phase.HOLDING),
    Phase.OVERLAPPED: (Phase.SERVING, Phase.AVERAGING, Phase.OVERLAPPED),
    Phase.LEAVING: (Phase.LEAVING,),
}


def test_a_replica_starts_joining() -> None:
    phase = ReplicaPhase()
    assert phase.current is Phase.JOINING and phase.status == JOINING and not phase.online


def test_every_transition_is_allowed_or_refused_as_the_table_says() -> None:
    for old in Phase:
        for new in Phase:
            phase = at(*ROUTE[old])
            assert phase.current is old
            if new is old or old is Phase.LEAVING or new in TRANSITIONS[old]:
                phase.enter(new)
                assert phase.current is (old if old is Phase.LEAVING else new)
            else:
                with pytest.raises(ValueError, match=f"from {old.name} to {new.name}"):
                    phase.enter(new)
                assert phase.current is old, "a refused move changes nothing"


def test_the_rounds_walk_through_the_table() -> None:
    """The moves the round runner makes, in order: a first join, a plain round, a held boundary, an
    overlapped round landing mid-round and one landing at the next boundary, a stale re-sync in
    each kind of round, the way out."""
    phase = at(Phase.SERVING,
               Phase.AVERAGING, Phase.SERVING,                                      # a plain round
               Phase.AVERAGING, Phase.HOLDING, Phase.AVERAGING, Phase.SERVING,      # held for a joiner
               Phase.AVERAGING, Phase.JOINING, Phase.AVERAGING, Phase.SERVING,      # stale: re-synced
               Phase.AVERAGING, Phase.OVERLAPPED, Phase.SERVING,                    # landed mid-round
               Phase.AVERAGING, Phase.OVERLAPPED, Phase.AVERAGING,                  # landed at the boundary
               Phase.OVERLAPPED, Phase.JOINING, Phase.OVERLAPPED, Phase.SERVING)   # stale in the background
    assert phase.current is Phase.SERVING
    phase.enter(Phase.LEAVING)
    phase.enter(Phase.SERVING)  # a round that ends while its replica leaves: LEAVING is final
    assert phase.current is Phase.LEAVING and phase.status == LEAVING


def test_the_presence_status_is_derived_with_the_wire_values() -> None:
    assert (JOINING, ONLINE, LEAVING) == ("joining", "online", "leaving") and set(STATES) == {JOINING, ONLINE, LEAVING}
    assert {p: presence_status(p) for p in Phase} == {
        Phase.JOINING: "joining", Phase.SERVING: "online", Phase.AVERAGING: "online", Phase.HOLDING: "online",
        Phase.OVERLAPPED: "online", Phase.LEAVING: "leaving"}
    assert {p for p in Phase if serves_state(p)} == {Phase.SERVING, Phase.HOLDING}


def test_readers_wake_on_a_change_and_not_on_a_non_move() -> None:
    async def main() -> None:
        phase = at(Phase.SERVING, Phase.AVERAGING, Phase.OVERLAPPED)
        waiter = asyncio.ensure_future(phase.wait_while((Phase.OVERLAPPED, Phase.JOINING)))
        await asyncio.sleep(0)
        phase.enter(Phase.OVERLAPPED)  # no move
        phase.enter(Phase.JOINING)  # still one of the phases it waits through
        phase.enter(Phase.OVERLAPPED)
        await asyncio.sleep(0.01)
        assert not waiter.done()
        phase.enter(Phase.SERVING)
        assert await asyncio.wait_for(waiter, 1.0) is Phase.SERVING
        assert await phase.wait_while((Phase.AVERAGING,)) is Phase.SERVING  # not in them: at once
    asyncio.run(main())


def test_only_the_round_runner_moves_the_phase() -> None:
    writers = sorted(str(p.relative_to(PEER)) for p in PEER.rglob("*.py")
                     if re.search(r"\.enter\(", p.read_text()))
    assert writers == ["rounds/runner.py"], writers


# --- the state server reads it ----------------------------------------------------------------------
def sync_at(phase: ReplicaPhase) -> StateSync:
    return StateSync(rpc=None, swarm=None, identity=ID, peer_id="me", stage=1, state=trained(seed=3),  # type: ignore[arg-type]
                     worker=None, clock=None, progress=None, events=None,  # type: ignore[arg-type]
                     phase=phase, timeouts=TimeoutsConfig(matchmaking=0.1, allreduce=0.2), max_numel=1 << 22)


async def ask(sync: StateSync, peer: str = "joiner") -> pb.StateResponse:
    return await sync.handle(pb.StateRequest(envelope=envelope(ID, 1)), peer)  # type: ignore[arg-type]


def test_the_state_is_served_in_the_phases_that_serve_it_and_refused_at_once_in_the_others() -> None:
    async def main() -> None:
        for p in Phase:
            if p is Phase.OVERLAPPED:
                continue  # waits: below
            sync = sync_at(at(*ROUTE[p]))
            if serves_state(p):
                assert (await ask(sync)).status == pb.OK and "joiner" in sync.served
            else:
                with pytest.raises(ProtocolError) as refused:
                    await asyncio.wait_for(ask(sync), 0.05)  # at once, not after a wait
                assert refused.value.status == pb.NOT_READY and not sync.served, p
    asyncio.run(main())


def test_an_overlapped_round_answers_with_the_state_it_lands() -> None:
    """A request that arrives while an overlapped round averages waits for its mean, through a
    stale replica's re-sync, and gets the state it made; past the wait (matchmaking + allreduce)
    it is refused; a replica that leaves meanwhile refuses it."""
    async def main() -> None:
        phase = at(*ROUTE[Phase.OVERLAPPED])
        sync = sync_at(phase)
        waiting = asyncio.ensure_future(ask(sync))
        await asyncio.sleep(0.05)
        phase.enter(Phase.JOINING)
        await asyncio.sleep(0.01)
        phase.enter(Phase.OVERLAPPED)
        sync.state.apply_outer({n: 0.5 * t for n, t in sync.state.params.items()}, total_weight=8)
        sync.state.commit(3)
        phase.enter(Phase.AVERAGING)  # landed at the next boundary: the state it made is committed
        resp = await asyncio.wait_for(waiting, 1.0)
        assert resp.status == pb.OK and resp.state_digest == sync.state.digest and resp.round == 3

        phase = at(*ROUTE[Phase.OVERLAPPED])
        sync = sync_at(phase)
        with pytest.raises(ProtocolError) as refused:
            await ask(sync)  # the mean does not land within 0.3 s
        assert refused.value.status == pb.NOT_READY and not sync.served

        phase = at(*ROUTE[Phase.OVERLAPPED])
        sync = sync_at(phase)
        waiting = asyncio.ensure_future(ask(sync))
        await asyncio.sleep(0.01)
        phase.enter(Phase.LEAVING)
        with pytest.raises(ProtocolError) as refused:
            await asyncio.wait_for(waiting, 1.0)
        assert refused.value.status == pb.NOT_READY and not sync.served
    asyncio.run(main())
