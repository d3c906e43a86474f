"""One stage replica's compute: forward, backward, and the gate that keeps them consistent with
the inner steps (what a step computes, and where gradients accumulate: peer/compute/inner_optimizer.py).

Graphs of microbatches in flight reference the live parameters, so an inner step (or an outer
round, which rewrites them) must wait until no microbatch is between its forward and its
backward: the gate closes to newcomers, in-flight work drains, the step runs, the gate opens.
That makes every gradient exact (no stale weights), which is what lets a pipeline round with
one replica per stage equal a plain step of the whole model.

All torch work runs on one worker thread per peer, so compute never blocks the event loop
that serves RPCs, and forward/backward of different microbatches never interleave mid-op.

Commit on acknowledgement: a stage ≥ 1 does not add a microbatch's parameter gradients when it
answers, but holds them (peer/compute/held.py; this side of it: peer/compute/commits.py) until the driver
commits that attempt (it got the answer and ran its own backward), or drops them after
`commit_timeout`. So a microbatch whose answer was lost, and that the driver re-sent along another
route, is trained on once at every stage. Held microbatches count against their step's quota, and
no step runs while any of its own is held, so a gradient is never added after the step it was
computed for.

With pipeline.lookahead a microbatch may be admitted for the next step while this one drains: it
runs against a stash of the weights and its gradients join the next step (peer/compute/lookahead.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable

import torch
from torch import nn

from swarmgrad.peer.clock import RoundClock
from swarmgrad.peer.compute.held import HeldGradients
from swarmgrad.peer.compute.inner_optimizer import InnerOptimizer
from swarmgrad.peer.compute.lookahead import PLAIN, Lookahead, Slot, grads_wrt
from swarmgrad.peer.manifest import InnerOptConfig
from swarmgrad.peer.compute.rate import RateMeter
from swarmgrad.peer.compute.schedule import TrainingProgress
from swarmgrad.peer.compute.commits import CommitOnAck
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.framing import ProtocolError

logger = logging.getLogger(__name__)

RATE_CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}
"""The seconds an announced rate divides by. "wall": elapsed time of each compute call, what the
swarm gets from this peer. "cpu" (testing aid, --rate-clock cpu): the compute thread's CPU time, so
that peers sharing one machine's cores, each with one torch thread, measure themselves rather than
their neighbours' share of the cores (the 6-peer rebalancing test and benchmark on 2 cores).
`StageWorker._timed` reads both once per call (the cpu one is also the core share's)."""


class NotReady(Exception):
    """The replica is between rounds (or leaving) and takes no new microbatches now."""


class NonFiniteLoss(Exception):
    """The last stage computed a non-finite loss; the microbatch was not trained on."""


class StageWorker(CommitOnAck):
    def __init__(self, module: nn.Module, inner: InnerOptConfig, device: torch.device,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
                 clock: RoundClock, progress: TrainingProgress, slowdown: float = 1.0, commit_timeout: float = 5.0,
                 rate_clock: str = "wall"):
        self.module = module.to(device)
        self.device = device
        self.loss_fn = loss_fn
        self.cfg = inner
        self.clock = clock
        self.progress = progress
        self.inner = InnerOptimizer(self.module, inner, progress)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-compute")
        self._cond = asyncio.Condition()
        self._in_flight = 0
        self._in_flight_train = 0
        """Training microbatches in flight for the current inner step."""
        self._in_flight_ahead = 0
        """Training microbatches in flight for the next inner step (pipeline.lookahead)."""
        self.lookahead = Lookahead(self.module)
        self._paused = False
        self._stepping = False
        self.leaving = False
        """This replica stops after its round (a move, the peer's shutdown): what arrives while it is
        paused is refused at once, not held for a resume that will not come (`leave`)."""
        self.closed = False
        """Set by `close`: the compute thread is gone; work that still arrives is refused."""
        self.accumulated = 0
        """Microbatches whose gradients sit in .grad, waiting for the next inner step."""
        self.step_samples = 0
        """Their samples (the step divides the summed gradients by these, in microbatch_size units)."""
        self.inner_steps = 0
        """Inner steps since the last round boundary."""
        self.steps_total = 0
        """Inner steps ever (an overlapped round asks whether θ_local moved since its snapshot)."""
        self.samples = 0
        """Samples trained on since the last round boundary (the averaging weight)."""
        self.losses: list[float] = []
        """Losses of microbatches since the last round boundary (known at the last stage and at drivers)."""
        self.rate = RateMeter()
        """Samples/s of this replica's forward+backward compute alone (waits excluded), an EMA over
        inner steps: what it announces and what placement reasons with."""
        self.slowdown = slowdown
        """Testing aid (--slowdown F): each compute call sleeps (F−1)× its measured time, on the
        compute thread, so the replica really is F times slower and measures itself so."""
        self.rate_clock = RATE_CLOCKS[rate_clock]
        """What the announced rate's seconds are (testing aid --rate-clock)."""
        self._compute_s = 0.0
        self._samples_since_rate = 0
        self.compute_total = 0.0
        """Seconds this replica has spent computing (forward, backward, inner steps; waits excluded),
        ever, never reset: the round runner turns its growth over a round into the round's utilisation,
        the driver its growth over a report window into its compute utilisation (peer/pipeline/window.py)."""
        self.core_time = [0.0, 0.0]
        """[CPU seconds of the compute thread, elapsed seconds] over the compute calls themselves
        (the --slowdown sleep excluded), ever: their ratio is the share of a core the compute
        thread got while it ran. Below 1 on a CPU device, other processes shared its core, and the
        time this replica waits is theirs to use (the driver reports it, `core_share`)."""
        self._rebase: Callable[[], None] | None = None
        self._mean_due: int | None = None
        """`steps_total` after which the worker stops for the overlapped round's mean in flight
        (rounds.overlap_steps); None: no bound, or no mean in flight."""
        self._awaiting_mean = False
        """The gate is closed until that mean lands (or its round ends without one)."""
        self._awaiting_since = 0.0
        self.mean_wait_total = 0.0
        """Seconds the gate stayed closed for overlapped means, ever (round events report its growth)."""
        self.eval_weights: Callable[[], dict[str, torch.Tensor] | None] | None = None
        """Where evaluations (train=False) take their weights. The replica points it at θ_global's
        committed snapshot, so a validation loss scores the model the stage group agreed on at its
        last round boundary on every stage, not θ_local part-way through inner steps, which other
        drivers' microbatches keep moving while an evaluation passes through. None: the module's."""
        self._eval_module: nn.Module | None = None
        self._eval_source: dict[str, torch.Tensor] | None = None
        self.skipped_steps = 0
        """Inner steps skipped because a gradient was not finite (reported in round events)."""
        self._held = HeldGradients(commit_timeout, self._expired)
        self._notifies: set[asyncio.Future] = set()
        self.uncommitted = 0
        """Microbatches whose gradients were dropped because no commit came (reported in round events)."""
        self._committed: list[str] = []
        """"driver:microbatch" of every microbatch committed here since the last take_committed()
        (round events carry them, so the chaos soak counts microbatches trained twice exactly)."""

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.inner.optimizer

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

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.closed:  # a request admitted before the replica stopped: refused, not a server bug
            raise ProtocolError(pb.NOT_READY, "this replica is stopping")
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def _timed(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run compute on this thread, measure it, and stretch it by the slowdown (testing aid)."""
        wall = self.rate_clock is time.perf_counter  # one reading per clock: two differ under load
        cpu_started = time.thread_time()  # the cpu rate clock's reading too (RATE_CLOCKS)
        started = time.perf_counter()
        out = fn(*args)
        spent = time.perf_counter() - started
        cpu_spent = time.thread_time() - cpu_started
        measured = spent if wall else cpu_spent
        self._core(cpu_spent, spent)
        if self.slowdown > 1:
            time.sleep((self.slowdown - 1) * spent)
            spent, measured = spent * self.slowdown, measured * self.slowdown
        self._compute_s += measured
        self.compute_total += spent
        return out

    def _timed_step(self) -> bool:
        cpu_started = time.thread_time()
        started = time.perf_counter()
        try:
            return self.inner.step(self.accumulated, self.samples, self.step_samples)
        finally:
            spent = time.perf_counter() - started
            self.compute_total += spent
            self._core(time.thread_time() - cpu_started, spent)

    def _core(self, cpu_spent: float, spent: float) -> None:
        self.core_time[0] += cpu_spent
        self.core_time[1] += spent

    # the overlapped round's rebase (peer/rounds/overlap.py) ---------------------------------------
    def expect_mean(self, within_steps: int) -> None:
        """An overlapped round's mean is in flight: after `within_steps` more inner steps (0: no
        bound) the gate closes until it lands (rounds.overlap_steps)."""
        self._mean_due = self.steps_total + within_steps if within_steps > 0 else None

    async def mean_settled(self) -> None:
        """The mean in flight has landed (its move ran or waits for the next step) or will not
        come (a failed round, a cancelled one): no more waiting for it."""
        async with self._cond:
            self._mean_landed()
            self._cond.notify_all()

    def _mean_landed(self) -> None:
        self._mean_due = None
        if self._awaiting_mean:
            self._awaiting_mean = False
            self.mean_wait_total += time.monotonic() - self._awaiting_since

    def _maybe_await_mean(self) -> None:
        """After an inner step that took no move: close the gate if the bound is reached."""
        if self._mean_due is not None and self.steps_total >= self._mean_due and not self._awaiting_mean:
            self._awaiting_mean = True
            self._awaiting_since = time.monotonic()

    async def rebase(self, fn: Callable[[], None]) -> None:
        """Run `fn` (which moves the parameters) on the compute thread when nothing is in flight,
        nothing held and no gradient accumulated, so that it changes no gradient already computed:
        now if the worker is idle so, else right after the next inner step, inside its critical
        section. If no step comes first, the round runner takes it back (`take_rebase`) at the
        boundary, with the worker paused.

        With the gate closed for this mean (rounds.overlap_steps) no step may come, so the move
        waits only for what was admitted before the gate closed, then runs and opens the gate
        (gradients of microbatches admitted ahead that already joined the accumulation stay, as
        they do when the move follows a step). Returns once the move has run."""
        assert self._rebase is None, "one rebase at a time: the boundary flushes the last one first"
        async with self._cond:
            if self._awaiting_mean:
                self._rebase = fn
                try:
                    await self._cond.wait_for(lambda: self._rebase is None or (
                        not self._stepping and self._in_flight == 0 and not self._held))
                except BaseException:  # the round was dropped (shutdown): its move must not run later
                    if self._rebase is fn:
                        self._rebase = None
                    raise
                taken = self.take_rebase()
                if taken is None:
                    return  # a step that the admitted microbatches filled took the move
                fn = taken
            elif self._stepping or self._in_flight or self._held or self.accumulated:
                self._rebase = fn
                return
            self._stepping = True  # closes the gate to newcomers while the parameters move
            try:
                await self.run(fn)
            finally:
                self._stepping = False
                self._mean_landed()
                self._cond.notify_all()

    def take_rebase(self) -> Callable[[], None] | None:
        fn, self._rebase = self._rebase, None
        return fn

    @contextlib.asynccontextmanager
    async def admitted(self, wait: bool, train: bool = True, ahead: bool = False, hold: float = 0.0,
                       round: int | None = None) -> AsyncIterator[Slot]:
        """Hold a place in flight. If paused: wait (wait=True, the driver's own stage) or raise NotReady.
        A replica waiting for an overlapped round's mean (rounds.overlap_steps) counts as paused.
        With `hold` > 0 a caller that does not wait still waits that many seconds for the replica to
        resume before NotReady; with `round`, it is admitted only once the clock has reached that
        round (a request of the next round arriving while this replica ends the current one).

        A training microbatch is also held back while this inner step's quota is taken (what has
        accumulated plus what is in flight reaches inner.microbatches_per_step): every inner step
        then averages exactly that many microbatches, as a plain optimiser step would. With
        `ahead` (pipeline.lookahead) it may instead take a place in the next step's quota, unless
        this step ends the round (peer/compute/lookahead.py). The slot says which; pass it
        to `forward` and `backward`.
        """
        quota = self.cfg.microbatches_per_step
        give_up = time.monotonic() + hold
        async with self._cond:
            while True:
                early = round is not None and self.clock.current < round
                # a replica waiting for an overlapped round's mean is refused as between rounds: the
                # driver tries another replica or comes back, its request is not held past its deadline
                if (self._paused or early or self._awaiting_mean) and not wait:
                    left = give_up - time.monotonic()
                    if self.leaving:
                        raise NotReady("leaving this stage")
                    if left <= 0:
                        raise NotReady(f"still in a round before {round}; ending it" if early else
                                       "between rounds" if self._paused else "waiting for the last round's mean")
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._cond.wait(), left)  # resume() notifies
                    continue
                if not (self._paused or self._stepping or self._awaiting_mean):
                    if not train:
                        slot = PLAIN
                        break
                    current_held = self._held.count(self.steps_total)
                    taken = self.accumulated + current_held + self._in_flight_train
                    if taken < quota:
                        slot = Slot(self.steps_total, position=taken)
                        break
                    next_held = len(self._held) - current_held + self.lookahead.held
                    if ahead and self._in_flight_ahead + next_held < quota and \
                            not self.clock.steps_complete(self.inner_steps + 1):
                        slot = Slot(self.steps_total + 1, self.lookahead.stash(self.steps_total + 1),
                                    position=self._in_flight_ahead + next_held)
                        break
                await self._cond.wait()
            self._in_flight += 1
            if slot.ahead:
                self._in_flight_ahead += 1
            else:
                self._in_flight_train += int(train)
        try:
            yield slot
        finally:
            # The counts change synchronously: a handler cancelled here (its caller went away)
            # must not leave a phantom microbatch in flight that blocks every later step.
            self._in_flight -= 1
            if slot.step > self.steps_total:  # still ahead: the current step has not been applied
                self._in_flight_ahead -= 1
            else:
                self._in_flight_train -= int(train)
            await asyncio.shield(self._notify())

    async def leave(self) -> None:
        """This replica will not resume after its round: refuse (and stop holding) what arrives."""
        async with self._cond:
            self.leaving = True
            self._cond.notify_all()

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    # compute -----------------------------------------------------------------------------
    def _forward(self, x: torch.Tensor, train: bool, slot: Slot = PLAIN) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.to(self.device)
        if x.is_floating_point() and train:
            x.requires_grad_(True)
        with torch.set_grad_enabled(train):
            if slot.stash is not None:
                return x, self.lookahead.forward(slot.stash, x)
            if not train and (evaluated := self._eval_module_now()) is not None:
                return x, evaluated(x)
            return x, self.module(x)

    def _eval_module_now(self) -> nn.Module | None:
        """A copy of the module holding `eval_weights`, refreshed once per snapshot (compute
        thread). A copy rather than `functional_call` on the module: that swaps the module's own
        parameters for the call's duration, and the event loop reads them meanwhile (a lookahead
        stash). Where the module is fp32 on the CPU the copy's parameters are the snapshot's own
        (immutable) tensors, so it costs no memory; elsewhere one copy on the module's device."""
        source = self.eval_weights() if self.eval_weights is not None else None
        if source is None:
            return None
        if self._eval_module is None:
            self._eval_module = copy.deepcopy(self.module).requires_grad_(False)
            for p in self._eval_module.parameters():
                p.grad = None
        if self._eval_source is not source:
            with torch.no_grad():
                for name, p in self._eval_module.named_parameters():
                    t = source[name]
                    if t.device == p.device and t.dtype == p.dtype:
                        p.data = t
                    else:
                        p.copy_(t)
                # θ_global holds no buffers: those (a BatchNorm's statistics) are the live module's
                live = dict(self.module.named_buffers())
                for name, b in self._eval_module.named_buffers():
                    b.copy_(live[name])
            self._eval_source = source
        return self._eval_module

    async def forward(self, x: torch.Tensor, train: bool = True, slot: Slot = PLAIN
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """(input as used, output). With train, both keep the graph for `backward`; a slot admitted
        ahead runs against its stash."""
        return await self.run(self._timed, self._forward, x, train, slot)

    def _backward(self, x: torch.Tensor, y: torch.Tensor, grad_y: torch.Tensor) -> torch.Tensor | None:
        if self.inner.per_microbatch:
            grads, grad_x = self._backward_held(x, y, grad_y, PLAIN)
            self.inner.add([grads], [x.shape[0]])
            return grad_x
        y.backward(grad_y.to(y.device, y.dtype))
        return None if x.grad is None else x.grad.detach().to("cpu", torch.float32)

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
            grad_x = await self.run(self._timed, self._backward, x, y, grad_y)
            self._finished(batch)
            return grad_x
        grads, grad_x = await self.run(self._timed, self._backward_held, x, y, grad_y, slot)
        if slot.step > self.steps_total:  # checked after the compute: the step may have run meanwhile
            self.lookahead.hold(grads, batch)
        else:
            await self.run(self.inner.add, [grads], [batch])
            self._finished(batch)
        return grad_x

    def _grads_of(self, out: torch.Tensor, x: torch.Tensor, grad_out: torch.Tensor | None, slot: Slot
                  ) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
        """Parameter gradients (w.r.t. the slot's stash, if it ran ahead) and the input's,
        computed without adding them to .grad."""
        params = self.inner.params() if slot.stash is None else self.lookahead.leaves(slot.stash)
        return grads_wrt(out, params, x, grad_out)

    def _backward_held(self, x: torch.Tensor, y: torch.Tensor, grad_y: torch.Tensor, slot: Slot
                       ) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
        return self._grads_of(y, x, grad_y.to(y.device, y.dtype), slot)

    def _forward_loss_held(self, x: torch.Tensor, targets: torch.Tensor, slot: Slot
                           ) -> tuple[float, list[torch.Tensor | None], torch.Tensor | None]:
        x, loss = self._loss(x, targets, True, slot)
        grads, grad_x = self._grads_of(self.inner.weighted(loss, x.shape[0]), x, None, slot)
        return loss.detach().item(), grads, grad_x

    def _loss(self, x: torch.Tensor, targets: torch.Tensor, train: bool, slot: Slot = PLAIN
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(input as used, loss); a non-finite training loss raises NonFiniteLoss (not trained on)."""
        assert self.loss_fn is not None
        x, y = self._forward(x, train, slot)
        loss = self.loss_fn(y, targets.to(self.device))
        if train and not torch.isfinite(loss):
            raise NonFiniteLoss(f"non-finite loss {loss.item()}: not trained on")
        return x, loss

    def _forward_loss(self, x: torch.Tensor, targets: torch.Tensor, train: bool) -> tuple[float, torch.Tensor | None]:
        x, loss = self._loss(x, targets, train)
        if not train:
            return loss.item(), None
        if self.inner.per_microbatch:
            grads, grad_x = self._grads_of(self.inner.weighted(loss, x.shape[0]), x, None, PLAIN)
            self.inner.add([grads], [x.shape[0]])
            return loss.detach().item(), grad_x
        self.inner.weighted(loss, x.shape[0]).backward()
        return loss.detach().item(), (None if x.grad is None else x.grad.detach().to("cpu", torch.float32))

    async def forward_loss(self, x: torch.Tensor, targets: torch.Tensor, train: bool = True
                           ) -> tuple[float, torch.Tensor | None]:
        """Last stage: forward, loss and (with train) backward in one go."""
        return await asyncio.shield(self._forward_loss_counted(x, targets, train))

    async def _forward_loss_counted(self, x: torch.Tensor, targets: torch.Tensor, train: bool
                                    ) -> tuple[float, torch.Tensor | None]:
        loss, grad_x = await self.run(self._timed, self._forward_loss, x, targets, train)
        if train:
            self.losses.append(loss)
            self._finished(x.shape[0])
        return loss, grad_x

    def _finished(self, batch: int) -> None:
        self.accumulated += 1
        self.step_samples += batch
        self.samples += batch
        self._samples_since_rate += batch

    def record_loss(self, loss: float) -> None:
        self.losses.append(loss)

    # inner steps and round boundaries ------------------------------------------------------
    async def maybe_step(self, force: bool = False) -> bool:
        """Take an inner step once enough microbatches accumulated (or any, with force).

        Closes the gate, waits for in-flight microbatches, steps, reopens. Returns whether it stepped.
        Microbatches of the next step that finished meanwhile (lookahead) join the new accumulation;
        if they fill it, or with force, that step is taken too.
        """
        stepped = False
        async with self._cond:
            while not self._stepping and self.accumulated and (
                    force or self.accumulated >= self.cfg.microbatches_per_step):
                self._stepping = True
                try:
                    # nothing of this step between its forward and its backward, and nothing computed
                    # but uncommitted: a held gradient belongs to the parameters it was computed with
                    # (microbatches admitted ahead run against their stash, not these parameters)
                    await self._cond.wait_for(lambda: self._in_flight == self._in_flight_ahead
                                              and not self._held.count(self.steps_total))
                    if not await self.run(self._timed_step):
                        self.skipped_steps += 1
                        logger.warning("skipped an inner step: non-finite gradient (%d skipped so far)",
                                       self.skipped_steps)
                    self.accumulated = self.step_samples = 0
                    self.steps_total += 1
                    self._in_flight_train, self._in_flight_ahead = self._in_flight_train + self._in_flight_ahead, 0
                    await self._promote_ahead()
                    rebase = self.take_rebase()
                    if rebase is not None:
                        await self.run(rebase)
                        self._mean_landed()
                    else:
                        self._maybe_await_mean()
                    self.inner_steps += 1
                    self._update_rate()
                    if self.clock.steps_complete(self.inner_steps):
                        self._paused = True
                finally:
                    self._stepping = False
                    self._cond.notify_all()
                stepped = True
                if self._paused and not force:
                    break  # the round is over: the round runner's pause() steps what is left
        if stepped:
            self.clock.wake()
        return stepped

    async def _promote_ahead(self) -> None:
        """The next step's finished microbatches (lookahead) join the accumulation (call with the
        gate closed, after a step or at a boundary)."""
        ahead = self.lookahead.take()
        if ahead:
            await self.run(self.inner.add, [grads for grads, _ in ahead], [batch for _, batch in ahead])
            for _, batch in ahead:
                self._finished(batch)

    def _update_rate(self) -> None:
        # evaluation forwards count as compute but not as samples: only steps that trained update
        self.rate.update(self._samples_since_rate, self._compute_s)
        self._compute_s, self._samples_since_rate = 0.0, 0

    async def pause(self) -> None:
        """Stop taking microbatches, let the in-flight ones finish, take a last (partial) inner step."""
        async with self._cond:
            self._paused = True
            # held microbatches are committed or dropped within timeouts.commit
            await self._cond.wait_for(lambda: self._in_flight == 0 and not self._stepping and not self._held)
            if not self.accumulated:  # this step's microbatches were all lost: the next step's are what is left
                await self._promote_ahead()
        await self.maybe_step(force=True)

    async def resume(self, carry_over: bool = False) -> None:
        """Take microbatches again. With carry_over (a round that applied nothing), the round's
        samples keep counting into the next round's weight, since θ_local still holds their work."""
        async with self._cond:
            self._paused = False
            self.inner_steps = 0
            if not carry_over:
                self.samples = 0
                self.losses = []
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def close(self) -> None:
        self.closed = True
        self._held.clear()
        self.executor.shutdown(wait=True, cancel_futures=True)
