"""When a later stage's round ends (RoundRunner.wait_boundary), with the DHT read that lets the
drivers' records end it running slowly: a microbatch of the next round must end the round at once,
not after the read, and the read must not outlive the wait."""
from __future__ import annotations

import asyncio
import logging
import time

import pytest
import torch
from torch import nn

from swarmgrad.peer.clock import RoundClock
from swarmgrad.peer.events import EventLog
from swarmgrad.peer.net.errors import RPCFailed, SwarmUnavailable
from swarmgrad.peer.manifest import InnerOptConfig, RoundsConfig, ScheduleConfig
from swarmgrad.peer.pipeline.stage_server import DriverList
from swarmgrad.peer.rounds.runner import RoundRunner
from swarmgrad.peer.state.phase import ReplicaPhase
from swarmgrad.peer.net.rpc import Traffic
from swarmgrad.peer.compute.schedule import TrainingProgress
from swarmgrad.peer.records import ONLINE, PeerRecord
from swarmgrad.peer.compute.worker import StageWorker
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.framing import ProtocolError

from support.until import until

pytestmark = pytest.mark.timeout(30)


class SlowSwarm:
    """stage_records(0) answers after `delay` seconds with drivers at `driver_round`."""

    def __init__(self, delay: float, driver_round: int) -> None:
        self.delay = delay
        self.driver_round = driver_round
        self.reads = 0
        self.cancelled = 0

    async def stage_records(self, stage: int) -> list[PeerRecord]:
        self.reads += 1
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return [PeerRecord(peer_id="driver", stage=0, state=ONLINE, throughput=1.0, round=self.driver_round,
                           applied_rounds=0, digest="d", manifest_hash="h", driver=True)]


def _runner(swarm: SlowSwarm) -> tuple[RoundRunner, RoundClock, StageWorker]:
    clock = RoundClock(RoundsConfig(inner_steps=10, round_seconds=0.0), counts_steps=False, max_rounds=0, epoch=None)
    progress = TrainingProgress(ScheduleConfig())
    worker = StageWorker(nn.Linear(2, 2), InnerOptConfig(), torch.device("cpu"), None, clock, progress)
    runner = RoundRunner(stage=1, clock=clock, worker=worker, state=None, averager=None, sync=None,  # type: ignore[arg-type]
                         presence=None, phase=ReplicaPhase(), swarm=swarm, progress=progress,  # type: ignore[arg-type]
                         traffic=Traffic(), events=EventLog(None, sink=lambda _: None), schedule_outer=False,
                         save_dir=None, peer_id="stage-1", join_hold=0.0, dht_timeout=10.0, matchmaking=5.0)
    return runner, clock, worker


def test_a_microbatch_of_the_next_round_ends_it_during_a_slow_read() -> None:
    async def main() -> None:
        swarm = SlowSwarm(delay=5.0, driver_round=0)  # the drivers' records say nothing yet, slowly
        runner, clock, worker = _runner(swarm)
        waiting = asyncio.create_task(runner.wait_boundary(0, asyncio.Event()))
        await until(lambda: swarm.reads == 1, "the drivers' records read")
        assert not waiting.done() and swarm.reads == 1  # the read is under way
        started = time.monotonic()
        assert clock.observe(1)  # what the stage server does with a request of round 1
        await asyncio.wait_for(waiting, 2.0)
        assert time.monotonic() - started < 1.0  # not after the 5 s read
        assert swarm.cancelled == 1  # and the read did not outlive the wait
        worker.close()
    asyncio.run(main())


def test_the_drivers_records_end_a_round_that_gets_no_more_work() -> None:
    async def main() -> None:
        swarm = SlowSwarm(delay=0.05, driver_round=1)  # every driver is past round 0
        runner, clock, worker = _runner(swarm)
        await asyncio.wait_for(runner.wait_boundary(0, asyncio.Event()), 2.0)
        assert swarm.reads == 1 and clock.seen == -1  # no microbatch said so: the records did
        worker.close()
    asyncio.run(main())


def test_a_round_goes_on_while_the_drivers_are_in_it() -> None:
    async def main() -> None:
        swarm = SlowSwarm(delay=0.01, driver_round=0)
        runner, clock, worker = _runner(swarm)
        stop = asyncio.Event()
        waiting = asyncio.create_task(runner.wait_boundary(0, stop))
        # one poll interval (BOUNDARY_POLL_SECONDS) later it reads again
        await until(lambda: swarm.reads >= 2, "a second read of the drivers' records")
        assert not waiting.done() and swarm.reads >= 2
        stop.set()
        clock.wake()
        await asyncio.wait_for(waiting, 2.0)
        worker.close()
    asyncio.run(main())


def test_requests_arriving_during_the_drivers_read_wait_for_it() -> None:
    """A driver's first requests of a round come back to back: all of them must see the read the
    first one started, not the empty list it replaces (they were refused WRONG_ROUND before)."""
    async def main() -> None:
        swarm = SlowSwarm(delay=0.3, driver_round=1)
        drivers = DriverList(swarm, refresh_s=2.0)  # type: ignore[arg-type]
        answers = await asyncio.wait_for(asyncio.gather(*(drivers.listed("driver") for _ in range(3))), 2.0)
        assert answers == [True, True, True] and swarm.reads == 1
        # someone the DHT does not list: one read per refresh_s, however many requests it sends
        assert not await drivers.listed("stranger") and swarm.reads == 1
    asyncio.run(main())


def test_an_unlisted_peer_triggers_at_most_one_read_per_refresh() -> None:
    async def main() -> None:
        swarm = SlowSwarm(delay=0.01, driver_round=1)
        drivers = DriverList(swarm, refresh_s=0.2)  # type: ignore[arg-type]
        assert not any(await asyncio.gather(*(drivers.listed("stranger") for _ in range(5))))
        assert swarm.reads == 1
        await asyncio.sleep(0.25)
        assert not await drivers.listed("stranger") and swarm.reads == 2
    asyncio.run(main())


class DownSwarm(SlowSwarm):
    """stage_records raises `error` (after a short wait, like a DHT read that times out)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(delay=0.01, driver_round=0)
        self.error = error

    async def stage_records(self, stage: int) -> list[PeerRecord]:
        await super().stage_records(stage)
        raise self.error


RUNNER_LOG = "swarmgrad.peer.rounds.runner"


def test_a_boundary_waits_on_through_unreadable_drivers_records(caplog: pytest.LogCaptureFixture) -> None:
    """The drivers' records cannot be read: the round goes on (warned once), and a microbatch of
    the next round still ends it."""
    async def main() -> None:
        swarm = DownSwarm(SwarmUnavailable("reading run/stage/0: no answer within 10s"))
        runner, clock, worker = _runner(swarm)
        waiting = asyncio.create_task(runner.wait_boundary(0, asyncio.Event()))
        await asyncio.sleep(1.5)  # past one poll interval: it read again
        assert not waiting.done() and swarm.reads >= 2
        assert clock.observe(1)
        await asyncio.wait_for(waiting, 2.0)
        worker.close()
    with caplog.at_level(logging.DEBUG, logger=RUNNER_LOG):
        asyncio.run(main())
    levels = [r.levelno for r in caplog.records if r.name == RUNNER_LOG and "drivers' records" in r.getMessage()]
    assert levels[0] == logging.WARNING and set(levels[1:]) == {logging.DEBUG}, levels


def test_a_bug_in_the_boundarys_read_propagates() -> None:
    async def main() -> None:
        runner, clock, worker = _runner(DownSwarm(TypeError("a refactoring's bug")))
        try:
            with pytest.raises(TypeError):
                await asyncio.wait_for(runner.wait_boundary(0, asyncio.Event()), 2.0)
        finally:
            worker.close()
    asyncio.run(main())


@pytest.mark.parametrize("error", [SwarmUnavailable("reading run/round/1/0: no answer within 10s"),
                                   RPCFailed("part 0: stream ended"), asyncio.TimeoutError(),
                                   ProtocolError(pb.GROUP_MISMATCH, "not our group"), TypeError("a bug")])
def test_a_round_that_raised_is_incomplete_and_only_a_bug_is_logged_with_its_traceback(
        error: Exception, caplog: pytest.LogCaptureFixture) -> None:
    runner = RoundRunner.__new__(RoundRunner)  # only what _failed touches
    runner.stage = 1
    with caplog.at_level(logging.DEBUG, logger=RUNNER_LOG):
        result = runner._failed(0, error)
    assert not result.complete and result.reason.startswith(type(error).__name__)
    traced = [r for r in caplog.records if r.name == RUNNER_LOG and r.exc_info]
    assert len(traced) == (1 if isinstance(error, TypeError) else 0)
    if traced:
        assert traced[0].levelno == logging.ERROR
