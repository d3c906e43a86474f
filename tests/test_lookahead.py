"""Lookahead (pipeline.lookahead) in the stage worker, in-process: the next step's microbatches run
against a stash of the weights, their gradients are one step stale and join the next step, the gate
never admits them across a round boundary, nothing is lost at a pause, and placement counts the
stash's memory (no network)."""
from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from torch import nn

from swarmgrad.peer.clock import RoundClock
from swarmgrad.peer.cli.launcher import small_manifest
from swarmgrad.peer.manifest import InnerOptConfig, RoundsConfig, ScheduleConfig
from swarmgrad.peer.compute.schedule import TrainingProgress
from swarmgrad.peer.placement.cost import stage_costs
from swarmgrad.peer.compute.worker import StageWorker

from support.until import until

pytestmark = pytest.mark.timeout(60)

QUOTA = 2


def make_worker(h: int = 0) -> StageWorker:
    torch.manual_seed(0)
    clock = RoundClock(RoundsConfig(inner_steps=h, round_seconds=0.0 if h else 10.0), counts_steps=True,
                       max_rounds=0, epoch=None)
    module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    return StageWorker(module, InnerOptConfig(lr=0.05, microbatch_size=3, microbatches_per_step=QUOTA), torch.device("cpu"),
                       None, clock, TrainingProgress(ScheduleConfig()))


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)) for _ in range(n)]


def grad_y(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """d(mse)/dy, the gradient a later stage would send back."""
    return (2 * (y.detach() - target) / y.numel())


def reference(module: nn.Module, steps: list[list[tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]]]
              ) -> nn.Module:
    """The worker's inner steps (AdamW as InnerOptConfig's defaults, clipped at 1) on `module`,
    each on the mean of gradients taken at the given weights."""
    ref = copy.deepcopy(module)
    opt = torch.optim.AdamW(ref.parameters(), lr=0.05, betas=(0.9, 0.95), weight_decay=0.1)
    for step in steps:
        for p in ref.parameters():
            p.grad = torch.zeros_like(p)
        for at, (x, t) in step:
            y = at(x)
            grads = torch.autograd.grad(y, list(at.parameters()), grad_y(y, t))
            for p, g in zip(ref.parameters(), grads):
                p.grad += g / len(step)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
    return ref


def assert_same_weights(module: nn.Module, want: nn.Module) -> None:
    for p, q in zip(module.parameters(), want.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


async def pass_through(w: StageWorker, x: torch.Tensor, t: torch.Tensor, slot, gate: asyncio.Event | None = None
                       ) -> None:
    xin, y = await w.forward(x, slot=slot)
    if gate is not None:
        await gate.wait()
    await w.backward(xin, y, grad_y(y, t), x.shape[0], slot=slot)


def test_next_step_runs_against_a_stash_and_its_gradients_are_one_step_stale() -> None:
    async def main() -> None:
        w = make_worker()
        start = copy.deepcopy(w.module)
        data = batches(4)
        release = asyncio.Event()
        entered: list[asyncio.Future] = []

        async def lane(i: int, x: torch.Tensor, t: torch.Tensor) -> None:
            async with w.admitted(wait=True, ahead=True) as slot:
                entered[i].set_result(slot)
                await pass_through(w, x, t, slot, release if i < QUOTA else None)
            await w.maybe_step()

        loop = asyncio.get_running_loop()
        entered = [loop.create_future() for _ in data]
        lanes = [asyncio.create_task(lane(i, x, t)) for i, (x, t) in enumerate(data)]
        slots = await asyncio.wait_for(asyncio.gather(*entered), 5)
        # the first two fill step 0; the next two were let in ahead, for step 1, against a stash
        assert [s.step for s in slots] == [0, 0, 1, 1] and [s.ahead for s in slots] == [False, False, True, True]
        assert slots[2].stash is slots[3].stash, "one stash per step"
        # the ahead ones finish first: held, step 0 is not taken without its own
        await until(lambda: w.lookahead.held == 2, "the two ahead microbatches held")
        assert w.lookahead.held == 2 and w.tally.accumulated == 0 and w.steps_total == 0
        release.set()
        await asyncio.wait_for(asyncio.gather(*lanes), 5)
        assert w.steps_total == 2 and w.tally.accumulated == 0 and w.lookahead.held == 0
        assert w.gate.in_flight == w.gate.in_flight_current == w.gate.in_flight_ahead == 0
        # step 0: its microbatches at the start; step 1: the ahead ones, also taken at the start
        want = reference(start, [[(start, data[0]), (start, data[1])], [(start, data[2]), (start, data[3])]])
        assert_same_weights(w.module, want)
        w.close()
    asyncio.run(main())


def test_an_ahead_microbatch_finishing_after_the_step_joins_the_next_one() -> None:
    async def main() -> None:
        w = make_worker()
        start = copy.deepcopy(w.module)
        data = batches(4)
        gates = [w.admitted(wait=True, ahead=True) for _ in range(3)]
        s0, s1, s2 = [await g.__aenter__() for g in gates]
        xin, y = await w.forward(data[2][0], slot=s2)
        for i in (0, 1):
            await pass_through(w, *data[i], (s0, s1)[i])
            await gates[i].__aexit__(None, None, None)
        # step 0 does not wait for the next step's microbatch between its forward and backward
        assert await asyncio.wait_for(w.maybe_step(), 5) and w.steps_total == 1
        await w.backward(xin, y, grad_y(y, data[2][1]), 3, slot=s2)  # straight into .grad
        await gates[2].__aexit__(None, None, None)
        assert w.tally.accumulated == 1 and w.lookahead.held == 0 and w.gate.in_flight == 0
        async with w.admitted(wait=True, ahead=True) as s3:
            assert not s3.ahead and s3.step == 1
            await pass_through(w, *data[3], s3)
        assert await w.maybe_step() and w.steps_total == 2
        step1 = reference(start, [[(start, data[0]), (start, data[1])]])
        want = reference(start, [[(start, data[0]), (start, data[1])], [(start, data[2]), (step1, data[3])]])
        assert_same_weights(w.module, want)
        w.close()
    asyncio.run(main())


def test_no_lookahead_into_the_next_round_or_without_asking() -> None:
    async def main() -> None:
        for h, ahead in ((1, True), (0, False)):
            w = make_worker(h=h)
            async with w.admitted(wait=True, ahead=ahead), w.admitted(wait=True, ahead=ahead):
                third = asyncio.create_task(w.admitted(wait=True, ahead=ahead).__aenter__())
                await asyncio.sleep(0.05)
                assert not third.done(), f"h={h} ahead={ahead}: a third microbatch got in"
                third.cancel()
                await asyncio.gather(third, return_exceptions=True)
            w.close()
    asyncio.run(main())


def test_pause_trains_what_ran_ahead_when_the_current_step_was_lost() -> None:
    async def main() -> None:
        w = make_worker()
        data = batches(1)
        async with w.admitted(wait=True, ahead=True), w.admitted(wait=True, ahead=True):
            async with w.admitted(wait=True, ahead=True) as s2:
                await pass_through(w, *data[0], s2)
            # the two current microbatches fail (their attempts end without a backward)
        assert w.lookahead.held == 1 and w.tally.accumulated == 0
        before = [p.detach().clone() for p in w.module.parameters()]
        await asyncio.wait_for(w.pause(), 5)
        assert w.steps_total == 1 and w.lookahead.held == 0 and w.tally.accumulated == 0
        assert any(not torch.equal(a, p) for a, p in zip(before, w.module.parameters()))
        w.close()
    asyncio.run(main())


def test_cancelled_ahead_microbatches_leave_no_count() -> None:
    async def main() -> None:
        w = make_worker()
        release = asyncio.Event()

        async def handler() -> None:
            async with w.admitted(wait=True, ahead=True):
                await release.wait()

        tasks = [asyncio.create_task(handler()) for _ in range(4)]
        await until(lambda: w.gate.in_flight == 4, "the 4 handlers admitted")
        assert w.gate.in_flight_current == 2 and w.gate.in_flight_ahead == 2
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert w.gate.in_flight == w.gate.in_flight_current == w.gate.in_flight_ahead == 0
        await asyncio.wait_for(w.pause(), 2.0)
        w.close()
    asyncio.run(main())


def test_a_later_stage_holds_what_ran_ahead_until_commit_and_its_step() -> None:
    async def main() -> None:
        w = make_worker()
        w.passes.loss_fn = lambda y, t: nn.functional.mse_loss(y, t)
        start = copy.deepcopy(w.module)
        data = batches(4)
        gates = [w.admitted(wait=False, ahead=True) for _ in range(4)]
        slots = [await g.__aenter__() for g in gates]
        assert [s.ahead for s in slots] == [False, False, True, True]
        keys = [("driver", i, 0) for i in range(4)]
        for i in (2, 3, 0, 1):  # the next step's two are answered first
            await w.forward_loss_held(keys[i], *data[i], slot=slots[i])
            await gates[i].__aexit__(None, None, None)
        assert w.held == 4
        assert await w.commit([keys[2], keys[3]]) == 2
        assert w.lookahead.held == 2 and w.tally.accumulated == 0, "committed ahead: waiting for this step, not in it"
        assert not await w.maybe_step()
        assert await w.commit([keys[0], keys[1]]) == 2 and w.tally.accumulated == 2
        assert await w.maybe_step() and w.steps_total == 2, "this step, then the next one the ahead pair fills"
        want = reference(start, [[(start, data[0]), (start, data[1])], [(start, data[2]), (start, data[3])]])
        assert_same_weights(w.module, want)
        w.close()
    asyncio.run(main())


def test_uncommitted_ahead_microbatches_block_only_their_own_step() -> None:
    async def main() -> None:
        w = make_worker()
        w.passes.loss_fn = lambda y, t: nn.functional.mse_loss(y, t)
        data = batches(3)
        gates = [w.admitted(wait=False, ahead=True) for _ in range(3)]
        slots = [await g.__aenter__() for g in gates]
        keys = [("driver", i, 0) for i in range(3)]
        for i in range(3):
            await w.forward_loss_held(keys[i], *data[i], slot=slots[i])
            await gates[i].__aexit__(None, None, None)
        await w.commit(keys[:2])
        assert await asyncio.wait_for(w.maybe_step(), 5), "an uncommitted microbatch of the next step does not hold this one"
        assert w.steps_total == 1 and w.held == 1
        assert not await w.maybe_step(force=True), "nothing of step 1 is committed yet"
        await w.commit([keys[2]])
        assert w.tally.accumulated == 1
        assert await w.maybe_step(force=True) and w.steps_total == 2
        w.close()
    asyncio.run(main())


def test_placement_counts_the_stash_with_lookahead() -> None:
    off = stage_costs(small_manifest())
    on = stage_costs(small_manifest(pipeline={"lookahead": True}))
    for a, b in zip(off, on):
        assert a.memory.stash == 0 and b.memory.stash == 4 * b.params
        assert b.memory.total == a.memory.total + b.memory.stash


def test_a_stash_taken_while_an_ahead_forward_runs_copies_the_live_weights() -> None:
    """functional_call swaps the module's attributes for the stash's tensors during a forward on
    the compute thread; a stash the event loop takes meanwhile must still copy the live weights."""
    from swarmgrad.peer.compute.lookahead import Lookahead
    torch.manual_seed(0)
    module = nn.Linear(3, 3)
    lookahead = Lookahead(module)
    taken = {}

    def during_forward(mod: nn.Module, inputs: tuple) -> None:
        taken["stash"] = lookahead.stash(7)
    module.register_forward_pre_hook(during_forward)
    lookahead.forward({n: torch.zeros_like(p) for n, p in module.named_parameters()}, torch.randn(1, 3))
    assert all(torch.equal(taken["stash"][n], p) for n, p in module.named_parameters())
