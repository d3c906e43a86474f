"""Who averages round r of a stage: every replica registers under {run}/round/{stage}/{r} and reads
the others' registrations until every replica the stage records call ONLINE has registered (or its
patience runs out); the group is then a pure function of what it read (group.choose_group),
so members that read the same set agree on it.

Every member sends its parts to last round's group as soon as they are encoded (peer/averaging/averager.py,
early parts), and its parts for any other group once its matchmaking ends: a request knocks on the
receiver's round (`knock`), whose poll then re-reads at once and from the shortest interval,
instead of waiting out an interval of up to MATCHMAKING_POLL_SECONDS on the round's critical path.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Collection, Protocol

from swarmgrad.peer import decisions
from swarmgrad.peer.averaging.group import Group, choose_group
from swarmgrad.peer.evidence import NO_EVIDENCE, Evidence
from swarmgrad.peer.net.deadline import within
from swarmgrad.peer.net.polling import poll_intervals
from swarmgrad.peer.records import ONLINE, PeerRecord

MATCHMAKING_POLL_SECONDS = 0.2
"""The longest interval at which matchmaking re-reads the registrations (it starts shorter:
peer/net/polling.py; a poll interval, not a deadline)."""


class RoundBoard(Protocol):
    """What matchmaking reads and writes in the DHT (swarm.SwarmView)."""

    async def register_round(self, stage: int, round_no: int, peer_id: str, value: dict[str, Any]) -> bool: ...

    async def round_registrations(self, stage: int, round_no: int) -> dict[str, dict[str, Any]]: ...

    async def stage_records(self, stage: int) -> list[PeerRecord]: ...


async def matchmake(board: RoundBoard, stage: int, round_no: int, me: str, registration: dict[str, Any],
                    patience: float, knock: asyncio.Event, exclude: Collection[str] = (),
                    evidence: Evidence = NO_EVIDENCE) -> tuple[Group | None, dict[str, float], str]:
    """(the group, every registrant's declared weight, why our θ_global is superseded: "" when it
    is not; the group is then None). `exclude`: peers whose registrations are dropped before the
    group is chosen (members that failed our recent rounds: peer/averaging/exclusion.py); the
    wait for every online replica to register still counts them, so an excluded member does not
    make the others wait out their patience. `evidence`: this replica's (peer/evidence.py): the
    group is chosen by it, and once anyone has a voice matchmaking waits for the voiced replicas,
    and for the others unless they are a flood (`waited_for`: forged ONLINE records must not make
    every round wait out its patience). The anchors among the stage's records (peers the run's
    owner vouches for: `Evidence.among`) have a voice here from the start."""
    # Our registration is stored while we read the others' (one DHT round trip instead of two
    # at every boundary): we know our own, and the others wait until they read it.
    registering = asyncio.ensure_future(board.register_round(stage, round_no, me, registration))
    try:
        deadline = time.monotonic() + patience
        # The group is settled when every replica the stage records call ONLINE has registered:
        # each member waits for the same condition, so all read the same set. Past the deadline
        # (a replica died, or its records lag) members may read different sets; then group hashes
        # differ, the round fails for all, and nobody applies anything.
        regs: dict[str, dict[str, Any]] = {}
        records: list[PeerRecord] = []
        intervals = poll_intervals(MATCHMAKING_POLL_SECONDS)
        while True:
            knock.clear()  # before the read: a request that arrives during it wakes the wait below
            regs, records = await asyncio.gather(board.round_registrations(stage, round_no), board.stage_records(stage))
            regs.setdefault(me, registration)
            evidence = evidence.among(records)  # the run owner's anchors where their record is: a voice each
            alive = waited_for(records, evidence)
            if alive <= set(regs) or time.monotonic() > deadline:
                break
            try:
                await within(knock.wait(), next(intervals))
            except asyncio.TimeoutError:
                continue
            # a part sent early may arrive just before its sender's registration lands: poll from
            # the shortest interval again rather than wait out a long one
            intervals = poll_intervals(MATCHMAKING_POLL_SECONDS)
        await registering  # the others must be able to read it before we go on
    finally:
        if not registering.done():  # the reads failed (or we were cancelled): the round is off anyway
            registering.cancel()
            await asyncio.gather(registering, return_exceptions=True)
    regs = {p: v for p, v in regs.items() if p not in exclude}
    weights = {p: float(v.get("weight", 0.0)) for p, v in regs.items()}
    group = choose_group(regs, evidence, me)
    if group is not None and me in group.members:
        # only a credible claim of a member with a voice says our state is superseded
        believed = [r for r in records if evidence.credible(r.applied_rounds, r.peer_id)
                    and (evidence.voice(r.peer_id) or not evidence.voiced)]
        ahead = decisions.finished_without_us(regs, believed, me, group.members)
        if ahead:
            return None, weights, (f"{', '.join(p[-8:] for p in ahead)} already applied this round "
                                   f"without us: our θ_global is superseded")
    return group, weights, ""


FLOOD_SLACK = 4
"""ONLINE records without a voice that matchmaking still waits for beyond twice the voiced ones:
a stage that starts with one replica and several joiners at once is no flood."""


def waited_for(records: list[PeerRecord], evidence: Evidence = NO_EVIDENCE) -> set[str]:
    """The ONLINE replicas whose registration matchmaking waits for: all of them, unless those
    without a voice are a flood (more than twice the voiced + FLOOD_SLACK): then only the voiced
    (see `matchmake`). Pure."""
    online = [r.peer_id for r in records if r.state == ONLINE]
    voiced = {p for p in online if evidence.voice(p)}
    if not evidence.voiced or len(online) - len(voiced) <= 2 * len(voiced) + FLOOD_SLACK:
        return set(online)
    return voiced
