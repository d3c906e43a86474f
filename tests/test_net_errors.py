"""peer/net/errors.py: the network's failures arrive as SwarmUnavailable (or RPCFailed), a
best-effort read logs them once loudly and then quietly, and a bug of ours is never taken for one.
Pure: a fake DHT and a captured log, no network."""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from swarmgrad.peer.net.dht_view import SwarmView
from swarmgrad.peer.net.errors import BestEffort, LoopSteps, RPCFailed, SwarmUnavailable, dht_call

LOG = logging.getLogger("test_net_errors")
PEER = "12D3KooWGy1KgUuMX23UPCJDvF3HqUy7t3Sq8ueaRgEXZva3yCqx"


def levels(caplog: pytest.LogCaptureFixture) -> list[int]:
    return [r.levelno for r in caplog.records if r.name == LOG.name]


def test_first_failure_warns_then_debug_then_recovery_is_info(caplog: pytest.LogCaptureFixture) -> None:
    reading = BestEffort("reading the drivers' records", LOG, clock=iter([10.0, 12.5]).__next__)
    with caplog.at_level(logging.DEBUG, logger=LOG.name):
        for error in (SwarmUnavailable("reading x: no answer within 5s"), asyncio.TimeoutError(), RPCFailed("gone")):
            with reading:
                raise error
            assert not reading.ok
        assert reading.failures == 3
        with reading:
            pass
    assert reading.ok and reading.failures == 0
    assert levels(caplog) == [logging.WARNING, logging.DEBUG, logging.DEBUG, logging.INFO]
    warning, recovery = caplog.records[0].getMessage(), caplog.records[-1].getMessage()
    assert "reading the drivers' records failed" in warning and "SwarmUnavailable" in warning
    assert "works again after 3 failure(s) over 2.5s" in recovery


def test_a_success_without_failures_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    reading = BestEffort("reading x", LOG)
    with caplog.at_level(logging.DEBUG, logger=LOG.name):
        for _ in range(3):
            with reading:
                pass
    assert reading.ok and levels(caplog) == []


@pytest.mark.parametrize("bug", [TypeError("unsupported operand"), AttributeError("no attribute 'x'"),
                                 KeyError("stage"), RuntimeError("a bug")])
def test_a_bug_propagates_and_is_not_counted(bug: Exception, caplog: pytest.LogCaptureFixture) -> None:
    reading = BestEffort("reading x", LOG)
    with caplog.at_level(logging.DEBUG, logger=LOG.name):
        with pytest.raises(type(bug)):
            with reading:
                raise bug
    assert reading.failures == 0 and levels(caplog) == []


def test_the_errors_it_survives_are_the_callers_choice() -> None:
    reading = BestEffort("listing connections", LOG, errors=(OSError,))
    with reading:
        raise ConnectionResetError()
    assert not reading.ok
    with pytest.raises(SwarmUnavailable):
        with reading:
            raise SwarmUnavailable("not in this one's list")


def test_cancellation_is_never_a_failure() -> None:
    reading = BestEffort("reading x", LOG)
    with pytest.raises(asyncio.CancelledError):
        with reading:
            raise asyncio.CancelledError()
    assert reading.failures == 0


# ---- dht_call and SwarmView: what the network did becomes SwarmUnavailable, nothing else does ----

class FakeDHT:
    """hivemind's DHT as SwarmView calls it; `fail` decides what a call does."""

    def __init__(self, fail: str = "") -> None:
        self.fail = fail
        self.peer_id = PEER

    def _call(self, value: Any) -> Any:
        if self.fail == "pipe":  # the DHT process died: writing the request to it fails at once
            raise BrokenPipeError(32, "Broken pipe")

        async def answer() -> Any:
            if self.fail == "hang":  # a dead DHT process's futures never resolve
                await asyncio.sleep(3600)
            if self.fail == "bug":
                raise TypeError("'NoneType' object is not subscriptable")
            return value
        return answer()

    def get(self, key: str, latest: bool = False, return_future: bool = False) -> Any:
        return self._call(None)

    def store(self, key: str, value: Any, expiration_time: float, subkey: Any = None,
              return_future: bool = False) -> Any:
        return self._call(True)


def view(fail: str) -> SwarmView:
    return SwarmView(FakeDHT(fail), "run", "hash", n_stages=2, timeout=0.05, ttl=30.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("fail", ["pipe", "hang"])
def test_the_view_raises_swarm_unavailable_for_the_network(fail: str) -> None:
    async def main() -> None:
        with pytest.raises(SwarmUnavailable, match="run/stage/1"):
            await view(fail).stage_records(1)
        with pytest.raises(SwarmUnavailable, match="run/round/1/3/check"):
            await view(fail).post_check(1, 3, PEER, "digest")
    asyncio.run(main())


def test_the_view_lets_a_bug_through() -> None:
    async def main() -> None:
        with pytest.raises(TypeError):
            await view("bug").stage_records(1)
        assert await view("").stage_records(1) == [] and await view("").post_check(1, 3, PEER, "d")
    asyncio.run(main())


def test_dht_call_says_what_and_why() -> None:
    async def never() -> None:
        await asyncio.sleep(3600)

    async def main() -> None:
        with pytest.raises(SwarmUnavailable) as timed_out:
            await dht_call("reading run/epoch", never, 0.01)
        assert str(timed_out.value) == "reading run/epoch: no answer within 0.01s"
        assert isinstance(timed_out.value.__cause__, asyncio.TimeoutError)
    asyncio.run(main())


def test_loop_steps_outlive_failures_and_say_which_kind(caplog: pytest.LogCaptureFixture) -> None:
    """A loop's step: the network's failure is logged once per outage (its own BestEffort), a bug
    with its traceback, and neither stops the next step; cancellation still goes through."""
    steps = LoopSteps("heartbeat", LOG)
    ran: list[str] = []

    async def offline() -> None:
        raise SwarmUnavailable("no DHT")

    async def buggy() -> None:
        raise TypeError("a bug of ours")

    async def fine() -> None:
        ran.append("fine")

    async def cancelled() -> None:
        raise asyncio.CancelledError

    async def main() -> None:
        for step in (offline, offline, buggy, fine):
            await steps.run(step.__name__, step)
        with pytest.raises(asyncio.CancelledError):
            await steps.run("cancelled", cancelled)

    with caplog.at_level(logging.DEBUG, logger=LOG.name):
        asyncio.run(main())
    assert ran == ["fine"]
    assert levels(caplog) == [logging.WARNING, logging.DEBUG, logging.ERROR]
    assert caplog.records[0].getMessage().startswith("heartbeat: offline failed: SwarmUnavailable")
    bug = caplog.records[2]
    assert bug.getMessage() == "heartbeat: buggy failed" and bug.exc_info and bug.exc_info[0] is TypeError
    assert steps.attempt("offline").failures == 2 and steps.attempt("buggy").failures == 0
