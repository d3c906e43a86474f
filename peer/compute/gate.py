"""Admission to a replica's compute: the gate, the per-step microbatch quota, and pause.

Graphs of microbatches in flight reference the live parameters, so an inner step (or an outer
round, which rewrites them) must wait until no microbatch is between its forward and its
backward: the gate closes to newcomers, in-flight work drains, the step runs, the gate opens.
That makes every gradient exact (no stale weights), which is what lets a pipeline round with one
replica per stage equal a plain step of the whole model.

A training microbatch is also held back while its inner step's quota is taken (`place_in_quota`):
every inner step then averages exactly inner.microbatches_per_step microbatches, as a plain
optimiser step would. With pipeline.lookahead it may instead take a place in the next step's
quota (peer/compute/lookahead.py).

The gate is also closed while the replica is paused (between rounds: by the round runner, or by
the worker itself after the step that completes the round) and while it waits for an overlapped
round's mean (rounds.overlap_steps, peer/compute/mean_in_flight.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator, Callable

from swarmgrad.peer.clock import RoundClock
from swarmgrad.peer.compute.lookahead import PLAIN, Slot
from swarmgrad.peer.compute.mean_in_flight import MeanInFlight
from swarmgrad.peer.compute.tally import RoundTally


class NotReady(Exception):
    """The replica is between rounds (or leaving) and takes no new microbatches now."""


def place_in_quota(quota: int, *, accumulated: int, held_current: int, in_flight_current: int, ahead: bool,
                   held_next: int, in_flight_ahead: int) -> tuple[int, int] | None:
    """Where a training microbatch may go: (0, position) in the current inner step, (1, position)
    in the next one, or None (wait for a place).

    The current step's places are taken by what has accumulated, what is held for a commit and
    what is in flight for it; `position` is how many were taken before this one. With `ahead` (the
    caller runs ahead and this step does not end the round) a full step lets the microbatch into
    the next step's quota, which what is in flight ahead and held for the next step take.
    """
    taken = accumulated + held_current + in_flight_current
    if taken < quota:
        return 0, taken
    taken_next = in_flight_ahead + held_next
    if ahead and taken_next < quota:
        return 1, taken_next
    return None


class Gate:
    """The condition every admission, step and boundary of one replica synchronises on, and the
    counts and flags they read.

    Invariants (on the event loop; every change a waiter could be waiting for is followed by a
    notify of `cond`):
    - `in_flight` counts the microbatches admitted and not yet released (evaluations included);
      `in_flight_current` of them train into the current inner step, `in_flight_ahead` into the
      next (lookahead). A release always decrements them, synchronously, even when its holder is
      cancelled: no phantom microbatch ever blocks a later step.
    - Nothing is admitted while `closed` (`stepping`, `paused`, or awaiting an overlapped mean).
    - `stepping` is set only by the one critical section that moves the parameters (an inner
      step, a rebase), which waits for the admitted microbatches it could disturb.
    - `paused` is set by the worker (its pause, or the step that completes the round) and cleared
      only by its resume; `leaving`, once set, stays set.
    """

    def __init__(self, clock: RoundClock, tally: RoundTally, mean: MeanInFlight):
        """`clock`: read for a request of a later round; `tally`: its `steps_total` says whether
        a released slot's step has been applied; `mean`: its `awaiting` closes the gate."""
        self.clock = clock
        self.tally = tally
        self.mean = mean
        self.cond = asyncio.Condition()
        self.in_flight = 0
        self.in_flight_current = 0
        """Training microbatches in flight for the current inner step."""
        self.in_flight_ahead = 0
        """Training microbatches in flight for the next inner step (pipeline.lookahead)."""
        self.stepping = False
        self.paused = False
        self.leaving = False
        """This replica stops after its round (a move, the peer's shutdown): what arrives while it is
        paused is refused at once, not held for a resume that will not come."""
        self._wakes: set[asyncio.Future] = set()

    @property
    def closed(self) -> bool:
        return self.paused or self.stepping or self.mean.awaiting

    @contextlib.asynccontextmanager
    async def admit(self, place: Callable[[], Slot | None], *, train: bool, wait: bool, hold: float,
                    round_no: int | None) -> AsyncIterator[Slot]:
        """Hold a place in flight, at the slot `place()` gives (called while the gate is open, for
        a training microbatch; None: no place yet, wait). An evaluation (not `train`) takes PLAIN.

        While the replica is paused, awaits an overlapped mean, or (with `round`) its clock has not
        reached `round`: a caller that does not `wait` waits up to `hold` seconds for that to end,
        then NotReady (at once if the replica is leaving); one that waits (the driver's own stage)
        waits. Either way it then waits for an open gate and a place.
        """
        give_up = time.monotonic() + hold
        async with self.cond:
            while True:
                early = round_no is not None and self.clock.current < round_no
                # a replica waiting for an overlapped round's mean is refused as between rounds: the
                # driver tries another replica or comes back, its request is not held past its deadline
                if (self.paused or early or self.mean.awaiting) and not wait:
                    left = give_up - time.monotonic()
                    if self.leaving:
                        raise NotReady("leaving this stage")
                    if left <= 0:
                        raise NotReady(f"still in a round before {round_no}; ending it" if early else
                                       "between rounds" if self.paused else "waiting for the last round's mean")
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self.cond.wait(), left)  # resume() notifies
                    continue
                if not self.closed:
                    slot = place() if train else PLAIN
                    if slot is not None:
                        break
                await self.cond.wait()
            self.in_flight += 1
            if slot.ahead:
                self.in_flight_ahead += 1
            else:
                self.in_flight_current += int(train)
        try:
            yield slot
        finally:
            # The counts change synchronously: a handler cancelled here (its caller went away)
            # must not leave a phantom microbatch in flight that blocks every later step.
            self.in_flight -= 1
            if slot.step > self.tally.steps_total:  # still ahead: the current step has not been applied
                self.in_flight_ahead -= 1
            else:
                self.in_flight_current -= int(train)
            await asyncio.shield(self.notify())

    def stepped(self) -> None:
        """An inner step was applied (inside its critical section): what was in flight ahead is
        in flight for the current step now."""
        self.in_flight_current, self.in_flight_ahead = self.in_flight_current + self.in_flight_ahead, 0

    async def leave(self) -> None:
        """The replica will not resume after its round: refuse (and stop holding) what arrives."""
        async with self.cond:
            self.leaving = True
            self.cond.notify_all()

    async def notify(self) -> None:
        async with self.cond:
            self.cond.notify_all()

    def wake(self) -> None:
        """`notify` from a plain callback (a held microbatch was dropped: its place is free), as a
        task the gate keeps until it is done."""
        task = asyncio.ensure_future(self.notify())
        self._wakes.add(task)
        task.add_done_callback(self._wakes.discard)
