"""The stage worker's side of commit on acknowledgement (peer/compute/held.py has the store): a stage ≥ 1
computes an answered microbatch's parameter gradients but adds them only when the driver commits
that attempt, so a microbatch whose answer was lost and that went again along another route is
trained on once.

A part of `StageWorker` (peer/compute/worker.py), kept apart because it is its own protocol: the worker
owns the state these methods use (the `HeldGradients`, the compute thread, the gate's condition,
the step counters) and its gate counts held microbatches against the step's quota.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import torch

from swarmgrad.peer.compute.held import HoldKey
from swarmgrad.peer.compute.lookahead import PLAIN, Slot

if TYPE_CHECKING:
    from swarmgrad.peer.compute.worker import StageWorker

logger = logging.getLogger(__name__)


class CommitOnAck:
    """Holding answered microbatches' gradients until the driver commits them (StageWorker's base)."""

    async def backward_held(self: StageWorker, key: HoldKey, x: torch.Tensor, y: torch.Tensor, grad_y: torch.Tensor,
                            batch: int, loss: float | None = None, slot: Slot = PLAIN) -> torch.Tensor | None:
        """Like `backward`, but the parameter gradients wait for `commit(key)` (module docstring).
        `loss`: the microbatch's loss from the answer (middle stages report it, for progress)."""
        return await asyncio.shield(self._backward_then_hold(key, x, y, grad_y, batch, loss, slot))

    async def _backward_then_hold(self: StageWorker, key: HoldKey, x: torch.Tensor, y: torch.Tensor, grad_y: torch.Tensor,
                                  batch: int, loss: float | None, slot: Slot) -> torch.Tensor | None:
        grads, grad_x = await self.run(self._timed, self._backward_held, x, y, grad_y, slot)
        self._held.hold(key, batch, grads, loss, self._step_of(slot))
        return grad_x

    async def forward_loss_held(self: StageWorker, key: HoldKey, x: torch.Tensor, targets: torch.Tensor, slot: Slot = PLAIN
                                ) -> tuple[float, torch.Tensor | None]:
        """Last stage, training: forward, loss, backward; the gradients wait for `commit(key)`."""
        return await asyncio.shield(self._forward_loss_then_hold(key, x, targets, slot))

    async def _forward_loss_then_hold(self: StageWorker, key: HoldKey, x: torch.Tensor, targets: torch.Tensor, slot: Slot
                                      ) -> tuple[float, torch.Tensor | None]:
        loss, grads, grad_x = await self.run(self._timed, self._forward_loss_held, x, targets, slot)
        self._held.hold(key, x.shape[0], grads, loss, self._step_of(slot))
        return loss, grad_x

    def _step_of(self: StageWorker, slot: Slot) -> int:
        """The inner step a slot's gradients go into (the current one for a slot of a plain caller)."""
        return max(slot.step, self.steps_total)

    def _expired(self: StageWorker, key: HoldKey) -> None:
        self.uncommitted += 1
        logger.info("dropped microbatch %s of %s: no commit within timeouts.commit", key[1], key[0][-8:])
        task = asyncio.ensure_future(self._notify())  # wake admissions waiting on the quota
        self._notifies.add(task)
        task.add_done_callback(self._notifies.discard)

    async def commit(self: StageWorker, keys: list[HoldKey]) -> int:
        """Train on the held microbatches `keys` names (unknown or dropped ones are skipped).
        Returns how many were held. Shielded: the counts and .grad change together."""
        return await asyncio.shield(self._commit(keys))

    async def _commit(self: StageWorker, keys: list[HoldKey]) -> int:
        popped = self._held.pop(keys)
        if not popped:
            return 0
        now = [h for _, h in popped if h.step <= self.steps_total]
        for _, h in popped:
            if h.step > self.steps_total:  # ran ahead and this step is not applied yet: the next one's
                self.lookahead.hold(h.grads, h.batch)
        if now:  # after the holds above: a step that runs meanwhile promotes those
            await self.run(self.inner.add, [h.grads for h in now], [h.batch for h in now])
        self._committed.extend(f"{k[0][-8:]}:{k[1]}" for k, _ in popped)
        for h in now:
            self._finished(h.batch)
        self.losses.extend(h.loss for _, h in popped if h.loss is not None)
        await self._notify()
        return len(popped)

    def take_committed(self) -> list[str]:
        """The microbatches committed since the last call ("driver:id", driver's last 8 characters)."""
        out, self._committed = self._committed, []
        return out

    @property
    def held(self) -> int:
        return len(self._held)
