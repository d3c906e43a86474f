"""An overlapped round's mean in flight, as the worker sees it (peer/rounds/overlap.py has the
round's side): the bound after which the worker waits for it (rounds.overlap_steps), the time its
gate stayed closed for it, and the move of θ_local (the rebase) that waits for a quiet moment."""
from __future__ import annotations

import time
from typing import Callable

Move = Callable[[], None]
"""A closure that moves the parameters (run on the compute thread)."""


class MeanInFlight:
    """State only, changed on the event loop by the worker, under its gate's condition where the
    gate reads it (`awaiting`).

    Invariants:
    - `awaiting` is set only by `after_step` once the bound `due` is reached, and cleared only by
      `landed`, which also clears the bound: the gate is closed for a mean at most from the step
      that reached the bound until the mean lands (or its round ends without one).
    - `wait_total` grows by exactly the time `awaiting` was set.
    - At most one move is pending: `put` refuses a second until `take` hands the first over.
    """

    def __init__(self) -> None:
        self.due: int | None = None
        """`steps_total` after which the worker stops for the mean in flight (rounds.overlap_steps);
        None: no bound, or no mean in flight."""
        self.awaiting = False
        """The gate is closed until that mean lands (or its round ends without one)."""
        self._since = 0.0
        self.wait_total = 0.0
        """Seconds the gate stayed closed for overlapped means, ever (round events report its growth)."""
        self.move: Move | None = None
        """The rebase waiting to run: after the next inner step, or when what was admitted drains."""

    def expect(self, steps_total: int, within_steps: int) -> None:
        """A mean went in flight at `steps_total`: after `within_steps` more inner steps (0: no
        bound) the gate closes until it lands."""
        self.due = steps_total + within_steps if within_steps > 0 else None

    def after_step(self, steps_total: int) -> None:
        """After an inner step that took no move: close the gate if the bound is reached."""
        if self.due is not None and steps_total >= self.due and not self.awaiting:
            self.awaiting = True
            self._since = time.monotonic()

    def landed(self) -> None:
        """The mean has landed (its move ran or waits) or will not come: no bound, no waiting."""
        self.due = None
        if self.awaiting:
            self.awaiting = False
            self.wait_total += time.monotonic() - self._since

    def put(self, move: Move) -> None:
        assert self.move is None, "one rebase at a time: the boundary flushes the last one first"
        self.move = move

    def take(self) -> Move | None:
        """The pending move, no longer pending (None if there is none)."""
        move, self.move = self.move, None
        return move
