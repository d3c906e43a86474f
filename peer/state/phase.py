"""A replica's phase: the one value that says what it may do with its state right now.

    JOINING     taking the stage's state (a first join, or a re-sync after a round that left its
                θ_global stale): nothing worth sharing; announced "joining".
    SERVING     training, θ_global committed: the state is served; announced "online".
    AVERAGING   at a round boundary, worker paused: the round is about to change θ_global, so a
                state request is refused NOT_READY at once (a joiner must not start from the state
                a round replaces: hivemind #445); announced "online".
    HOLDING     the boundary is held for joiners that downloaded the state (decisions.join_hold):
                worker paused, nothing averaged, the state served; announced "online".
    OVERLAPPED  an overlapped round (rounds.overlap) averages in the background while the worker
                trains: a state request waits for the mean to land and gets the state it makes;
                announced "online".
    LEAVING     on the way out (shutdown, or the old replica of a move): final, refused;
                announced "leaving".

Allowed transitions (`TRANSITIONS`; a move to the current phase is no move):

    JOINING    -> SERVING                    the handlers are up (Replica.start)
    SERVING    -> AVERAGING                  a round boundary
    AVERAGING  -> HOLDING -> AVERAGING       the join hold
    AVERAGING  -> SERVING | OVERLAPPED       the worker resumes after a plain round | an overlapped round starts
    OVERLAPPED -> SERVING | AVERAGING        its mean landed (mid-round | at the next boundary)
    AVERAGING | OVERLAPPED -> JOINING -> back to it   a stale replica re-syncs within its round
    any        -> LEAVING                    and LEAVING is final: later moves are ignored (the
                                             round runner may finish a round while its replica
                                             announces that it leaves)

One writer: the replica's `RoundRunner` (peer/rounds/runner.py) calls `enter`; `Replica.start`
and `Replica.close` go through it (`RoundRunner.serve`, `RoundRunner.leave`). Every other piece
reads: the state server (`StateSync.handle`), the presence record (its status is
`presence_status(phase)`) and the join hold. Readers that must wake on a change await
`wait_while`.
"""
from __future__ import annotations

import asyncio
import enum
from typing import Collection

from swarmgrad.peer.records import JOINING, LEAVING, ONLINE


class Phase(enum.Enum):
    JOINING = "joining"
    SERVING = "serving"
    AVERAGING = "averaging"
    HOLDING = "holding"
    OVERLAPPED = "overlapped"
    LEAVING = "leaving"


TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.JOINING: frozenset({Phase.SERVING, Phase.AVERAGING, Phase.OVERLAPPED, Phase.LEAVING}),
    Phase.SERVING: frozenset({Phase.AVERAGING, Phase.LEAVING}),
    Phase.AVERAGING: frozenset({Phase.HOLDING, Phase.SERVING, Phase.OVERLAPPED, Phase.JOINING, Phase.LEAVING}),
    Phase.HOLDING: frozenset({Phase.AVERAGING, Phase.LEAVING}),
    Phase.OVERLAPPED: frozenset({Phase.SERVING, Phase.AVERAGING, Phase.JOINING, Phase.LEAVING}),
    Phase.LEAVING: frozenset(),
}
"""Where each phase may go. JOINING -> AVERAGING | OVERLAPPED is the end of a re-sync within a
round (it returns to the phase it interrupted); a first join goes to SERVING."""


def presence_status(phase: Phase) -> str:
    """What the presence record announces in `phase` (the DHT wire values of peer/records.py)."""
    if phase is Phase.JOINING:
        return JOINING
    if phase is Phase.LEAVING:
        return LEAVING
    return ONLINE


def serves_state(phase: Phase) -> bool:
    """May the committed snapshot be served now? (OVERLAPPED: after the mean lands.)"""
    return phase in (Phase.SERVING, Phase.HOLDING)


class ReplicaPhase:
    """The phase of one replica: JOINING at first. Written only by its RoundRunner (module
    docstring); read by anyone."""

    def __init__(self) -> None:
        self._current = Phase.JOINING
        self._changed = asyncio.Event()
        """Set (and replaced by a fresh one) at every change: `wait_while` sleeps on it."""

    @property
    def current(self) -> Phase:
        return self._current

    @property
    def status(self) -> str:
        """The presence record's status in the current phase (JOINING / ONLINE / LEAVING)."""
        return presence_status(self._current)

    @property
    def online(self) -> bool:
        return self.status == ONLINE

    def enter(self, phase: Phase) -> None:
        """Move to `phase`. A move to the current phase, or out of LEAVING, changes nothing;
        any other move that `TRANSITIONS` does not allow raises ValueError (a bug in the writer)."""
        old = self._current
        if phase is old or old is Phase.LEAVING:
            return
        if phase not in TRANSITIONS[old]:
            raise ValueError(f"a replica's phase cannot go from {old.name} to {phase.name}")
        self._current = phase
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait_while(self, phases: Collection[Phase]) -> Phase:
        """Wait until the phase is none of `phases`; returns it. No deadline of its own: callers
        bound it (net.deadline.within)."""
        while self._current in phases:
            await self._changed.wait()
        return self._current
