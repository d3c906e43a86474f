"""A replica's tasks start once, however often it is launched (a moved-to replica is launched by
the move and again by the peer's serve loop: twice would run two round runners on one stage)."""
from __future__ import annotations

import asyncio

from swarmgrad.peer.node.replica import Replica


class _Loop:
    def __init__(self) -> None:
        self.started = 0

    async def run(self, *args) -> None:
        self.started += 1
        await asyncio.Event().wait()


def test_launch_is_idempotent() -> None:
    async def main() -> None:
        replica = Replica.__new__(Replica)  # only what launch touches
        replica.tasks, replica.main, replica.driving, replica.stage = [], None, None, 1
        replica.presence, replica.rounds = _Loop(), _Loop()
        replica.ctx = type("Ctx", (), {"max_rounds": 0})()
        stop = asyncio.Event()
        first = replica.launch(stop)
        second = replica.launch(stop)
        await asyncio.sleep(0.05)
        assert first is second
        assert replica.rounds.started == 1 and replica.presence.started == 1
        assert len(replica.tasks) == 2
        for task in [*replica.tasks, first]:
            task.cancel()
        await asyncio.gather(*replica.tasks, first, return_exceptions=True)
    asyncio.run(main())
