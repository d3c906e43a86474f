"""The stage worker's parts, each on its own (peer/compute/): the quota rule, the gate, the round
tally, an overlapped mean in flight, held commits, the compute thread, the evaluation copy and the
passes. Each test proves an invariant its part's docstring states; the worker's tests
(test_worker.py, test_lookahead.py, test_commit.py, test_overlap.py) prove them together. No
network, no processes."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from torch import nn

from swarmgrad.peer.clock import RoundClock
from swarmgrad.peer.compute.commits import HeldCommits
from swarmgrad.peer.compute.evaluation import EvalCopy
from swarmgrad.peer.compute.gate import Gate, NotReady, place_in_quota
from swarmgrad.peer.compute.inner_optimizer import InnerOptimizer
from swarmgrad.peer.compute.lookahead import PLAIN, Lookahead, Slot
from swarmgrad.peer.compute.mean_in_flight import MeanInFlight
from swarmgrad.peer.compute.passes import NonFiniteLoss, StagePasses
from swarmgrad.peer.compute.schedule import TrainingProgress
from swarmgrad.peer.compute.tally import RoundTally
from swarmgrad.peer.compute.thread import ComputeThread
from swarmgrad.peer.manifest import InnerOptConfig, RoundsConfig, ScheduleConfig
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.framing import ProtocolError

from support.until import until

pytestmark = pytest.mark.timeout(60)


# --- the quota ------------------------------------------------------------------------------
def test_the_quota_counts_accumulated_held_and_in_flight_and_lets_in_ahead_only_when_asked() -> None:
    def place(**kw: int | bool) -> tuple[int, int] | None:
        counts = dict(accumulated=0, held_current=0, in_flight_current=0, ahead=False, held_next=0, in_flight_ahead=0)
        return place_in_quota(4, **{**counts, **kw})  # type: ignore[arg-type]

    assert place() == (0, 0)
    assert place(accumulated=1, held_current=1, in_flight_current=1) == (0, 3), "position: places taken before"
    full = dict(accumulated=2, held_current=1, in_flight_current=1)
    assert place(**full) is None, "a full step takes no more"
    assert place(**full, ahead=True) == (1, 0), "with lookahead: the next step's first place"
    assert place(**full, ahead=True, held_next=2, in_flight_ahead=1) == (1, 3)
    assert place(**full, ahead=True, held_next=2, in_flight_ahead=2) is None, "and never past the next step's quota"


# --- the gate --------------------------------------------------------------------------------
def make_gate(current_round: int = 0) -> tuple[Gate, RoundTally, MeanInFlight, RoundClock]:
    clock = RoundClock(RoundsConfig(inner_steps=0, round_seconds=10.0), counts_steps=True, max_rounds=0, epoch=None)
    clock.current = current_round
    tally, mean = RoundTally(), MeanInFlight()
    return Gate(clock, tally, mean), tally, mean, clock


def current(tally: RoundTally) -> Slot:
    return Slot(tally.steps_total)


def test_the_gate_counts_in_flight_by_step_and_an_ahead_slot_joins_the_current_step_at_a_step() -> None:
    async def main() -> None:
        gate, tally, _, _ = make_gate()
        async with gate.admit(lambda: current(tally), train=True, wait=False, hold=0, round_no=None):
            async with gate.admit(lambda: Slot(tally.steps_total + 1, {}), train=True, wait=False, hold=0, round_no=None):
                async with gate.admit(lambda: None, train=False, wait=False, hold=0, round_no=None) as evaluation:
                    assert evaluation is PLAIN, "an evaluation takes no place in the quota"
                    assert (gate.in_flight, gate.in_flight_current, gate.in_flight_ahead) == (3, 1, 1)
                tally.stepped(True)  # the step was applied while the ahead one was in flight
                gate.stepped()
                assert (gate.in_flight, gate.in_flight_current, gate.in_flight_ahead) == (2, 2, 0)
            assert (gate.in_flight, gate.in_flight_current, gate.in_flight_ahead) == (1, 1, 0)
        assert (gate.in_flight, gate.in_flight_current, gate.in_flight_ahead) == (0, 0, 0)
    asyncio.run(main())


def test_nothing_is_admitted_while_the_gate_is_closed() -> None:
    async def main() -> None:
        for close in ("stepping", "paused", "mean"):
            gate, tally, mean, _ = make_gate()
            if close == "mean":
                mean.expect(0, 1)
                mean.after_step(1)
            else:
                setattr(gate, close, True)
            admission = gate.admit(lambda: current(tally), train=True, wait=True, hold=0, round_no=None)
            waiting = asyncio.create_task(admission.__aenter__())  # `admission` kept: its exit releases
            await asyncio.sleep(0.05)
            assert not waiting.done() and gate.in_flight == 0, close
            async with gate.cond:
                if close == "mean":
                    mean.landed()
                else:
                    setattr(gate, close, False)
                gate.cond.notify_all()
            assert (await asyncio.wait_for(waiting, 2)).step == 0 and gate.in_flight == 1, close
    asyncio.run(main())


def test_a_caller_that_does_not_wait_is_refused_with_the_reason_or_held_for_a_resume() -> None:
    async def refused(gate: Gate, round_no: int | None = None, hold: float = 0.0) -> str:
        with pytest.raises(NotReady) as e:
            async with gate.admit(lambda: Slot(0), train=True, wait=False, hold=hold, round_no=round_no):
                pass
        return str(e.value)

    async def main() -> None:
        gate, _, mean, _ = make_gate(current_round=3)
        assert "before 4" in await refused(gate, round_no=4), "a request of a later round"
        gate.paused = True
        assert await refused(gate) == "between rounds"
        gate.paused = False
        mean.expect(0, 1)
        mean.after_step(1)
        assert "mean" in await refused(gate)
        mean.landed()

        gate.paused = True  # held for up to `hold` seconds: admitted when the resume comes within it
        entering = asyncio.create_task(gate.admit(lambda: Slot(0), train=True, wait=False, hold=5.0,
                                                  round_no=None).__aenter__())
        await asyncio.sleep(0.05)
        assert not entering.done()
        async with gate.cond:
            gate.paused = False
            gate.cond.notify_all()
        await asyncio.wait_for(entering, 2)

        gate.paused = True
        held = asyncio.create_task(refused(gate, hold=30.0))
        await asyncio.sleep(0.05)
        await gate.leave()  # wakes the held request: a leaving replica refuses it, not after its hold
        assert "leaving" in await asyncio.wait_for(held, 2)
        assert "leaving" in await refused(gate, hold=30.0), "and refuses what arrives at once"
    asyncio.run(main())


def test_a_dropped_commits_wake_reaches_waiting_admissions() -> None:
    async def main() -> None:
        gate, _, _, _ = make_gate()
        places = iter([None, Slot(0)])  # the quota is full until something wakes the gate
        entering = asyncio.create_task(gate.admit(lambda: next(places), train=True, wait=True, hold=0,
                                                  round_no=None).__aenter__())
        await asyncio.sleep(0.05)
        assert not entering.done()
        gate.wake()  # from a plain callback, as HeldCommits' on_drop
        await asyncio.wait_for(entering, 2)
    asyncio.run(main())


# --- the round tally ----------------------------------------------------------------------------
def test_the_tally_empties_the_step_at_a_step_and_the_round_at_a_new_round_unless_carried() -> None:
    t = RoundTally()
    t.trained(3)
    t.trained(1)
    t.losses.append(2.0)
    assert (t.accumulated, t.step_samples, t.samples) == (2, 4, 4)
    t.stepped(applied=False)
    assert (t.accumulated, t.step_samples, t.samples) == (0, 0, 4)
    assert (t.steps_total, t.inner_steps, t.skipped_steps) == (1, 1, 1)
    t.trained(2)
    t.stepped(applied=True)
    t.new_round(carry_over=True)
    assert (t.inner_steps, t.steps_total, t.samples, t.losses, t.skipped_steps) == (0, 2, 6, [2.0], 1)
    t.new_round(carry_over=False)
    assert (t.inner_steps, t.steps_total, t.samples, t.losses) == (0, 2, 0, [])


# --- an overlapped mean in flight ----------------------------------------------------------------
def test_the_gate_closes_for_a_mean_only_from_its_bound_until_it_lands_and_counts_that_time() -> None:
    mean = MeanInFlight()
    mean.expect(steps_total=5, within_steps=0)
    mean.after_step(100)
    assert not mean.awaiting, "no bound: never waited for"
    mean.expect(steps_total=5, within_steps=2)
    mean.after_step(6)
    assert not mean.awaiting
    mean.after_step(7)
    assert mean.awaiting
    time.sleep(0.02)
    mean.landed()
    assert not mean.awaiting and mean.due is None and mean.wait_total >= 0.02
    waited = mean.wait_total
    mean.landed()  # a second landing waits nothing more
    assert mean.wait_total == waited

    def move() -> None:
        pass
    mean.put(move)
    with pytest.raises(AssertionError):
        mean.put(move)
    assert mean.take() is move and mean.take() is None


# --- held commits ---------------------------------------------------------------------------------
def test_a_held_microbatch_leaves_once_by_commit_or_by_its_timeout() -> None:
    async def main() -> None:
        dropped: list[int] = []
        held = HeldCommits(0.1, lambda: dropped.append(held.uncommitted))
        grads = [torch.ones(2)]
        held.hold(("driver-aaaaaaaa", 1, 0), 3, grads, 1.5, step=0)
        held.hold(("driver-aaaaaaaa", 1, 0), 4, grads, 2.5, step=0)  # the same attempt again: replaced
        held.hold(("driver-aaaaaaaa", 2, 0), 3, grads, None, step=1)  # ran ahead: the next step's
        held.hold(("driver-aaaaaaaa", 3, 0), 3, grads, None, step=0)
        assert len(held) == 3 and held.count(0) == 2 and held.count(1) == 3
        popped = held.pop([("driver-aaaaaaaa", 1, 0), ("driver-aaaaaaaa", 9, 0)])
        assert [(k[1], h.batch, h.loss) for k, h in popped] == [(1, 4, 2.5)], "the newer hold, unknown keys skipped"
        held.record([k for k, _ in popped])
        assert held.take_committed() == ["aaaaaaaa:1"] and held.take_committed() == []
        await until(lambda: len(held) == 0, "the rest dropped after their timeout")
        assert len(held) == 0 and held.uncommitted == 2 and dropped == [1, 2], "the rest dropped, each once"
        assert held.pop([("driver-aaaaaaaa", 2, 0)]) == [], "a dropped microbatch cannot be committed"
        held.hold(("driver-aaaaaaaa", 4, 0), 3, grads, None, step=0)
        held.clear()
        await asyncio.sleep(0.15)
        assert len(held) == 0 and held.uncommitted == 2, "cleared: not dropped later"
    asyncio.run(main())


# --- the compute thread ---------------------------------------------------------------------------
def test_the_compute_thread_runs_calls_in_order_on_one_thread_and_refuses_after_close() -> None:
    async def main() -> None:
        thread = ComputeThread()
        seen: list[tuple[int, int]] = []
        await asyncio.gather(*(thread.run(lambda i=i: seen.append((i, threading.get_ident()))) for i in range(8)))
        assert [i for i, _ in seen] == list(range(8)) and len({t for _, t in seen}) == 1
        assert seen[0][1] != threading.get_ident(), "not the event loop's thread"
        thread.close()
        with pytest.raises(ProtocolError) as refused:
            await thread.run(lambda: None)
        assert refused.value.status == pb.NOT_READY
    asyncio.run(main())


def test_forward_first_runs_forwards_before_waiting_backwards_and_refuses_after_close() -> None:
    async def main() -> None:
        thread = ComputeThread(forward_first=True)
        started, release = threading.Event(), threading.Event()
        seen: list[str] = []

        def block() -> None:
            started.set()
            release.wait(5)

        running = asyncio.ensure_future(thread.run(block))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)  # the thread is busy
        calls = [asyncio.ensure_future(thread.run(seen.append, name, first=name.startswith("f")))
                 for name in ("b1", "f1", "b2", "f2")]
        await asyncio.sleep(0.05)  # all four wait
        release.set()
        await asyncio.gather(running, *calls)
        assert seen == ["f1", "f2", "b1", "b2"]
        with pytest.raises(ZeroDivisionError):  # an exception reaches its caller, the thread goes on
            await thread.run(lambda: 1 / 0)
        assert await thread.run(lambda: threading.current_thread().name) == "stage-compute"
        # close: what waits is cancelled, the call running finishes, new calls are refused
        started.clear()
        release.clear()
        running = asyncio.ensure_future(thread.run(block))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
        waiting = asyncio.ensure_future(thread.run(seen.append, "never"))
        await asyncio.sleep(0.05)
        # close while the call still runs (released only after close began), so the waiting call
        # cannot start in between: released first, a loaded machine's thread took it before close
        closing = asyncio.get_running_loop().run_in_executor(None, thread.close)
        while not thread.closed:
            await asyncio.sleep(0.01)
        release.set()
        await closing
        await running
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert "never" not in seen
        with pytest.raises(ProtocolError):
            await thread.run(lambda: None)
    asyncio.run(main())


def test_an_inner_step_counts_as_compute_but_not_in_the_rate_and_the_rate_moves_only_at_update() -> None:
    def busy() -> None:
        end = time.perf_counter() + 0.02
        while time.perf_counter() < end:
            pass

    def failing() -> None:
        busy()
        raise RuntimeError("step failed")

    thread = ComputeThread()
    thread.counted(busy)
    with pytest.raises(RuntimeError):
        thread.counted(failing)
    assert thread.compute_total >= 0.04 and thread.rate_s == 0, "steps: compute, not the rate's seconds"
    thread.timed(busy)
    thread.trained(10)
    assert thread.rate.rate == 0, "the rate moves at an update only"
    thread.update_rate()
    assert 0 < thread.rate.rate <= 10 / 0.02 and (thread.rate_s, thread.rate_samples) == (0, 0)
    before = thread.compute_total
    thread.timed(busy)  # an evaluation: seconds, no samples
    thread.update_rate()
    assert thread.compute_total > before and thread.rate.rate <= 10 / 0.02
    thread.close()


# --- the evaluation copy --------------------------------------------------------------------------
def test_the_evaluation_copy_holds_the_snapshot_refreshed_once_per_snapshot_and_leaves_the_module_alone() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    live = {n: p.detach().clone() for n, p in module.named_parameters()}
    evaluation = EvalCopy(module)
    assert evaluation.module_now() is None, "no source: the live module"
    snapshot = {n: torch.randn_like(p) for n, p in module.named_parameters()}
    evaluation.weights = lambda: snapshot
    copy = evaluation.module_now()
    assert copy is not None and copy is not module
    for name, p in copy.named_parameters():
        assert p.data_ptr() == snapshot[name].data_ptr(), "fp32 on the CPU: the snapshot's own tensors"
        assert not p.requires_grad
    assert all(torch.equal(p, live[n]) for n, p in module.named_parameters()), "the module's weights untouched"
    module[1].running_mean.fill_(7.0)
    assert evaluation.module_now() is copy and copy[1].running_mean[0] == 0, "the same snapshot: not refreshed"
    snapshot = {n: t.clone() for n, t in snapshot.items()}  # the next commit: a new snapshot
    assert evaluation.module_now() is copy and copy[1].running_mean[0] == 7.0, "buffers: the live module's"
    assert copy[0].weight.data_ptr() == snapshot["0.weight"].data_ptr()


# --- the passes -------------------------------------------------------------------------------------
def make_passes() -> StagePasses:
    torch.manual_seed(0)
    module = nn.Linear(4, 4)
    inner = InnerOptimizer(module, InnerOptConfig(microbatch_size=3), TrainingProgress(ScheduleConfig()))
    lookahead = Lookahead(module)
    return StagePasses(module, torch.device("cpu"), lambda y, t: nn.functional.mse_loss(y, t), inner, lookahead,
                       EvalCopy(module))


def test_passes_either_add_gradients_or_return_them_and_an_ahead_slot_runs_on_its_stash() -> None:
    passes = make_passes()
    x, t = torch.randn(3, 4), torch.randn(3, 4)
    loss, grads, _ = passes.forward_loss_grads(x, t, PLAIN)
    assert all(p.grad is None for p in passes.module.parameters()), "returned, added nowhere"
    passes.forward_loss(x, t, train=True)
    for p, g in zip(passes.module.parameters(), grads):
        torch.testing.assert_close(p.grad, g)
    stash = {n: torch.zeros_like(p).requires_grad_(True) for n, p in passes.module.named_parameters()}
    before = [p.grad.clone() for p in passes.module.parameters()]
    xin, y = passes.forward(x, train=True, slot=Slot(1, stash))
    assert torch.equal(y, torch.zeros_like(y)), "the stash's weights, not the live ones"
    ahead, grad_x = passes.grads(xin, y, torch.ones_like(y), Slot(1, stash))
    assert grad_x is not None and grad_x.dtype == torch.float32
    assert all(torch.equal(p.grad, b) for p, b in zip(passes.module.parameters(), before)), "the live .grad untouched"
    assert ahead[0] is not None and ahead[0].shape == (4, 4)
    with pytest.raises(NonFiniteLoss):
        passes.forward_loss(x, torch.full_like(t, float("nan")), train=True)
    assert all(torch.equal(p.grad, b) for p, b in zip(passes.module.parameters(), before)), "not trained on"
    assert loss > 0
