"""Commit on acknowledgement: a stage ≥ 1 replica's gradients of answered microbatches, held until
the driver commits them or dropped after `timeouts.commit`.

A stage ≥ 1 does not add a microbatch's parameter gradients when it answers: the answer may be
lost, and the driver then re-sends the microbatch along another route. So they wait here under
(driver, microbatch id, attempt) until the driver, having got the answer and run its own
backward, commits that attempt; a later hold of the same attempt replaces the earlier one. Each
held microbatch knows the inner step it belongs to (the current one, or the next one for a
microbatch admitted ahead: peer/compute/lookahead.py), so the worker's quota and its step wait only on
the current step's.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable

import torch

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


class HeldGradients:
    def __init__(self, timeout: float, on_expire: Callable[[HoldKey], None]):
        self.timeout = timeout
        self.on_expire = on_expire
        """Called (on the event loop) with the key of a microbatch dropped for want of a commit."""
        self._held: dict[HoldKey, Held] = {}

    def hold(self, key: HoldKey, batch: int, grads: list[torch.Tensor | None], loss: float | None, step: int) -> None:
        old = self._held.pop(key, None)
        if old is not None:  # the same attempt twice: keep the newer gradients only
            old.expiry.cancel()
        expiry = asyncio.get_running_loop().call_later(self.timeout, self._expire, key)
        self._held[key] = Held(grads, batch, loss, step, expiry)

    def _expire(self, key: HoldKey) -> None:
        if self._held.pop(key, None) is not None:
            self.on_expire(key)

    def pop(self, keys: list[HoldKey]) -> list[tuple[HoldKey, Held]]:
        """The held microbatches of `keys` (unknown or dropped ones are skipped), no longer held."""
        out = []
        for key in keys:
            held = self._held.pop(key, None)
            if held is not None:
                held.expiry.cancel()
                out.append((key, held))
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
