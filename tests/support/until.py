"""Waiting in a test for a state that something shows (an event, a counter, a record), with a
deadline, rather than sleeping and hoping it came: the wait ends as soon as the state is there,
and a state that never comes fails with what was awaited."""
from __future__ import annotations

import asyncio
import time
from typing import Callable


async def until(condition: Callable[[], bool], what: str, timeout: float = 5.0, poll: float = 0.005) -> None:
    """Poll `condition` in this event loop until it holds; AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:g}s: {what}"
        await asyncio.sleep(poll)
