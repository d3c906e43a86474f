"""A warm standby's join (StateSync.join_local): a peer that holds a backup of a stage whose digest
is the one the stage's majority announces joins from it and downloads nothing; a stale copy is
not used and the state is downloaded as usual. One process: the donors answer like StateSync.handle."""
from __future__ import annotations

import asyncio
from typing import Any

import torch

from swarmgrad.peer.state.backup import BackupStore
from swarmgrad.peer.clock import RoundClock
from swarmgrad.peer.events import EventLog
from swarmgrad.peer.manifest import RoundsConfig, ScheduleConfig, TimeoutsConfig
from swarmgrad.peer.compute.schedule import TrainingProgress
from swarmgrad.peer.state.phase import ReplicaPhase
from swarmgrad.peer.state.sync import StateSync
from swarmgrad.peer.records import ONLINE, PeerRecord
from swarmgrad.protocol.validation import RunIdentity

from support.state import Donors, trained

ID = RunIdentity("run", "h" * 32)


class Records:
    """The stage's records as SwarmView.stage_records returns them."""

    def __init__(self, records: list[PeerRecord]):
        self.records = records

    async def stage_records(self, stage: int) -> list[PeerRecord]:
        return list(self.records)

    async def round_checks(self, stage: int, round_no: int) -> dict[str, str]:
        """No outcome votes (the donors' rounds are not in this view): a joiner credits every
        backer of the quorum, as StateSync._worked does where the votes show none."""
        return {}


class Worker:
    def __init__(self, module: torch.nn.Module):
        self.module = module

    async def run(self, fn, *args: Any) -> Any:
        return fn(*args)


def record(peer: str, state) -> PeerRecord:
    return PeerRecord(peer_id=peer, stage=1, state=ONLINE, throughput=1.0, round=state.snapshot.round,
                      applied_rounds=state.applied_rounds, digest=state.digest, manifest_hash="h", driver=False)


async def join(held, donors_state) -> tuple[StateSync, Donors, list[dict]]:
    """A joiner of stage 1 holding `held` (a state whose committed snapshot it backed up, or None)
    while two replicas serve `donors_state`; returns the sync, the donors and the events."""
    async def no_swarm() -> dict:
        return {}

    store = BackupStore(ID, 2, lambda s: dict(donors_state.shapes), max_numel=1 << 22, peer_id="me",
                        swarm=no_swarm, timeout=1.0)
    if held is not None:  # as a push from a replica of stage 1 left it (whose checks test_backup covers)
        store.copies[1] = held.snapshot
    mine = trained(seed=7)  # what the joiner starts from: neither copy
    events: list[dict] = []
    log = EventLog(None, sink=events.append)
    donors = Donors({"a": donors_state.snapshot, "b": donors_state.snapshot})
    sync = StateSync(rpc=donors, swarm=Records([record("a", donors_state), record("b", donors_state)]),
                     identity=ID, peer_id="me", stage=1, state=mine, worker=Worker(torch.nn.Sequential(
                         torch.nn.Linear(32, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 8))),
                     clock=RoundClock(RoundsConfig(round_seconds=0, inner_steps=10), counts_steps=False,
                                      max_rounds=0, epoch=None),
                     progress=TrainingProgress(ScheduleConfig()), events=log, phase=ReplicaPhase(),
                     timeouts=TimeoutsConfig(),
                     max_numel=1 << 22, local_copy=store.local_copy)
    await sync.join()
    return sync, donors, events


def test_a_fresh_local_copy_joins_without_a_download() -> None:
    current = trained(seed=0)
    sync, donors, events = asyncio.run(join(current, current))
    assert donors.asked == []  # nothing downloaded
    assert sync.state.digest == current.digest and sync.state.applied_rounds == current.applied_rounds
    assert torch.equal(sync.state.snapshot.params["0.weight"], current.snapshot.params["0.weight"])
    assert [e.get("source") for e in events if e["event"] == "state_loaded"] == ["local-backup"]


def test_a_stale_local_copy_is_not_used() -> None:
    stale = trained(seed=0)
    current = trained(seed=0)
    current.apply_outer({n: torch.ones(s) for n, s in current.shapes.items()}, total_weight=8)
    current.commit(3)  # the stage went on one round after the copy was taken
    sync, donors, events = asyncio.run(join(stale, current))
    assert donors.asked  # downloaded
    assert sync.state.digest == current.digest and sync.state.digest != stale.digest
    assert [e.get("source") for e in events if e["event"] == "state_loaded"] == ["a,b"]


def test_no_copy_downloads_as_before() -> None:
    current = trained(seed=0)
    sync, donors, _ = asyncio.run(join(None, current))
    assert donors.asked and sync.state.digest == current.digest
