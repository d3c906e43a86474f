"""The stage worker in-process: its gate under concurrency and cancellation, its step quota,
non-finite steps, and the schedule's lr (no network, no processes)."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch
from torch import nn

from swarmgrad.peer.clock import RoundClock
from swarmgrad.peer.manifest import InnerOptConfig, RoundsConfig, ScheduleConfig
from swarmgrad.peer.compute.schedule import TrainingProgress
from swarmgrad.peer.compute.worker import NonFiniteLoss, NotReady, StageWorker

from support.until import until

pytestmark = pytest.mark.timeout(60)


def make_worker(h: int = 0, schedule: ScheduleConfig = ScheduleConfig(), loss: bool = False,
                **kw) -> StageWorker:
    torch.manual_seed(0)
    clock = RoundClock(RoundsConfig(inner_steps=h, round_seconds=0.0 if h else 10.0), counts_steps=True,
                       max_rounds=0, epoch=None)
    loss_fn = (lambda y, t: nn.functional.mse_loss(y, t)) if loss else None
    return StageWorker(nn.Linear(4, 4), InnerOptConfig(lr=0.1, microbatches_per_step=2), torch.device("cpu"),
                       loss_fn, clock, TrainingProgress(schedule), **kw)


def test_cancelled_handlers_leave_no_phantom_in_flight() -> None:
    async def main() -> None:
        w = make_worker()
        release = asyncio.Event()

        async def handler() -> None:
            async with w.admitted(wait=True):
                await release.wait()

        tasks = [asyncio.create_task(handler()) for _ in range(2)]
        await until(lambda: w.gate.in_flight == 2, "both handlers admitted")
        assert w.gate.in_flight == 2
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert w.gate.in_flight == 0 and w.gate.in_flight_current == 0
        await asyncio.wait_for(w.pause(), 2.0)  # would hang on a phantom in-flight microbatch
        w.close()
    asyncio.run(main())


def test_quota_and_pause_refuse_with_not_ready() -> None:
    async def main() -> None:
        w = make_worker(loss=True)
        x, t = torch.randn(3, 4), torch.randn(3, 4)
        for _ in range(2):
            async with w.admitted(wait=False):
                await w.forward_loss(x, t)
        assert w.tally.accumulated == 2
        assert await w.maybe_step() and w.inner_steps == 1 and w.tally.accumulated == 0
        await w.pause()
        with pytest.raises(NotReady):
            async with w.admitted(wait=False):
                pass
        await w.resume()
        w.close()
    asyncio.run(main())


def test_h_steps_pause_the_worker_inside_the_step() -> None:
    async def main() -> None:
        w = make_worker(h=1, loss=True)
        x, t = torch.randn(3, 4), torch.randn(3, 4)
        for _ in range(2):
            async with w.admitted(wait=False):
                await w.forward_loss(x, t)
        await w.maybe_step()
        assert w.paused, "the H-th step pauses the worker in the same critical section"
        w.clock.finished = True
        await w.resume()
        for _ in range(2):
            async with w.admitted(wait=False):
                await w.forward_loss(x, t)
        await w.maybe_step()
        assert not w.paused, "after the last round the worker never pauses itself"
        w.close()
    asyncio.run(main())


def test_non_finite_gradient_skips_the_step_and_loss_is_refused() -> None:
    async def main() -> None:
        w = make_worker(loss=True)
        before = {n: p.detach().clone() for n, p in w.module.named_parameters()}
        x, t = torch.randn(3, 4), torch.randn(3, 4)
        bad_t = t.clone()
        bad_t[0, 0] = float("nan")
        with pytest.raises(NonFiniteLoss):
            await w.forward_loss(x, bad_t)
        assert w.tally.accumulated == 0, "a non-finite loss is not trained on"
        for _ in range(2):
            await w.forward_loss(x, t)
        next(iter(w.module.parameters())).grad[0, 0] = float("inf")  # a poisoned gradient
        await w.maybe_step()
        assert w.skipped_steps == 1
        for n, p in w.module.named_parameters():
            assert torch.equal(p.detach(), before[n]), "a skipped step leaves the parameters alone"
        w.close()
    asyncio.run(main())


def test_inner_lr_follows_the_swarm_position() -> None:
    async def main() -> None:
        sched = ScheduleConfig(kind="linear", warmup_samples=0, total_samples=100, min_lr_ratio=0.0)
        w = make_worker(schedule=sched, loss=True)
        w.progress.trained = 50  # what the swarm agreed at the last boundary
        x, t = torch.randn(3, 4), torch.randn(3, 4)
        for _ in range(2):
            await w.forward_loss(x, t)
        await w.maybe_step()
        # position = 50 agreed + 6 local samples (share 1): lr = 0.1 * (1 - 56/100)
        assert w.lr == pytest.approx(0.1 * (1 - 56 / 100))
        assert w.inner.optimizer.param_groups[0]["lr"] == pytest.approx(w.lr)
        w.close()
    asyncio.run(main())


def test_rate_clock_cpu_leaves_out_time_the_thread_did_not_run_and_slowdown_scales_both() -> None:
    def compute() -> None:
        time.sleep(0.05)  # descheduled: what a neighbour on a shared core takes
        end = time.thread_time() + 0.01
        while time.thread_time() < end:  # ~10 ms of our own CPU
            pass

    wall, cpu = make_worker(slowdown=3.0), make_worker(slowdown=3.0, rate_clock="cpu")
    for w in (wall, cpu):
        w.thread.timed(compute)
        w.close()
    assert wall.thread.rate_s >= 3 * 0.06 and wall.compute_total == pytest.approx(wall.thread.rate_s, rel=1e-3)
    assert 3 * 0.01 <= cpu.thread.rate_s < 3 * 0.03  # the sleep is not the peer's compute
    assert cpu.compute_total >= 3 * 0.06  # utilisation stays in elapsed time
    with pytest.raises(KeyError):
        make_worker(rate_clock="gpu")


def test_core_time_counts_the_compute_threads_cpu_against_elapsed_time_without_the_slowdown() -> None:
    def compute() -> None:
        time.sleep(0.05)  # descheduled: a neighbour has the core
        end = time.thread_time() + 0.02
        while time.thread_time() < end:
            pass

    w = make_worker(slowdown=3.0)
    w.thread.timed(compute)
    w.close()
    cpu, elapsed = w.core_time
    assert 0.02 <= cpu < 0.04 and 0.07 <= elapsed < 3 * 0.07  # the slowdown's sleep is in neither
    assert cpu / elapsed < 0.6 and w.compute_total >= 3 * 0.07


def test_a_closed_worker_refuses_work_that_arrives_late() -> None:
    """A request admitted before the replica stopped reaches the worker after `close` shut its
    compute thread: a NOT_READY refusal (the caller retries elsewhere), not an executor error
    logged as a server bug."""
    from swarmgrad.protocol import wire_pb2 as pb
    from swarmgrad.protocol.framing import ProtocolError

    async def main() -> None:
        w = make_worker(loss=True)
        x, t = torch.randn(3, 4), torch.randn(3, 4)
        await w.forward_loss(x, t, False)
        w.close()
        with pytest.raises(ProtocolError) as refused:
            await w.forward_loss(x, t, False)
        assert refused.value.status == pb.NOT_READY and "stopping" in refused.value.reason
    asyncio.run(main())


def test_evaluations_score_the_committed_snapshot_while_training_moves_the_live_weights() -> None:
    from swarmgrad.peer.manifest import OuterOptConfig
    from swarmgrad.peer.state.stage_state import StageState

    async def main() -> None:
        w = make_worker(loss=True)
        state = StageState(w.module, OuterOptConfig())
        w.eval_weights = lambda: state.snapshot.params
        x, t = torch.randn(3, 4), torch.randn(3, 4)
        theta0 = nn.functional.mse_loss(w.module(x), t).item()
        for _ in range(2):
            async with w.admitted(wait=False):
                await w.forward_loss(x, t)
        assert await w.maybe_step()  # θ_local moved; nothing committed since
        live = nn.functional.mse_loss(w.module(x), t).item()
        assert live != theta0
        assert (await w.forward_loss(x, t, train=False))[0] == theta0
        _, y = await w.forward(x, train=False)
        assert torch.equal(y, torch.func.functional_call(w.module, state.snapshot.params, (x,)))
        assert all(p.requires_grad for p in w.module.parameters())  # the module's own are untouched
        with torch.no_grad():  # a round boundary: θ_global takes the trained weights and commits
            for name, p in w.module.named_parameters():
                state.params[name].copy_(p)
        state.commit(1)
        assert (await w.forward_loss(x, t, train=False))[0] == live
        w.eval_weights = None  # no source: the module's own weights
        assert (await w.forward_loss(x, t, train=False))[0] == live
        w.close()
    asyncio.run(main())


@pytest.mark.parametrize("swarm", [False, True], ids=["adamw", "swarm_adamw"])
def test_microbatches_of_different_sizes_step_on_the_mean_over_samples(swarm: bool) -> None:
    # sizes 1 and 3 (inner.microbatch_sizes, microbatch_size 4): each step must be the step of the
    # 4 samples at once, as the whole model would take it; several steps, because AdamW's first
    # moves each weight by ±lr whatever the gradient's size (SwarmAdamW with one replica: AdamW)
    async def main() -> nn.Module:
        clock = RoundClock(RoundsConfig(inner_steps=0, round_seconds=10.0), counts_steps=True, max_rounds=0,
                           epoch=None)
        inner = InnerOptConfig(lr=0.05, microbatch_size=4, microbatches_per_step=2, microbatch_sizes=(1, 3),
                               swarm_second_moment=swarm)
        torch.manual_seed(0)
        w = StageWorker(nn.Linear(4, 4), inner, torch.device("cpu"), lambda y, t: nn.functional.mse_loss(y, t),
                        clock, TrainingProgress(ScheduleConfig()))
        positions = []
        for x, t in data:
            for n, lo in zip(inner.step_sizes, (0, 1)):
                async with w.admitted(wait=False) as slot:
                    positions.append(slot.position)
                    await w.forward_loss(x[lo:lo + n], t[lo:lo + n])
            assert w.tally.step_samples == 4
            assert await w.maybe_step() and w.tally.step_samples == 0
        assert positions == [0, 1] * len(data)
        w.close()
        return w.module

    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)) for _ in range(6)]
    got = asyncio.run(main())
    torch.manual_seed(0)
    want = nn.Linear(4, 4)
    opt = torch.optim.AdamW(want.parameters(), lr=0.05, betas=(0.9, 0.95), weight_decay=0.1)
    for x, t in data:
        nn.functional.mse_loss(want(x), t).backward()
        torch.nn.utils.clip_grad_norm_(want.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    for p, q in zip(got.parameters(), want.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
