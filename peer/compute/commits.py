"""Commit on acknowledgement: a stage ≥ 1 replica's gradients of answered microbatches, held until
the driver commits them or dropped after `timeouts.commit`.

A stage ≥ 1 does not add a microbatch's parameter gradients when it answers: the answer may be
lost, and the driver then re-sends the microbatch along another route. So they wait here under
(driver, microbatch id, attempt) until the driver, having got the answer and run its own
backward, commits that attempt; a later hold of the same attempt replaces the earlier one. So a
microbatch whose answer was lost, and that went again along another route, is trained on once at
every stage.

Each held microbatch knows the inner step it belongs to (the current one, or the next one for a
microbatch admitted ahead: peer/compute/lookahead.py). The worker counts the current step's against
that step's quota and takes no step while any of them is held, so a gradient is never added after
the step it was computed for (peer/compute/worker.py). This module is the store and its counts; the
worker computes the gradients and adds the committed ones.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

import torch

logger = logging.getLogger(__name__)

HoldKey = tuple[str, int, int]
"""(driver peer id, microbatch id, attempt): one trip of one microbatch."""


@dataclass(eq=False)  # compared by identity: gradients are tensors
class Held:
    grads: list[torch.Tensor | None]
    batch: int
    loss: float | None
    step: int
    """The worker's `steps_total` the gradients are for."""
    expiry: asyncio.TimerHandle
    stash: dict[str, torch.Tensor] | None = None
    """The weights the gradients were computed against if its microbatch ran ahead (lookahead)."""


class HeldCommits:
    """Answered microbatches' gradients waiting for their driver's commit, and what became of them.

    Invariants:
    - A key is held at most once; holding it again replaces the earlier gradients.
    - Every held microbatch leaves exactly once: popped by a commit, dropped when its
      `timeout` runs out (counted in `uncommitted`, then `on_drop` is called), or cleared at close.
    - `count(step)` is what the quota of inner step `step` counts; `len()` counts every step's.
    - `committed` lists each committed microbatch once, until `take_committed` hands them over.
    """

    def __init__(self, timeout: float, on_drop: Callable[[], None]):
        """`timeout`: seconds a microbatch is held (timeouts.commit). `on_drop`: called on the event
        loop after a microbatch was dropped for want of a commit (the gate wakes its waiters)."""
        self.timeout = timeout
        self.on_drop = on_drop
        self._held: dict[HoldKey, Held] = {}
        self.uncommitted = 0
        """Microbatches whose gradients were dropped because no commit came (reported in round events)."""
        self.committed: list[str] = []
        """"driver:microbatch" of every microbatch committed since the last `take_committed`
        (round events carry them, so the chaos soak counts microbatches trained twice exactly)."""

    def hold(self, key: HoldKey, batch: int, grads: list[torch.Tensor | None], loss: float | None, step: int,
             stash: dict[str, torch.Tensor] | None = None) -> None:
        """Hold a microbatch's gradients (for inner step `step`, computed against `stash` if it ran
        ahead) until `pop` or the timeout."""
        old = self._held.pop(key, None)
        if old is not None:  # the same attempt twice: keep the newer gradients only
            old.expiry.cancel()
        expiry = asyncio.get_running_loop().call_later(self.timeout, self._expire, key)
        self._held[key] = Held(grads, batch, loss, step, expiry, stash)

    def _expire(self, key: HoldKey) -> None:
        if self._held.pop(key, None) is not None:
            self.uncommitted += 1
            logger.info("dropped microbatch %s of %s: no commit within timeouts.commit", key[1], key[0][-8:])
            self.on_drop()

    def pop(self, keys: list[HoldKey]) -> list[tuple[HoldKey, Held]]:
        """The held microbatches of `keys` (unknown or dropped ones are skipped), no longer held."""
        out = []
        for key in keys:
            held = self._held.pop(key, None)
            if held is not None:
                held.expiry.cancel()
                out.append((key, held))
        return out

    def record(self, keys: list[HoldKey]) -> None:
        """These popped microbatches were committed (trained on now, or in the next step if they ran ahead)."""
        self.committed.extend(f"{k[0][-8:]}:{k[1]}" for k in keys)

    def take_committed(self) -> list[str]:
        """The microbatches committed since the last call ("driver:id", driver's last 8 characters)."""
        out, self.committed = self.committed, []
        return out

    def count(self, up_to_step: int) -> int:
        """Held microbatches of inner steps up to `up_to_step` (all of them: len())."""
        return sum(1 for h in self._held.values() if h.step <= up_to_step)

    def __len__(self) -> int:
        return len(self._held)

    def clear(self) -> None:
        for held in self._held.values():
            held.expiry.cancel()
        self._held.clear()
