"""pipeline.stale_correction (peer/compute/staleness.py) in the stage worker, in-process: on a
quadratic, the updates a worker with lookahead takes equal the ones computed by hand from each
correction's formula (the stash moved along Adam's momentum, or to the predicted weights; the
stale gradient compensated by DC-ASGD's term), on both paths an ahead gradient takes into its step
(held until the step before it, or added after it). No network."""
from __future__ import annotations

import asyncio

import pytest
import torch
from torch import nn

from swarmgrad.peer.clock import RoundClock
from swarmgrad.peer.compute.schedule import TrainingProgress
from swarmgrad.peer.compute.staleness import StaleCorrection
from swarmgrad.peer.compute.worker import StageWorker
from swarmgrad.peer.manifest import InnerOptConfig, RoundsConfig, ScheduleConfig

pytestmark = pytest.mark.timeout(60)

LR, BETAS, EPS, WD = 0.05, (0.9, 0.95), 1e-8, 0.1
QUOTA = 2


def make_worker(kind: str, scale: float) -> StageWorker:
    clock = RoundClock(RoundsConfig(inner_steps=0, round_seconds=10.0), counts_steps=True, max_rounds=0, epoch=None)
    module = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        module.weight.copy_(torch.tensor([[0.5, -1.0, 0.25, 2.0]]))
    inner = InnerOptConfig(lr=LR, betas=BETAS, weight_decay=WD, grad_clip=0.0, microbatch_size=3,
                           microbatches_per_step=QUOTA)
    return StageWorker(module, inner, torch.device("cpu"), None, clock, TrainingProgress(ScheduleConfig()),
                       stale_correction=(kind, scale))


def data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(3, 4, generator=g), torch.randn(3, 1, generator=g)) for _ in range(n)]


def quadratic_grad(w: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """∇ of Σ (x·w − t)² / n at w, by hand: A w − b with A = 2 xᵀx / n, b = 2 xᵀt / n (what the
    worker's backward computes from the later stage's dL/dy = 2 (y − t) / n)."""
    n = t.numel()
    return (2 / n) * (x.T @ x) @ w - (2 / n) * x.T @ t[:, 0]


def adamw(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, k: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step k (1-based) of AdamW by hand: (w', m', v')."""
    m = BETAS[0] * m + (1 - BETAS[0]) * g
    v = BETAS[1] * v + (1 - BETAS[1]) * g * g
    w = w * (1 - LR * WD) - LR * (m / (1 - BETAS[0] ** k)) / ((v / (1 - BETAS[1] ** k)).sqrt() + EPS)
    return w, m, v


def expected(kind: str, scale: float, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The weights after 3 steps: step 0 exact at w0; step 1's microbatches ran ahead against w0
    (no moments yet: nothing to extrapolate); step 2's against w1, moved by the correction."""
    w0 = torch.tensor([0.5, -1.0, 0.25, 2.0])
    zero = torch.zeros(4)
    g0 = (quadratic_grad(w0, *batches[0]) + quadratic_grad(w0, *batches[1])) / 2
    w1, m1, v1 = adamw(w0, g0, zero, zero, 1)

    def joined(g: torch.Tensor, stash: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        return g + scale * g * g * (live - stash) if kind == "delay_comp" else g

    g1 = sum(joined(quadratic_grad(w0, *b), w0, w1) for b in batches[2:4]) / 2
    w2, m2, v2 = adamw(w1, g1, m1, v1, 2)
    d = (m1 / (1 - BETAS[0])) / ((v1 / (1 - BETAS[1])).sqrt() + EPS)  # Adam's direction after step 1
    stash = {"none": w1, "delay_comp": w1,
             "nesterov": w1 - scale * LR * BETAS[0] * d,
             "predict": w1 * (1 - scale * LR * WD) - scale * LR * d}[kind]
    g2 = sum(joined(quadratic_grad(stash, *b), stash, w2) for b in batches[4:6]) / 2
    w3, _, _ = adamw(w2, g2, m2, v2, 3)
    return w3


async def through(w: StageWorker, slot, x: torch.Tensor, t: torch.Tensor):  # type: ignore[no-untyped-def]
    """The forward against the slot's weights; returns the backward to run later."""
    xin, y = await w.forward(x, slot=slot)
    grad_y = 2 * (y.detach() - t) / t.numel()
    return lambda: w.backward(xin, y, grad_y, x.shape[0], slot=slot)


@pytest.mark.parametrize("kind, scale", [("none", 1.0), ("nesterov", 1.0), ("predict", 1.0), ("predict", 2.0),
                                         ("delay_comp", 4.0)])
def test_the_corrected_updates_match_the_formula_on_a_quadratic(kind: str, scale: float) -> None:
    async def main() -> None:
        w = make_worker(kind, scale)
        b = data(6)
        gates = [w.admitted(wait=True, ahead=True) for _ in range(4)]
        slots = [await g.__aenter__() for g in gates]
        assert [s.step for s in slots] == [0, 0, 1, 1]
        backwards = [await through(w, s, *b[i]) for i, s in enumerate(slots)]
        for i in (0, 1, 2):  # the third ran ahead: held until step 0 is applied
            await backwards[i]()
            await gates[i].__aexit__(None, None, None)
        assert w.lookahead.held == 1
        assert await w.maybe_step() and w.steps_total == 1
        # step 1 is short of the fourth (in flight): the next step's two are let in ahead, against
        # a stash of w1 that the correction moved
        later = [w.admitted(wait=True, ahead=True) for _ in range(2)]
        more = [await g.__aenter__() for g in later]
        assert [s.step for s in more] == [2, 2] and all(s.ahead for s in more)
        ahead = [await through(w, s, *b[4 + i]) for i, s in enumerate(more)]
        await backwards[3]()  # added after step 0 was applied: compensated now
        await gates[3].__aexit__(None, None, None)
        await ahead[0]()  # held, then compensated as step 1's promotion adds it
        await later[0].__aexit__(None, None, None)
        assert await w.maybe_step() and w.steps_total == 2
        await ahead[1]()  # step 1 applied meanwhile: straight into step 2
        await later[1].__aexit__(None, None, None)
        assert await w.maybe_step() and w.steps_total == 3 and w.tally.accumulated == 0
        torch.testing.assert_close(w.module.weight.detach()[0], expected(kind, scale, b), rtol=1e-6, atol=1e-7)
        w.close()
    asyncio.run(main())


def test_compensation_weights_a_partial_microbatch_as_its_mean_gradient() -> None:
    """A microbatch of weight ω carries ω·ĝ: the term is ω·λ·ĝ⊙ĝ⊙δ, DC-ASGD's for its mean gradient."""
    p = torch.tensor([1.0, 2.0, 3.0])
    fix = StaleCorrection("delay_comp", 3.0, [p], torch.optim.AdamW([torch.zeros(1, requires_grad=True)]), lambda: 0.1)
    mean, stash, omega = torch.tensor([0.5, -1.0, 2.0]), torch.tensor([1.5, 2.0, 2.0]), 0.25
    [got] = fix.compensate([omega * mean], [stash], omega)
    torch.testing.assert_close(got, omega * (mean + 3.0 * mean * mean * (p - stash)))
    assert fix.compensate([None], [stash], 1.0) == [None]


def test_no_correction_and_no_moments_leave_the_stash_as_copied() -> None:
    p = nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = torch.optim.AdamW([p], lr=0.1)
    stash = [p.detach().clone()]
    StaleCorrection("predict", 1.0, [p], opt, lambda: 0.1).extrapolate(stash)  # before any step: d = 0
    assert torch.equal(stash[0], p.detach())
    p.grad = torch.tensor([1.0, 1.0])
    opt.step()
    for kind in ("none", "delay_comp"):
        StaleCorrection(kind, 1.0, [p], opt, lambda: 0.1).extrapolate(stash)
        assert torch.equal(stash[0], torch.tensor([1.0, -2.0]))


@pytest.mark.timeout(120)
def test_four_peers_with_a_correction_train_every_microbatch_once_and_stay_identical(inprocess) -> None:
    """2 stages × 2 replicas, real peers in one event loop (tests/support/swarm.py), lookahead with
    the stash extrapolated along Adam's momentum on every stage: microbatches run ahead, every
    complete round leaves both replicas of a stage with one digest, every microbatch is committed
    once at stage 1 and none is left uncommitted, and the loss falls."""
    from support.swarm import InProcessSwarm, assert_replicas_agree, complete_rounds, step_manifest
    m = step_manifest(4, pipeline={"lookahead": True, "stale_correction": "nesterov"}, inner={"microbatches_per_step": 2})

    async def scenario() -> None:
        async with InProcessSwarm(m) as swarm:
            await swarm.run_two_by_two(max_rounds=5, timeout=60)
            drivers = [p for p in swarm.peers if p.stage == 0]
            assert any(r["ahead_share"] > 0 for p in drivers for r in p.events("pipeline")), swarm.history()
            for stage in (0, 1):
                assert_replicas_agree(swarm.peers, stage)
                full = [r for r, events in complete_rounds(swarm.peers, stage).items()
                        if len(events) == 2 and all(e["group_size"] == 2 for e in events)]
                assert len(full) >= 2, f"stage {stage}: too few rounds of both replicas: {full}\n" + swarm.history()
            for peer in (p for p in swarm.peers if p.stage == 1):
                rounds = peer.events("round")
                committed = [c for e in rounds for c in e["committed"]]
                assert committed and len(committed) == len(set(committed)), f"{peer.name}: a microbatch trained twice"
                assert rounds[-1]["uncommitted"] == 0, swarm.history()
            evals = sorted((e for p in drivers for e in p.events("eval") if e["val_loss"] is not None),
                           key=lambda e: e["time"])
            assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.5, evals

    inprocess(scenario)


def test_swarm_adamw_moments_give_the_direction_too() -> None:
    """inner.swarm_second_moment: the same d from SwarmAdamW's exp_avg and exp_avg_sq."""
    from swarmgrad.peer.compute.swarm_adamw import SwarmAdamW
    p = nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = SwarmAdamW([p], lr=0.1, betas=(0.9, 0.95), weight_decay=0.1)
    p.grad = torch.tensor([0.5, -0.25])
    opt.observe([p.grad])
    opt.step()
    state = opt.state[p]
    stash = [p.detach().clone()]
    StaleCorrection("nesterov", 1.0, [p], opt, lambda: 0.1).extrapolate(stash)
    d = (state["exp_avg"] / 0.1) / ((state["exp_avg_sq"] / 0.05).sqrt() + 1e-8)
    torch.testing.assert_close(stash[0], p.detach() - 0.1 * 0.9 * d)
