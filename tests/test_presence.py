"""Presence: stores of a replica's own record never overlap, so a DHT node cannot receive them out
of order (it keeps the later-expiring one and refuses the other, and the refused store reports
failure: a LEAVING announced on shutdown said it failed although a newer record was stored)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from swarmgrad.peer.state.presence import Presence
from swarmgrad.peer.records import LEAVING, ONLINE


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


def presence(swarm: SlowSwarm) -> Presence:
    worker = SimpleNamespace(rate=SimpleNamespace(rate=1.0))
    state = SimpleNamespace(applied_rounds=0, digest="d")
    clock = SimpleNamespace(current=3)
    return Presence(swarm, peer_id="peer", stage=0, manifest_hash="h", maddrs=(), worker=worker,  # type: ignore[arg-type]
                    state=state, clock=clock, heartbeat=1.0)  # type: ignore[arg-type]


def test_a_leaving_announce_waits_for_the_store_in_flight_and_goes_last() -> None:
    async def main() -> None:
        swarm = SlowSwarm()
        p = presence(swarm)
        p.status = ONLINE
        heartbeat = asyncio.ensure_future(p.announce())
        await asyncio.sleep(0.01)  # the heartbeat's store is on its way
        leaving = asyncio.ensure_future(p.announce(LEAVING))
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
        p = presence(Failing())
        assert await p.announce() is False
        assert await p.announce(LEAVING) is False  # not stuck behind the failed one
    asyncio.run(main())
