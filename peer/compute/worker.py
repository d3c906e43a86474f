"""One stage replica's compute: `StageWorker`, the object the stage server, the driver and the
round runner call, composed of the parts it coordinates:

- `ComputeThread` (thread.py): the one thread torch runs on, its seconds and the announced rate;
- `StagePasses` (passes.py): forward, backward and loss, pure tensor code on that thread;
- `Gate` (gate.py): admission, the per-step quota, pause; the critical section of a step;
- `RoundTally` (tally.py): microbatches, samples and steps of the step, the round, and ever;
- `HeldCommits` (commits.py): a stage ≥ 1's gradients held until their driver commits them;
- `Lookahead` (lookahead.py): the stash the next step's microbatches run against;
- `StaleCorrection` (staleness.py): pipeline.stale_correction, applied to that stash or to the
  stale gradients as they join their step;
- `MeanInFlight` (mean_in_flight.py): an overlapped round's mean and the rebase it brings;
- `EvalCopy` (evaluation.py): the committed weights evaluations run on;
- `InnerOptimizer` (inner_optimizer.py): where gradients accumulate and what a step does.

The worker holds the rules that tie them together. A gradient computed against the live
parameters joins the accumulation only while no step can run in between (the gate counts its
microbatch in flight), or, if it is held for a commit, before its step (no step runs while any of
its own is held). A microbatch that ran ahead keeps its gradients aside until the step before its
own is applied. A move of the parameters (an inner step, a rebase) runs on the compute thread
inside the gate's critical section, when nothing it could disturb is in flight. So every gradient
is exact or, with lookahead, exactly one step stale, and each microbatch is trained on once.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator, Callable

import torch
from torch import nn

from swarmgrad.peer.clock import RoundClock
from swarmgrad.peer.compute.commits import HeldCommits, HoldKey
from swarmgrad.peer.compute.evaluation import EvalCopy, Weights
from swarmgrad.peer.compute.gate import Gate, NotReady, place_in_quota
from swarmgrad.peer.compute.inner_optimizer import InnerOptimizer
from swarmgrad.peer.compute.lookahead import PLAIN, Grads, Lookahead, Slot
from swarmgrad.peer.compute.mean_in_flight import MeanInFlight, Move
from swarmgrad.peer.compute.passes import LossFn, NonFiniteLoss, StagePasses
from swarmgrad.peer.compute.precision import Precision
from swarmgrad.peer.compute.rate import RateMeter
from swarmgrad.peer.compute.schedule import TrainingProgress
from swarmgrad.peer.compute.staleness import StaleCorrection
from swarmgrad.peer.compute.tally import RoundTally
from swarmgrad.peer.compute.thread import ComputeThread
from swarmgrad.peer.manifest import InnerOptConfig

__all__ = ["NonFiniteLoss", "NotReady", "StageWorker"]  # the refusals its callers catch

logger = logging.getLogger(__name__)


class StageWorker:
    """A stage replica's module, trained by microbatches that the driver and the stage server
    bring, in inner steps that the round runner pauses, averages around and resumes."""

    def __init__(self, module: nn.Module, inner: InnerOptConfig, device: torch.device, loss_fn: LossFn | None,
                 clock: RoundClock, progress: TrainingProgress, slowdown: float = 1.0, commit_timeout: float = 5.0,
                 rate_clock: str = "wall", precision: Precision | None = None, forward_first: bool = False,
                 stale_correction: tuple[str, float] = ("none", 1.0)):
        """`slowdown`, `rate_clock`: testing aids (peer/compute/thread.py). `commit_timeout`:
        timeouts.commit, how long an answered microbatch's gradients wait for their commit.
        `precision`: what the forwards compute in (default float32 on `device`). `forward_first`:
        pipeline.forward_first (a training forward goes before the backwards waiting for the
        compute thread). `stale_correction`: pipeline.stale_correction and its scale
        (peer/compute/staleness.py)."""
        self.module = module.to(device)
        self.precision = precision or Precision(device)
        self.device = device
        self.cfg = inner
        self.clock = clock
        self.progress = progress
        self.inner = InnerOptimizer(self.module, inner, progress)
        kind, scale = stale_correction
        self.correction = StaleCorrection(kind, scale, self.inner.params(), self.inner.optimizer, lambda: self.inner.lr)
        self.lookahead = Lookahead(self.module, self.correction.extrapolate if self.correction.moves_stash else None)
        self.evaluation = EvalCopy(self.module)
        self.passes = StagePasses(self.module, device, loss_fn, self.inner, self.lookahead, self.evaluation,
                                  self.precision)
        self.thread = ComputeThread(slowdown, rate_clock, forward_first)
        self.tally = RoundTally()
        self.mean = MeanInFlight()
        self.gate = Gate(clock, self.tally, self.mean)
        self.commits = HeldCommits(commit_timeout, self.gate.wake)

    # read-outs for the round runner, the driver and the presence record ------------------------
    @property
    def rate(self) -> RateMeter:
        return self.thread.rate

    @property
    def compute_total(self) -> float:
        return self.thread.compute_total

    @property
    def core_time(self) -> list[float]:
        return self.thread.core_time

    @property
    def paused(self) -> bool:
        return self.gate.paused

    @property
    def samples(self) -> int:
        return self.tally.samples

    @property
    def losses(self) -> list[float]:
        return self.tally.losses

    @property
    def inner_steps(self) -> int:
        return self.tally.inner_steps

    @property
    def steps_total(self) -> int:
        return self.tally.steps_total

    @property
    def microbatches_total(self) -> int:
        return self.tally.microbatches_total

    @property
    def skipped_steps(self) -> int:
        return self.tally.skipped_steps

    @property
    def uncommitted(self) -> int:
        return self.commits.uncommitted

    @property
    def held(self) -> int:
        return len(self.commits)

    def take_committed(self) -> list[str]:
        return self.commits.take_committed()

    @property
    def mean_wait_total(self) -> float:
        return self.mean.wait_total

    @property
    def lr(self) -> float:
        """The inner lr of the last step (the schedule's value at the swarm's position then)."""
        return self.inner.lr

    @property
    def moment_replicas(self) -> int | None:
        """The M of inner.swarm_second_moment's steps now (None when it is off)."""
        return self.inner.moment_replicas

    def set_replicas(self, count: int) -> None:
        """The replicas this one's steps are averaged with (peer/compute/inner_optimizer.py)."""
        self.inner.set_replicas(count)

    @property
    def eval_weights(self) -> Callable[[], Weights | None] | None:
        """Where evaluations (train=False) take their weights (peer/compute/evaluation.py)."""
        return self.evaluation.weights

    @eval_weights.setter
    def eval_weights(self, weights: Callable[[], Weights | None] | None) -> None:
        self.evaluation.weights = weights

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the compute thread (NOT_READY once closed)."""
        return await self.thread.run(fn, *args)

    # admission -----------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def admitted(self, wait: bool, train: bool = True, ahead: bool = False, hold: float = 0.0,
                       round_no: int | None = None) -> AsyncIterator[Slot]:
        """Hold a place in flight (peer/compute/gate.py). If paused: wait (wait=True, the driver's own
        stage) or raise NotReady. A replica waiting for an overlapped round's mean
        (rounds.overlap_steps) counts as paused. With `hold` > 0 a caller that does not wait still
        waits that many seconds for the replica to resume before NotReady; with `round`, it is
        admitted only once the clock has reached that round (a request of the next round arriving
        while this replica ends the current one).

        A training microbatch is also held back while this inner step's quota is taken. With
        `ahead` (pipeline.lookahead) it may instead take a place in the next step's quota, unless
        this step ends the round (peer/compute/lookahead.py). The slot says which; pass it to
        `forward` and `backward`.
        """
        async with self.gate.admit(lambda: self._place(ahead), train=train, wait=wait, hold=hold,
                                   round_no=round_no) as slot:
            yield slot

    def _place(self, ahead: bool) -> Slot | None:
        """A training microbatch's slot, if the quota has a place (called with the gate open)."""
        steps, held_current = self.tally.steps_total, self.commits.count(self.tally.steps_total)
        place = place_in_quota(
            self.cfg.microbatches_per_step, accumulated=self.tally.accumulated, held_current=held_current,
            in_flight_current=self.gate.in_flight_current,
            ahead=ahead and not self.clock.steps_complete(self.tally.inner_steps + 1),
            held_next=len(self.commits) - held_current + self.lookahead.held, in_flight_ahead=self.gate.in_flight_ahead)
        if place is None:
            return None
        later, position = place
        if later:
            return Slot(steps + 1, self.lookahead.stash(steps + 1), position=position)
        return Slot(steps, position=position)

    # compute -------------------------------------------------------------------------------
    async def forward(self, x: torch.Tensor, train: bool = True, slot: Slot = PLAIN
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """(input as used, output). With train, both keep the graph for `backward`; a slot admitted
        ahead runs against its stash."""
        # a training forward feeds the link (its output is the next request): with forward_first it
        # goes before waiting backwards, whose link work (the next request) is the forward's anyway
        return await self.thread.run(self.thread.timed, self.passes.forward, x, train, slot, first=train)

    async def backward(self, x: torch.Tensor, y: torch.Tensor, grad_y: torch.Tensor, batch: int,
                       slot: Slot = PLAIN) -> torch.Tensor | None:
        """Accumulate parameter gradients; return the gradient w.r.t. the stage input (None at stage 0).
        A slot admitted ahead: gradients w.r.t. its stash, held for the next step if this one has
        not been applied yet.

        Shielded: once the backward is submitted its gradients land in .grad, so it is counted
        even if the caller is cancelled meanwhile."""
        return await asyncio.shield(self._backward_counted(x, y, grad_y, batch, slot))

    async def _backward_counted(self, x: torch.Tensor, y: torch.Tensor, grad_y: torch.Tensor, batch: int,
                                slot: Slot) -> torch.Tensor | None:
        if slot.stash is None:
            grad_x = await self.thread.run(self.thread.timed, self.passes.backward, x, y, grad_y)
            self._trained(batch)
            return grad_x
        grads, grad_x = await self.thread.run(self.thread.timed, self.passes.grads, x, y, grad_y, slot)
        if slot.step > self.tally.steps_total:  # checked after the compute: the step may have run meanwhile
            self.lookahead.hold(grads, batch, slot.stash)
        else:
            await self.thread.run(self._add, [grads], [batch], [slot.stash])
            self._trained(batch)
        return grad_x

    async def forward_loss(self, x: torch.Tensor, targets: torch.Tensor, train: bool = True
                           ) -> tuple[float, torch.Tensor | None]:
        """Last stage: forward, loss and (with train) backward in one go."""
        return await asyncio.shield(self._forward_loss_counted(x, targets, train))

    async def _forward_loss_counted(self, x: torch.Tensor, targets: torch.Tensor, train: bool
                                    ) -> tuple[float, torch.Tensor | None]:
        loss, grad_x = await self.thread.run(self.thread.timed, self.passes.forward_loss, x, targets, train)
        if train:
            self.tally.losses.append(loss)
            self._trained(x.shape[0])
        return loss, grad_x

    def _trained(self, batch: int) -> None:
        """A microbatch's gradients joined the accumulation."""
        self.tally.trained(batch)
        self.thread.trained(batch)

    def record_loss(self, loss: float) -> None:
        """A microbatch's loss that a later stage computed (the driver's)."""
        self.tally.losses.append(loss)

    # commit on acknowledgement (peer/compute/commits.py) --------------------------------------
    async def backward_held(self, key: HoldKey, x: torch.Tensor, y: torch.Tensor, grad_y: torch.Tensor,
                            batch: int, loss: float | None = None, slot: Slot = PLAIN) -> torch.Tensor | None:
        """Like `backward`, but the parameter gradients wait for `commit(key)`. `loss`: the
        microbatch's loss from the answer (middle stages report it, for progress)."""
        return await asyncio.shield(self._backward_then_hold(key, x, y, grad_y, batch, loss, slot))

    async def _backward_then_hold(self, key: HoldKey, x: torch.Tensor, y: torch.Tensor, grad_y: torch.Tensor,
                                  batch: int, loss: float | None, slot: Slot) -> torch.Tensor | None:
        grads, grad_x = await self.thread.run(self.thread.timed, self.passes.grads, x, y, grad_y, slot)
        self.commits.hold(key, batch, grads, loss, self._step_of(slot), slot.stash)
        return grad_x

    async def forward_loss_held(self, key: HoldKey, x: torch.Tensor, targets: torch.Tensor, slot: Slot = PLAIN
                                ) -> tuple[float, torch.Tensor | None]:
        """Last stage, training: forward, loss, backward; the gradients wait for `commit(key)`."""
        return await asyncio.shield(self._forward_loss_then_hold(key, x, targets, slot))

    async def _forward_loss_then_hold(self, key: HoldKey, x: torch.Tensor, targets: torch.Tensor, slot: Slot
                                      ) -> tuple[float, torch.Tensor | None]:
        loss, grads, grad_x = await self.thread.run(self.thread.timed, self.passes.forward_loss_grads, x, targets, slot)
        self.commits.hold(key, x.shape[0], grads, loss, self._step_of(slot), slot.stash)
        return loss, grad_x

    def _step_of(self, slot: Slot) -> int:
        """The inner step a slot's gradients go into (the current one for a slot of a plain caller)."""
        return max(slot.step, self.tally.steps_total)

    async def commit(self, keys: list[HoldKey]) -> int:
        """Train on the held microbatches `keys` names (unknown or dropped ones are skipped).
        Returns how many were held. Shielded: the counts and .grad change together."""
        return await asyncio.shield(self._commit(keys))

    async def _commit(self, keys: list[HoldKey]) -> int:
        popped = self.commits.pop(keys)
        if not popped:
            return 0
        now = [h for _, h in popped if h.step <= self.tally.steps_total]
        for _, h in popped:
            if h.step > self.tally.steps_total:  # ran ahead and this step is not applied yet: the next one's
                assert h.stash is not None, "only a microbatch that ran ahead is held for a later step"
                self.lookahead.hold(h.grads, h.batch, h.stash)
        if now:  # after the holds above: a step that runs meanwhile promotes those
            await self.thread.run(self._add, [h.grads for h in now], [h.batch for h in now], [h.stash for h in now])
        self.commits.record([k for k, _ in popped])
        for h in now:
            self._trained(h.batch)
        self.tally.losses.extend(h.loss for _, h in popped if h.loss is not None)
        await self.gate.notify()
        return len(popped)

    # inner steps and round boundaries ------------------------------------------------------
    async def maybe_step(self, force: bool = False) -> bool:
        """Take an inner step once enough microbatches accumulated (or any, with force).

        Closes the gate, waits for in-flight microbatches, steps, reopens. Returns whether it stepped.
        Microbatches of the next step that finished meanwhile (lookahead) join the new accumulation;
        if they fill it, or with force, that step is taken too. The step that completes the round
        (the clock's count of inner steps) pauses the worker in the same critical section.
        """
        gate, tally = self.gate, self.tally
        stepped = False
        async with gate.cond:
            while not gate.stepping and tally.accumulated and (
                    force or tally.accumulated >= self.cfg.microbatches_per_step):
                gate.stepping = True
                try:
                    # nothing of this step between its forward and its backward, and nothing computed
                    # but uncommitted: a held gradient belongs to the parameters it was computed with
                    # (microbatches admitted ahead run against their stash, not these parameters)
                    await gate.cond.wait_for(lambda: gate.in_flight == gate.in_flight_ahead
                                             and not self.commits.count(tally.steps_total))
                    applied = await self.thread.run(self.thread.counted, self._inner_step)
                    tally.stepped(applied)
                    if not applied:
                        logger.warning("skipped an inner step: non-finite gradient (%d skipped so far)",
                                       tally.skipped_steps)
                    gate.stepped()
                    await self._promote_ahead()
                    move = self.mean.take()
                    if move is not None:
                        await self.thread.run(move)
                        self.mean.landed()
                    else:
                        self.mean.after_step(tally.steps_total)
                    self.thread.update_rate()
                    if self.clock.steps_complete(tally.inner_steps):
                        gate.paused = True
                finally:
                    gate.stepping = False
                    gate.cond.notify_all()
                stepped = True
                if gate.paused and not force:
                    break  # the round is over: the round runner's pause() steps what is left
        if stepped:
            self.clock.wake()
        return stepped

    def _inner_step(self) -> bool:
        """On the compute thread: the inner step over what has accumulated (False: skipped)."""
        return self.inner.step(self.tally.accumulated, self.tally.samples, self.tally.step_samples)

    async def _promote_ahead(self) -> None:
        """The next step's finished microbatches (lookahead) join the accumulation (call with the
        gate closed, after a step or at a boundary)."""
        ahead = self.lookahead.take()
        if ahead:
            await self.thread.run(self._add, [grads for grads, _, _ in ahead], [batch for _, batch, _ in ahead],
                                  [stash for _, _, stash in ahead])
            for _, batch, _ in ahead:
                self._trained(batch)

    def _add(self, grads: list[Grads], batches: list[int], stashes: list[dict[str, torch.Tensor] | None]) -> None:
        """On the compute thread: microbatches' gradients into the accumulation, those computed
        against a stash (they ran ahead) first compensated for it (pipeline.stale_correction
        "delay_comp"; call only once the step before theirs was applied)."""
        if self.correction.compensates:
            grads = [g if stash is None else
                     self.correction.compensate(g, self.lookahead.leaves(stash), self.inner.weight(batch))
                     for g, batch, stash in zip(grads, batches, stashes, strict=True)]
        self.inner.add(grads, batches)

    async def pause(self) -> None:
        """Stop taking microbatches, let the in-flight ones finish, take a last (partial) inner step."""
        gate = self.gate
        async with gate.cond:
            gate.paused = True
            # held microbatches are committed or dropped within timeouts.commit
            await gate.cond.wait_for(lambda: gate.in_flight == 0 and not gate.stepping and not self.commits)
            if not self.tally.accumulated:  # this step's microbatches were all lost: the next step's are what is left
                await self._promote_ahead()
        await self.maybe_step(force=True)

    async def resume(self, carry_over: bool = False) -> None:
        """Take microbatches again. With carry_over (a round that applied nothing), the round's
        samples keep counting into the next round's weight, since θ_local still holds their work."""
        async with self.gate.cond:
            self.gate.paused = False
            self.tally.new_round(carry_over)
            self.gate.cond.notify_all()

    async def leave(self) -> None:
        """This replica will not resume after its round: refuse (and stop holding) what arrives."""
        await self.gate.leave()

    def close(self) -> None:
        """Drop what is held and stop the compute thread; work that still arrives is refused."""
        self.commits.clear()
        self.thread.close()

    # the overlapped round's rebase (peer/rounds/overlap.py) ---------------------------------------
    def expect_mean(self, within_steps: int) -> None:
        """An overlapped round's mean is in flight: after `within_steps` more inner steps (0: no
        bound) the gate closes until it lands (rounds.overlap_steps)."""
        self.mean.expect(self.tally.steps_total, within_steps)

    async def mean_settled(self) -> None:
        """The mean in flight has landed (its move ran or waits for the next step) or will not
        come (a failed round, a cancelled one): no more waiting for it."""
        async with self.gate.cond:
            self.mean.landed()
            self.gate.cond.notify_all()

    async def rebase(self, fn: Move) -> None:
        """Run `fn` (which moves the parameters) on the compute thread when nothing is in flight,
        nothing held and no gradient accumulated, so that it changes no gradient already computed:
        now if the worker is idle so, else right after the next inner step, inside its critical
        section. If no step comes first, the round runner takes it back (`take_rebase`) at the
        boundary, with the worker paused.

        With the gate closed for this mean (rounds.overlap_steps) no step may come, so the move
        waits only for what was admitted before the gate closed, then runs and opens the gate
        (gradients of microbatches admitted ahead that already joined the accumulation stay, as
        they do when the move follows a step). Returns once the move has run."""
        gate, mean = self.gate, self.mean
        assert mean.move is None, "one rebase at a time: the boundary flushes the last one first"
        async with gate.cond:
            if mean.awaiting:
                mean.put(fn)
                try:
                    await gate.cond.wait_for(lambda: mean.move is None or (
                        not gate.stepping and gate.in_flight == 0 and not self.commits))
                except BaseException:  # the round was dropped (shutdown): its move must not run later
                    if mean.move is fn:
                        mean.take()
                    raise
                taken = mean.take()
                if taken is None:
                    return  # a step that the admitted microbatches filled took the move
                fn = taken
            elif gate.stepping or gate.in_flight or self.commits or self.tally.accumulated:
                mean.put(fn)
                return
            gate.stepping = True  # closes the gate to newcomers while the parameters move
            try:
                await self.thread.run(fn)
            finally:
                gate.stepping = False
                mean.landed()
                gate.cond.notify_all()

    def take_rebase(self) -> Move | None:
        """The move still waiting for a step, no longer waiting (the round runner runs it at the boundary)."""
        return self.mean.take()
