"""The outcome vote that ends every outer round of two or more members (peer/averaging/averager.py, step 4).

Reducers answer every member with the same bytes, but an answer can be lost (a reset stream), a
part can be refused or time out, and a reducer could send different bytes to different members.
Each member then knows only its own result: without a vote, a member that failed while the others
completed left θ_global split until a later re-sync. So every member posts one vote under
{run}/round/{stage}/{round}/check, "<group hash>:<digest of the mean it decoded>" or
"<group hash>:failed", and applies the round only once every member of its group voted exactly its
own vote. One failed vote, a different digest or another group's hash fails it for all.

A member never votes twice, so a failed vote (or no digest vote at all) from a member of a group
proves that nobody in that group applied the round (`decisions.nobody_applied`). What is left is the
two-generals case: a member that voted its digest but could not read every vote in time fails while
the others may have applied; it says so (`Outcome.voted_digest`) and re-syncs from them at once.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Collection, Protocol, Sequence

from swarmgrad.peer.net.deadline import cancel_requested, within
from swarmgrad.peer.net.errors import NETWORK_FAILURES, BestEffort
from swarmgrad.peer.net.polling import poll_intervals
from swarmgrad.peer.records import FAILED

logger = logging.getLogger(__name__)

VOTE_POLL_SECONDS = 0.25
"""How often a member re-reads the votes while its parts are on the way, and the longest interval
at which it re-reads them while it waits for every vote (that wait starts shorter:
peer/net/polling.py; a poll interval, not a deadline)."""


class VoteBoard(Protocol):
    """Where votes live (peer/net/dht_view.py: SwarmView; an in-memory dict in tests)."""

    async def post_check(self, stage: int, round_no: int, peer_id: str, digest: str) -> bool: ...

    async def round_checks(self, stage: int, round_no: int) -> dict[str, str]: ...


def vote(group_hash: str, digest: str | None) -> str:
    """A member's vote: its group's hash (members whose matchmaking read other registrations formed
    another group, and may apply without us) and its mean's digest, or FAILED."""
    return f"{group_hash}:{digest or FAILED}"


@dataclass(frozen=True)
class Outcome:
    applied: bool
    """Every member voted our digest: apply the round."""
    reason: str = ""
    voted_digest: bool = False
    """We voted a digest (or may have: the write failed), so others may have applied it."""
    missing: tuple[str, ...] = ()
    """Members that posted no vote before the deadline."""
    failed: tuple[str, ...] = ()
    """Members that voted failed under our group's hash (peer/averaging/exclusion.py counts them)."""


async def agree(board: VoteBoard, stage: int, round_no: int, members: Sequence[str], group_hash: str, me: str,
                digest: str | None, timeout: float, dht_timeout: float,
                gone: Callable[[Sequence[str]], Awaitable[Collection[str]]] | None = None) -> Outcome:
    """Post our vote (`digest` None: our round failed), then, if it is a digest, wait at most
    `timeout` until every member voted. Each DHT call has `dht_timeout`.

    `gone(members)`: those of them we hold no connection to any more. A member that has not voted
    and is gone (killed after the exchange, in which every member spoke to every other) will never
    vote: the round fails then instead of at `timeout`. That is as safe as the timeout itself (a
    missing vote means nobody can apply; a member whose vote lands later and who applies with the
    others is the two-generals case that `voted_digest` already covers). The network's failures
    (NETWORK_FAILURES) fail the vote or are read past; anything else propagates."""
    mine = vote(group_hash, digest)
    try:
        await within(board.post_check(stage, round_no, me, mine), dht_timeout)
    except NETWORK_FAILURES as e:
        # a failed vote that did not land still leaves no digest of ours anywhere; a digest may have
        return Outcome(False, f"outcome vote not posted: {type(e).__name__}: {e}", voted_digest=digest is not None)
    if digest is None:
        return Outcome(False)
    deadline = time.monotonic() + timeout
    posted: dict[str, str] = {}
    reading = BestEffort(f"stage {stage} round {round_no}: reading the outcome votes", logger)
    listing = BestEffort(f"stage {stage} round {round_no}: listing connections while waiting for votes", logger)
    for delay in poll_intervals(VOTE_POLL_SECONDS):
        with reading:  # a DHT hiccup: try again until the deadline
            posted = await within(board.round_checks(stage, round_no), dht_timeout)
        failed = sorted(p for p in members if posted.get(p, "").endswith(f":{FAILED}"))
        if failed:
            return Outcome(False, f"member(s) {[p[-8:] for p in failed]} voted the round failed", voted_digest=True,
                           failed=tuple(p for p in failed if posted[p] == vote(group_hash, None)))
        differing = sorted(p[-8:] for p in members if p in posted and posted[p] != mine)
        if differing:
            return Outcome(False, f"cross-check: members {differing} voted another outcome (a reducer sent "
                                  f"different bytes, or their group differs)", voted_digest=True)
        if set(members) <= set(posted):
            return Outcome(True)
        left = await _gone([p for p in members if p not in posted], gone, dht_timeout, listing)
        if left:
            return Outcome(False, f"outcome vote: member(s) {sorted(p[-8:] for p in left)} left before voting (no "
                                  f"connection to them)", voted_digest=True, missing=tuple(left))
        if time.monotonic() > deadline:
            missing = tuple(p for p in members if p not in posted)
            return Outcome(False, f"outcome vote: {len(missing)} member(s) posted no vote", voted_digest=True,
                           missing=missing)
        await asyncio.sleep(delay)
    raise AssertionError("poll_intervals never ends")


async def _gone(missing: Sequence[str], gone: Callable[[Sequence[str]], Awaitable[Collection[str]]] | None,
                timeout: float, listing: BestEffort) -> list[str]:
    if not missing or gone is None:
        return []
    left: Collection[str] = ()
    with listing:  # the daemon did not answer: the vote's own deadline still ends the wait
        left = await within(gone(missing), timeout)
    return [p for p in missing if p in left]


async def first_failure(board: VoteBoard, stage: int, round_no: int, members: Sequence[str], group_hash: str,
                        me: str) -> tuple[str, tuple[str, ...]]:
    """Returns (why, the members that voted failed under our group's hash) once another member
    voted anything but a digest under our group's hash (failed, or in another group: either way
    our round cannot complete); never otherwise."""
    ours = f"{group_hash}:"
    reading = BestEffort(f"stage {stage} round {round_no}: watching the outcome votes", logger)
    while True:
        await asyncio.sleep(VOTE_POLL_SECONDS)
        if cancel_requested():  # our owner cancelled us and something below lost it: stop anyway
            raise asyncio.CancelledError()
        votes: dict[str, str] = {}
        with reading:  # a DHT hiccup: the parts' own deadlines still bound the round
            votes = await board.round_checks(stage, round_no)
        failed = [p for p in members if p != me and p in votes
                  and (not votes[p].startswith(ours) or votes[p] == vote(group_hash, None))]
        if failed:
            return (f"member {failed[0][-8:]} voted the round failed ({votes[failed[0]][:40]})",
                    tuple(p for p in failed if votes[p] == vote(group_hash, None)))
