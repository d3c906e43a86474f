"""Backups of a stage's state, without a network: holder choice by rendezvous hashing, and the
holder's checks on what it is given."""
from __future__ import annotations

import asyncio

import pytest
import torch
from torch import nn

from swarmgrad.peer.backup import BackupStore, backup_holders
from swarmgrad.peer.manifest import OuterOptConfig
from swarmgrad.peer.state import StageState
from swarmgrad.peer.state_sync import state_response
from swarmgrad.peer.swarm import LEAVING, ONLINE, PeerRecord
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


def test_store_keeps_the_newest_valid_copy_and_serves_it() -> None:
    async def main() -> None:
        state = make_state()
        store = BackupStore(ID, 2, lambda s: dict(state.shapes), max_numel=1 << 20)
        state.apply_outer({n: torch.ones(s) for n, s in state.shapes.items()}, total_weight=10)
        state.commit(3)
        ack = await store.handle_put(pb.BackupPut(envelope=envelope(ID, 1), state=state_response(state.snapshot)), None)
        assert ack.status == pb.OK and store.copies[1].applied_rounds == 1
        older = make_state(1)
        ack = await store.handle_put(pb.BackupPut(envelope=envelope(ID, 1), state=state_response(older.snapshot)), None)
        assert ack.status == pb.STALE_STATE and store.copies[1].digest == state.digest
        back = await store.handle_get(pb.BackupGet(envelope=envelope(ID, 1)), None)
        assert back.state_digest == state.digest and back.trained_samples == 10
        with pytest.raises(ProtocolError):  # nothing held for stage 0
            await store.handle_get(pb.BackupGet(envelope=envelope(ID, 0)), None)
        tampered = state_response(state.snapshot)
        tampered.params[0].tensor.buffers[0] = b"\0" * len(tampered.params[0].tensor.buffers[0])
        with pytest.raises(ProtocolError, match="digest"):
            await store.handle_put(pb.BackupPut(envelope=envelope(ID, 1), state=tampered), None)
        with pytest.raises(ProtocolError):  # another run's backup
            await store.handle_put(pb.BackupPut(envelope=envelope(RunIdentity("x", "h" * 32), 1),
                                                state=state_response(state.snapshot)), None)
    asyncio.run(main())
