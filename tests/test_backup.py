"""Backups of a stage's state, without a network: holder choice by rendezvous hashing, and the
holder's checks on what it is given."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from torch import nn

from swarmgrad.peer.state.backup import BackupPusher, BackupStore, backup_holders
from swarmgrad.peer.decisions import next_push_at
from swarmgrad.peer.manifest import OuterOptConfig
from swarmgrad.peer.state.stage_state import StageState
from swarmgrad.peer.state.sync import state_response
from swarmgrad.peer.records import LEAVING, ONLINE, PeerRecord
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.framing import ProtocolError
from swarmgrad.protocol.validation import RunIdentity, envelope

ID = RunIdentity("run", "h" * 32)


def rec(peer: str, stage: int, state: str = ONLINE) -> PeerRecord:
    return PeerRecord(peer_id=peer, stage=stage, state=state, throughput=1.0, round=0, applied_rounds=0, digest="d",
                      manifest_hash="h", driver=stage == 0)


def test_holders_are_other_stages_in_a_stable_order() -> None:
    view = {0: [rec("a", 0), rec("b", 0)], 1: [rec("c", 1)], 2: [rec("d", 2), rec("e", 2, LEAVING)]}
    holders = backup_holders("run", 1, view)
    assert set(holders) == {"a", "b", "d"}  # not its own stage, not a leaving peer
    assert backup_holders("run", 1, {s: list(reversed(r)) for s, r in reversed(view.items())}) == holders
    # a departure moves only what that peer held: the others keep their order
    without_a = backup_holders("run", 1, {**view, 0: [rec("b", 0)]})
    assert without_a == [h for h in holders if h != "a"]
    assert backup_holders("other-run", 1, view) != holders or len(holders) < 2  # salted by the run


def make_state(seed: int = 0) -> StageState:
    torch.manual_seed(seed)
    return StageState(nn.Linear(4, 3), OuterOptConfig())


def holder_view(run_id: str = "run") -> tuple[str, dict[int, list[PeerRecord]]]:
    """(a peer that holds stage 1's backups, a swarm where "pusher" is stage 1's replica at round 5)."""
    view = {0: [dataclasses.replace(rec(p, 0), round=5) for p in ("a", "b")],
            1: [dataclasses.replace(rec("pusher", 1), round=5, applied_rounds=4)]}
    return backup_holders(run_id, 1, view)[0], view


def test_store_keeps_the_newest_valid_copy_and_serves_it() -> None:
    async def main() -> None:
        state = make_state()
        me, view = holder_view()

        async def swarm() -> dict[int, list[PeerRecord]]:
            return view

        store = BackupStore(ID, 2, lambda s: dict(state.shapes), max_numel=1 << 20, peer_id=me, swarm=swarm,
                            timeout=1.0)
        state.apply_outer({n: torch.ones(s) for n, s in state.shapes.items()}, total_weight=10)
        state.commit(3)
        ack = await store.handle_put(pb.BackupPut(envelope=envelope(ID, 1), state=state_response(state.snapshot)), "pusher")
        assert ack.status == pb.OK and store.copies[1].applied_rounds == 1
        older = make_state(1)
        ack = await store.handle_put(pb.BackupPut(envelope=envelope(ID, 1), state=state_response(older.snapshot)), "pusher")
        assert ack.status == pb.STALE_STATE and store.copies[1].digest == state.digest
        back = await store.handle_get(pb.BackupGet(envelope=envelope(ID, 1)), None)
        assert back.state_digest == state.digest and back.trained_samples == 10
        ack = await store.handle_put(pb.BackupPut(envelope=envelope(ID, 1), state=state_response(state.snapshot)),
                                     "stranger")  # no record under stage 1
        assert ack.status == pb.UNAUTHORIZED and "not an online replica" in ack.reason
        # a held copy far ahead of the stage (planted before, or the stage fell back) blocks nothing
        store.copies[1] = dataclasses.replace(store.copies[1], round=2**40, applied_rounds=2**40)
        ack = await store.handle_put(pb.BackupPut(envelope=envelope(ID, 1), state=state_response(state.snapshot)),
                                     "pusher")
        assert ack.status == pb.OK and store.copies[1].applied_rounds == 1
        with pytest.raises(ProtocolError):  # nothing held for stage 0
            await store.handle_get(pb.BackupGet(envelope=envelope(ID, 0)), None)
        tampered = state_response(state.snapshot)
        tampered.params[0].tensor.buffers[0] = b"\0" * len(tampered.params[0].tensor.buffers[0])
        with pytest.raises(ProtocolError, match="digest"):
            await store.handle_put(pb.BackupPut(envelope=envelope(ID, 1), state=tampered), "pusher")
        with pytest.raises(ProtocolError):  # another run's backup
            await store.handle_put(pb.BackupPut(envelope=envelope(RunIdentity("x", "h" * 32), 1),
                                                state=state_response(state.snapshot)), "pusher")
    asyncio.run(main())


def test_pushes_keep_the_link_busy_for_at_most_their_share() -> None:
    assert next_push_at(100.0, 2.0, 0.05) == pytest.approx(140.0)
    assert next_push_at(100.0, 2.0, 1.0) == 100.0  # no pacing: every round that asks
    assert next_push_at(100.0, 0.01, 0.05) == pytest.approx(100.2)  # a quick push paces nothing at round scale


class TimedHolder:
    """Takes every copy; each put takes `seconds` of the pusher's clock (the link it fills)."""

    def __init__(self, now: list[float], seconds: float):
        self.now, self.seconds, self.puts = now, seconds, []

    async def call(self, holder, method, request, response_type, timeout):
        self.now[0] += self.seconds
        self.puts.append((holder, request.state.applied_rounds))
        return pb.BackupAck(status=pb.OK)


class OneView:
    async def swarm(self):
        return {0: [rec("driver", 0)], 1: [rec("me", 1)]}


def test_a_slow_push_skips_the_rounds_its_share_does_not_cover() -> None:
    async def main() -> None:
        now, events, tasks = [0.0], [], []

        def spawn(coro, name: str) -> asyncio.Task:
            tasks.append(asyncio.create_task(coro, name=name))
            return tasks[-1]

        holder = TimedHolder(now, seconds=2.0)
        pusher = BackupPusher(holder, OneView(), ID, 1, every=1, timeout=5.0, spawn=spawn, link_share=0.1,
                              clock=lambda: now[0], emit=lambda event, **f: events.append(f))
        state = make_state()
        for k in range(1, 8):  # a round every 10 s; a push takes 2 s, so one every 20 s at most
            state.apply_outer({n: torch.ones(s) for n, s in state.shapes.items()}, total_weight=1)
            state.commit(k)
            pusher.after_round("me", ["me", "other"], state.snapshot)
            await asyncio.gather(*tasks)
            now[0] += 10.0
        assert [r for _, r in holder.puts] == [1, 3, 5, 7]
        assert pusher.paced == 3 and pusher.pushed == 4
        assert events[0]["seconds"] == pytest.approx(2.0) and events[0]["next_in_s"] == pytest.approx(18.0)
        assert events[0]["holders"] == ["driver"] and events[0]["bytes"] > 0
        now[0] += 100.0  # long after the last push: only the group's first member pushes
        pusher.after_round("other", ["me", "other"], state.snapshot)
        assert len(tasks) == 4
        pusher.after_round("me", ["me", "other"], state.snapshot)
        assert len(tasks) == 5
        await asyncio.gather(*tasks)

    asyncio.run(main())
