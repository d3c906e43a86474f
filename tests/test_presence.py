"""Presence: stores of a replica's own record never overlap, so a DHT node cannot receive them out
of order (it keeps the later-expiring one and refuses the other, and the refused store reports
failure: a LEAVING announced on shutdown said it failed although a newer record was stored).
The record is its owner's: its status follows the replica's phase, other figures are handed to it."""
from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from swarmgrad.peer.net.errors import SwarmUnavailable
from swarmgrad.peer.state.phase import Phase, ReplicaPhase
from swarmgrad.peer.state.presence import Presence
from swarmgrad.peer.records import JOINING, LEAVING, ONLINE

from support.until import until


class SlowSwarm:
    """Stores that take a while; records when each begins and ends."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []
        self.release = asyncio.Event()

    async def announce(self, record) -> bool:
        self.log.append(("begin", record.state))
        await self.release.wait()
        self.log.append(("end", record.state))
        return True


def presence(swarm: SlowSwarm, phase: ReplicaPhase | None = None) -> Presence:
    worker = SimpleNamespace(rate=SimpleNamespace(rate=1.0))
    state = SimpleNamespace(applied_rounds=0, digest="d")
    clock = SimpleNamespace(current=3)
    return Presence(swarm, peer_id="peer", stage=0, manifest_hash="h", maddrs=(),  # type: ignore[arg-type]
                    phase=phase or ReplicaPhase(), worker=worker, state=state, clock=clock,  # type: ignore[arg-type]
                    heartbeat=1.0)


LOG = "swarmgrad.peer.state.presence"


def levels(caplog: pytest.LogCaptureFixture) -> list[int]:
    return [r.levelno for r in caplog.records if r.name == LOG]


class Down(SlowSwarm):
    """A swarm view whose stores and epoch refreshes raise `error`."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error
        self.refreshes = 0

    async def announce(self, record) -> bool:
        raise self.error

    async def refresh_epoch(self, epoch: float) -> bool:
        self.refreshes += 1
        raise self.error


def test_a_leaving_announce_waits_for_the_store_in_flight_and_goes_last() -> None:
    async def main() -> None:
        swarm = SlowSwarm()
        phase = ReplicaPhase()
        p = presence(swarm, phase)
        phase.enter(Phase.SERVING)
        heartbeat = asyncio.ensure_future(p.announce())
        await until(lambda: swarm.log == [("begin", ONLINE)], "the heartbeat's store is on its way")
        phase.enter(Phase.LEAVING)
        leaving = asyncio.ensure_future(p.announce())
        await asyncio.sleep(0.01)
        assert p.status == LEAVING, "the status changes at once, not once the store may begin"
        assert swarm.log == [("begin", ONLINE)], "a second store began while the first was in flight"
        swarm.release.set()
        assert await heartbeat and await leaving
        assert swarm.log == [("begin", ONLINE), ("end", ONLINE), ("begin", LEAVING), ("end", LEAVING)]
    asyncio.run(main())


def test_a_failed_store_is_reported_not_raised_and_frees_the_next() -> None:
    async def main() -> None:
        class Failing(SlowSwarm):
            async def announce(self, record) -> bool:
                raise TimeoutError("the DHT did not answer")
        phase = ReplicaPhase()
        p = presence(Failing(), phase)
        assert await p.announce() is False
        phase.enter(Phase.LEAVING)
        assert await p.announce() is False  # not stuck behind the failed one
    asyncio.run(main())


def test_the_record_says_what_its_phase_and_the_values_handed_to_it_say() -> None:
    phase = ReplicaPhase()
    p = presence(SlowSwarm(), phase)
    assert p.record().state == JOINING and not p.record().moving
    for ph in (Phase.SERVING, Phase.AVERAGING, Phase.HOLDING, Phase.AVERAGING, Phase.OVERLAPPED):
        phase.enter(ph)
        assert p.record().state == ONLINE
    phase.enter(Phase.JOINING)  # a stale replica re-syncs
    assert p.record().state == JOINING
    p.set(moving=True)
    p.set_stats(val_loss=2.5, samples=12)
    p.set_stats(train_loss=3.0)
    record = p.record()
    assert record.moving and record.stats is not None
    assert record.stats["val_loss"] == 2.5 and record.stats["samples"] == 12 and record.stats["train_loss"] == 3.0
    p.stats.samples = 99  # a copy: nobody writes the record but its owner
    assert p.record().stats["samples"] == 12
    with pytest.raises(TypeError):
        p.set_stats(no_such_figure=1)
    phase.enter(Phase.LEAVING)
    assert p.record().state == LEAVING


def test_a_network_failure_is_a_false_announce_warned_once_and_a_bug_propagates(
        caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        p = presence(Down(SwarmUnavailable("storing run/stage/0: no answer within 10s")))
        with caplog.at_level(logging.DEBUG, logger=LOG):
            assert await p.announce() is False
            assert await p.announce() is False
        assert levels(caplog) == [logging.WARNING, logging.DEBUG], "an outage is warned about once"
        assert "announcing this replica's record" in caplog.records[0].getMessage()
        assert "no answer within 10s" in caplog.records[0].getMessage()
        bug = presence(Down(TypeError("a refactoring's bug")))
        with pytest.raises(TypeError):
            await bug.announce()
        assert not bug._storing.locked(), "a bug frees the next store too"
    asyncio.run(main())


def test_the_heartbeat_survives_an_epoch_refresh_the_network_failed_but_not_a_bug(
        caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        swarm = Down(SwarmUnavailable("storing run/epoch: no answer within 10s"))
        p = presence(swarm)
        p.heartbeat = 0.01
        p.clock.epoch = 100.0  # type: ignore[misc]  # wall-clock rounds: the heartbeat refreshes the epoch
        with caplog.at_level(logging.DEBUG, logger=LOG):
            beating = asyncio.create_task(p.run())
            while swarm.refreshes < 3:
                await asyncio.sleep(0.01)
            assert not beating.done()
            beating.cancel()
            await asyncio.gather(beating, return_exceptions=True)
        warned = [r.getMessage() for r in caplog.records if r.name == LOG and r.levelno == logging.WARNING]
        assert len([m for m in warned if "refreshing the run's epoch" in m]) == 1
        class Refreshing(Down):
            async def announce(self, record) -> bool:
                return True  # the store works: the bug is the refresh's
        buggy = presence(Refreshing(TypeError("a refactoring's bug")))
        buggy.heartbeat = 0.01
        buggy.clock.epoch = 100.0  # type: ignore[misc]
        with pytest.raises(TypeError):
            await asyncio.wait_for(buggy.run(), 5.0)
    asyncio.run(main())
