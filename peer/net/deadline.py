"""`within`: a deadline on an await that never swallows the caller's cancellation.

CPython 3.11's ``asyncio.wait_for`` returns the inner result when the awaited thing completes in
the same loop iteration as a cancel of the caller (gh-86296; 3.12 rebuilt ``wait_for`` on
``asyncio.timeout``): the cancel is lost. A task that polls in a loop (a vote watcher,
``outcome.first_failure``) then runs on after its owner cancelled it, and the owner, awaiting
it, hangs: the replica trains no more rounds while still answering RPCs.

``asyncio.timeout`` (3.11+) awaits inline, so a cancel that arrives with the result is delivered
as CancelledError; on 3.10 this falls back to ``wait_for``.
"""
from __future__ import annotations

import asyncio
import sys
from typing import Awaitable, TypeVar

T = TypeVar("T")


async def within(aw: Awaitable[T], seconds: float | None) -> T:
    """``await aw``, raising TimeoutError after `seconds` (None: no deadline)."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            return await aw
    return await asyncio.wait_for(aw, seconds)  # pragma: no cover - Python 3.10


def cancel_requested() -> bool:
    """Whether the current task has a cancel pending that something below swallowed (3.11+);
    a polling loop checks it so that it ends even then."""
    task = asyncio.current_task()
    return bool(task is not None and hasattr(task, "cancelling") and task.cancelling())
