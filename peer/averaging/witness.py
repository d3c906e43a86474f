"""When another member ended our round early, see for ourselves who withheld before blaming anyone
(peer/averaging/exclusion.py, `blame`).

A member whose part fails (a reducer gave up waiting for a withheld contribution) votes failed and
gives up its own round; its reducer then answers the requests still waiting on it WRONG_ROUND
("abandoned here"). Every other member reads that vote, or gets that refusal, while its own part
is still waiting for the withheld contribution: it cannot tell a withholder from an honest member
that was merely slower. It used to judge at once: it blamed the member whose failed vote it read
first, or, after the refusal, nobody, while the member that failed first blamed the withholder.
Two honest members then excluded different members, so their next groups differed and failed.

So a member whose exchange another member ended (`ended_by`) votes failed as before, at once, but
judges only after it has *witnessed* its own part: once every member's contribution reached it, or
every member whose contribution did not is gone (no connection: it will never send), or at
`deadline` (timeouts.allreduce after our part was ready: as long as our reducer holds the members
waiting for its mean). Meanwhile its own parts still on the way keep going, and the wait ends
early only once they have been answered too: a failed vote cast while honest members were still
uploading must not cost them their parts at each other's reducers (a reducer whose member gave
the round up answers WRONG_ROUND as soon as a part is in, so there "answered" is "delivered"). By
then a member that sends its parts as its exchange starts has long delivered them, so every
honest member that waits sees the same withholder missing from its own part and blames it, as the
member that failed first did. The wait changes neither the vote nor what is applied.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Collection, Mapping, Sequence

from swarmgrad.peer.net.deadline import within
from swarmgrad.peer.net.errors import BestEffort
from swarmgrad.peer.net.polling import poll_intervals
from swarmgrad.peer.records import FAILED
from swarmgrad.protocol import wire_pb2 as pb

logger = logging.getLogger(__name__)

WITNESS_POLL_SECONDS = 0.25
"""The longest interval at which a member that waits to witness its own part re-checks it and its
connections (a poll interval, not a deadline: `deadline` ends the wait)."""


@dataclass(frozen=True)
class Abandoned:
    """A part this member stopped waiting for: the round had already failed (`why`)."""
    why: str
    by: tuple[str, ...] = ()
    """The members whose failed vote under our group's hash made us stop (none: a part failed)."""
    on_vote: bool = False
    """Another member's vote made us stop (not one of our own parts failing)."""


def ended_by(members: Sequence[str], me: str, group_hash: str, results: Sequence[Any],
             votes: Mapping[str, str]) -> frozenset[str] | None:
    """The members whose failure ended our exchange, when that is what ended it; None when our
    exchange completed or one of our parts failed of itself (then we judge what we saw at once).
    `results`: each part's outcome in part order (an answer, an exception, or Abandoned); `votes`:
    the round's outcome votes (read only where a part was refused WRONG_ROUND). Another member
    ended it when we abandoned our parts on its vote, or when every part that failed was refused
    WRONG_ROUND by a reducer that had voted failed under our group's hash: a member of our own
    round that gave it up, not one in another round (that refusal still blames nobody). Pure."""
    failed_here = f"{group_hash}:{FAILED}"
    by: set[str] = set()
    ended = False
    for part, res in enumerate(results):
        if isinstance(res, Abandoned):
            ended = ended or res.on_vote
            by.update(res.by)
        elif isinstance(res, pb.AverageResponse) and res.status == pb.OK:
            continue
        elif (isinstance(res, pb.AverageResponse) and res.status == pb.WRONG_ROUND and members[part] != me
              and votes.get(members[part]) == failed_here):
            ended = True
            by.add(members[part])
        else:
            return None  # a part failed of itself
    return frozenset(by) if ended else None


async def witness(members: Sequence[str], contributed: Callable[[], Collection[str]],
                  calls: Collection[asyncio.Future], deadline: float,
                  gone: Callable[[Sequence[str]], Awaitable[Collection[str]]], dht_timeout: float) -> None:
    """Return once every member's contribution reached our part (`contributed()`, re-read at each
    check) or every member whose contribution did not is `gone`, and every one of `calls` (our
    parts still on the way) is done; or at `deadline` (time.monotonic()). Never raises for the
    network: a connection list that cannot be read counts nobody as gone. `calls` are not
    cancelled here (their owner does that)."""
    listing = BestEffort("listing connections while witnessing our own part", logger)
    for delay in poll_intervals(WITNESS_POLL_SECONDS):
        have = set(contributed())
        missing = [p for p in members if p not in have]
        left: Collection[str] = ()
        if missing:
            with listing:  # the daemon did not answer: the deadline still ends the wait
                left = await within(gone(missing), dht_timeout)
        running = [c for c in calls if not c.done()]
        now = time.monotonic()
        if (set(missing) <= set(left) and not running) or now >= deadline:
            return
        wait = min(delay, deadline - now)
        if running:
            await asyncio.wait(running, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
        else:
            await asyncio.sleep(wait)
    raise AssertionError("poll_intervals never ends")
