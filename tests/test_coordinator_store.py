"""The coordinator's state dir keeps the newest K checkpoints and its in-memory index in step with disk."""
from __future__ import annotations

from pathlib import Path

from swarmgrad.peer.coordinator.store import StateDir


def info(round_no: int) -> dict:
    return {"round": round_no, "applied_rounds": round_no, "trained_samples": 10 * round_no, "digest": f"d{round_no}"}


def test_checkpoints_kept_and_indexed(tmp_path: Path) -> None:
    store = StateDir(tmp_path, "run", keep_checkpoints=2)
    assert store.checkpoint_rounds() == [] and store.newest(0) is None
    for r in (3, 6, 9):
        store.write_checkpoint(r, {0: (b"s0-%d" % r, info(r)), 1: (b"s1-%d" % r, info(r))}, "run_id = 'run'", 2)
    assert store.checkpoint_rounds() == [6, 9]
    assert not (tmp_path / "checkpoints" / "round-00000003").exists()
    newest = store.newest(1)
    assert newest is not None and newest.round == 9 and newest.path.read_bytes() == b"s1-9"
    # a half-written round (files, no index yet) is not a checkpoint, for a fresh reader either
    (tmp_path / "checkpoints" / "round-00000012").mkdir()
    (tmp_path / "checkpoints" / "round-00000012" / "stage-0.safetensors").write_bytes(b"partial")
    again = StateDir(tmp_path, "run", keep_checkpoints=2)
    assert again.checkpoint_rounds() == [6, 9]
    assert again.checkpoint(6) == store.checkpoint(6)
    # the returned index is a copy: a caller cannot edit the store's
    again.checkpoint(9).clear()
    assert set(again.checkpoint(9)) == {0, 1}


def test_a_checkpoint_keeps_the_data_position(tmp_path: Path) -> None:
    from swarmgrad.peer.shards.leases import DataPosition, DriverRecord, Lease, swarm_position
    from support.swarm import peer_ids
    a, b = peer_ids(2, "store")
    # what the coordinator reads from the drivers' records at a checkpoint
    raw = [(a, DriverRecord(a, DataPosition(6, 0, frozenset({1})), Lease(a, 2, 1.0, 9.0, 7)).to_value()),
           (b, DriverRecord(b, DataPosition(6, 0, frozenset({4}), {0: 3}), None).to_value())]
    position = swarm_position(raw, 6)
    assert position == DataPosition(6, 0, frozenset({1, 4}), {0: 3, 2: 7})
    store = StateDir(tmp_path, "run")
    info = {"round": 3, "applied_rounds": 3, "trained_samples": 9, "digest": "d"}
    assert store.data_position() is None
    store.write_checkpoint(3, {0: (b"s0", info)}, "run_id = 'run'", 1, data_position=position.to_json())
    store.write_checkpoint(5, {0: (b"s0", info)}, "run_id = 'run'", 1)
    round_no, saved = StateDir(tmp_path, "run").data_position()
    assert round_no == 3 and DataPosition.from_json(saved, 6) == position
