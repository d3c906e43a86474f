"""peer/net/deadline.py: a deadline that keeps the caller's cancel, where 3.11's wait_for loses it."""
from __future__ import annotations

import asyncio
import sys

import pytest

from swarmgrad.peer.net.deadline import cancel_requested, within


async def _cancel_as_result_lands(waiter) -> tuple[str, object]:
    """Start `waiter(fut)`, then in one step give fut its result and cancel the waiter: the race
    that a DHT read finishing as its poller is cancelled hits."""
    fut = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(waiter(fut))
    await asyncio.sleep(0)  # the waiter is now parked on fut
    fut.set_result("value")
    task.cancel()
    try:
        return "returned", await task
    except asyncio.CancelledError:
        return "cancelled", None


def test_within_delivers_a_cancel_that_arrives_with_the_result() -> None:
    assert asyncio.run(_cancel_as_result_lands(lambda f: within(f, 5.0)))[0] == "cancelled"


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the wait_for bug is CPython 3.11's (gh-86296)")
def test_wait_for_on_this_python_loses_that_cancel() -> None:
    # why peer/ uses `within`: this is the behaviour that hung a replica's round runner
    assert asyncio.run(_cancel_as_result_lands(lambda f: asyncio.wait_for(f, 5.0))) == ("returned", "value")


def test_within_times_out_and_returns_in_time() -> None:
    async def main() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await within(asyncio.sleep(10), 0.05)
        assert await within(asyncio.sleep(0, result=7), 5.0) == 7
        assert await within(asyncio.sleep(0, result=8), None) == 8
    asyncio.run(main())


def test_a_poller_that_checks_cancel_requested_stops_even_when_a_read_swallowed_the_cancel() -> None:
    async def poller(reads: list[int]) -> None:
        while True:
            fut = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_soon(fut.set_result, 1)
            reads.append(await asyncio.wait_for(fut, 5.0))  # may swallow a cancel (3.11)
            await asyncio.sleep(0.01)
            if cancel_requested():
                raise asyncio.CancelledError()

    async def main() -> int:
        reads: list[int] = []
        task = asyncio.ensure_future(poller(reads))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 2.0)
        return len(reads)
    assert asyncio.run(main()) > 0
