"""The round clock: the one owner of "which round is it" for a stage replica.

Everything that needs the round reads it here — the driver stamps it on every microbatch, the
stage server compares requests against it, the averager refuses requests far from it, state
sync adopts a donor's — and only the round runner advances it, so no two of them can disagree
about the round, even for a moment.

Rounds end by a shared wall clock (`rounds.round_seconds` from the run's epoch), by H inner
steps counted at the drivers (`rounds.inner_steps`), or, on a later stage, when work of a later
round arrives (each microbatch carries its driver's round). The decision is the pure
`decisions.round_ended`; the clock holds its inputs and the event that wakes the waiter.
"""
from __future__ import annotations

import asyncio
import math

from swarmgrad.peer.net.deadline import within
from swarmgrad.peer.manifest import RoundsConfig


class RoundClock:
    def __init__(self, cfg: RoundsConfig, *, counts_steps: bool, max_rounds: int, epoch: float | None):
        self.cfg = cfg
        self.counts_steps = counts_steps and cfg.inner_steps > 0
        """Drivers end rounds after H inner steps; later stages follow the drivers' rounds."""
        self.max_rounds = max_rounds
        self.epoch = epoch
        self.current = 0
        """The round this replica runs next (or is running)."""
        self.seen = -1
        """The latest round a microbatch has announced to this replica."""
        self.rounds_done = 0
        """Rounds counted against max_rounds (from the first round in which the stage trained)."""
        self._counting = False
        self.finished = False
        """max_rounds were counted: no more rounds, and the worker must not pause itself again."""
        self._wake = asyncio.Event()

    # what collaborators read and report ---------------------------------------------------------
    def wall_round(self, now: float) -> int | None:
        """The round the shared wall clock is in (None without wall-clock rounds)."""
        if self.epoch is None or not self.cfg.round_seconds:
            return None
        return max(0, math.floor((now - self.epoch) / self.cfg.round_seconds))

    def wall_end(self, round_no: int) -> float | None:
        if self.epoch is None or not self.cfg.round_seconds:
            return None
        return self.epoch + (round_no + 1) * self.cfg.round_seconds

    def observe(self, round_no: int) -> bool:
        """A microbatch of `round` arrived. True if it is later than ours: we end our round first
        (and the caller answers NOT_READY meanwhile)."""
        if round_no <= self.current:
            return False
        self.seen = max(self.seen, round_no)
        self._wake.set()
        return True

    def steps_complete(self, inner_steps: int) -> bool:
        """Does this many inner steps end the round here? (The worker pauses itself when it does,
        inside the step's critical section, so no microbatch slips into the next round.)"""
        return self.counts_steps and not self.finished and inner_steps >= self.cfg.inner_steps

    def wake(self) -> None:
        """Something the boundary condition depends on changed (an inner step, a later round)."""
        self._wake.set()

    async def wait_change(self, timeout: float) -> None:
        self._wake.clear()
        try:
            await within(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    # what the round runner does ------------------------------------------------------------------
    def next_round(self, now: float) -> int:
        """The round to run after the current one: never behind a driver's or the wall clock's."""
        wall = self.wall_round(now)
        return max(self.current + 1, self.seen, wall if wall is not None else 0)

    def advance(self, round_no: int) -> None:
        self.current = max(self.current, round_no)

    def adopt(self, round_no: int, now: float) -> None:
        """A downloaded state is ready for `round`: catch up, never move backwards."""
        wall = self.wall_round(now)
        self.current = max(self.current, round_no, wall if wall is not None else 0)

    def count(self, trained: bool) -> None:
        """A round ended; it counts once the stage group has trained at all (a swarm still
        assembling runs empty rounds that must not use up the run's budget)."""
        self._counting = self._counting or trained
        if self._counting:
            self.rounds_done += 1
        if self.max_rounds and self.rounds_done >= self.max_rounds:
            self.finished = True


def resume_epoch(now: float, resume_round: int, round_seconds: float) -> float:
    """The wall-clock epoch that puts `now` at the start of `resume_round`: what the first peer of
    a swarm resuming from a checkpoint of that round announces (a fresh epoch would put every
    restored replica `resume_round` rounds ahead of the clock, waiting that long to average)."""
    return now - max(0, resume_round) * round_seconds
