"""SwarmAdamW (inner.swarm_second_moment): AdamW when there is nothing to correct, the noise
correction's exact arithmetic, its estimate over many noisy steps, and the worker that feeds it
(no network)."""
from __future__ import annotations

import asyncio
import math

import pytest
import torch
from torch import nn

from swarmgrad.peer.clock import RoundClock
from swarmgrad.peer.manifest import InnerOptConfig, ManifestError, RoundsConfig, ScheduleConfig, from_dict
from swarmgrad.peer.compute.schedule import TrainingProgress
from swarmgrad.peer.compute.swarm_adamw import SwarmAdamW
from swarmgrad.peer.compute.worker import StageWorker

pytestmark = pytest.mark.timeout(60)


def step_with(opt: SwarmAdamW, p: torch.Tensor, microbatch_grads: list[torch.Tensor], clip: float = 1.0) -> None:
    """What the worker does: each microbatch observed and summed into .grad, then the mean, clipped."""
    for g in microbatch_grads:
        opt.observe([g])
    p.grad = clip * sum(microbatch_grads) / len(microbatch_grads)
    opt.step(microbatches=len(microbatch_grads), grad_scale=clip)
    opt.zero_grad()


@pytest.mark.parametrize("replicas,microbatches", [(1, 2), (1, 4), (2, 1), (8, 1)])
def test_is_adamw_when_one_replica_or_one_microbatch(replicas: int, microbatches: int) -> None:
    torch.manual_seed(0)
    a = torch.randn(50, requires_grad=True)
    b = a.detach().clone().requires_grad_(True)
    ours = SwarmAdamW([a], lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
    ours.replicas = replicas
    ref = torch.optim.AdamW([b], lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(20):
        grads = [torch.randn(50) for _ in range(microbatches)]
        step_with(ours, a, grads)
        b.grad = sum(grads) / len(grads)
        ref.step()
        ref.zero_grad()
    torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


def test_noise_correction_arithmetic_and_its_floor() -> None:
    # one step with β1 = β2 = 0, so the update is ḡ / √v with v the observation (or its floor)
    p = torch.zeros(3, requires_grad=True)
    opt = SwarmAdamW([p], lr=1.0, betas=(0.0, 0.0), eps=0.0)
    opt.replicas = 2
    # microbatch gradients (3, 1, 3) and (1, 1, -1): mean (2, 1, 1), Σg² (10, 2, 10)
    # noise of the mean s²/K = (Σg² − K·ḡ²) / (K(K−1)) = (1, 0, 3)
    # observed = ḡ² − (1 − 1/M)·noise = (3.5, 1, −0.5); floor ḡ²/M = (2, 0.5, 0.5)
    step_with(opt, p, [torch.tensor([3.0, 1.0, 3.0]), torch.tensor([1.0, 1.0, -1.0])])
    expected = -torch.tensor([2 / math.sqrt(3.5), 1.0, 1 / math.sqrt(0.5)])
    torch.testing.assert_close(p.detach(), expected)


def test_weighted_microbatches_noise_arithmetic() -> None:
    # microbatches of 2 and 6 samples of full ones of 4 (inner.microbatch_sizes): weights 0.5 and
    # 1.5, added to .grad as w_k g_k. g = (3, 1, 3) and (1, 1, 1): Σ w g = (3, 2, 3), W = 2, so
    # ḡ = (1.5, 1, 1.5); Σ w g² = (6, 2, 6); noise (Σ w g² − W ḡ²) / ((K − 1) W) = (0.75, 0, 0.75);
    # observed with M = 2: ḡ² − noise / 2 = (1.875, 1, 1.875), above the floor ḡ² / 2
    p = torch.zeros(3, requires_grad=True)
    opt = SwarmAdamW([p], lr=1.0, betas=(0.0, 0.0), eps=0.0)
    opt.replicas = 2
    grads = [(torch.tensor([3.0, 1.0, 3.0]), 0.5), (torch.tensor([1.0, 1.0, 1.0]), 1.5)]
    for g, w in grads:
        opt.observe([w * g], weight=w)
    p.grad = sum(w * g for g, w in grads) / 2.0
    opt.step(microbatches=2, weight=2.0)
    expected = -torch.tensor([1.5 / math.sqrt(1.875), 1.0, 1.5 / math.sqrt(1.875)])
    torch.testing.assert_close(p.detach(), expected)


def test_second_moment_estimates_the_swarm_batch_from_unequal_microbatches() -> None:
    # weights 0.25, 0.75 and 1 (W = 2): a microbatch of weight w has noise s² / w, the replica's
    # weighted mean s² / W, the M = 2 swarm's batch s² / (2W): the moment should find μ² + s²/4
    torch.manual_seed(4)
    mu, s, n, weights = 0.5, 2.0, 4000, (0.25, 0.75, 1.0)
    p = torch.zeros(200, requires_grad=True)
    opt = SwarmAdamW([p], lr=0.0, betas=(0.9, 0.999))
    opt.replicas = 2
    for _ in range(n):
        grads = [(mu + s / math.sqrt(w) * torch.randn(200), w) for w in weights]
        for g, w in grads:
            opt.observe([w * g], weight=w)
        p.grad = sum(w * g for g, w in grads) / sum(weights)
        opt.step(microbatches=len(weights), weight=sum(weights))
        opt.zero_grad()
    state = opt.state[p]
    bias = 1 - 0.999 ** n
    assert float(state["exp_avg_sq"].mean()) / bias == pytest.approx(mu * mu + s * s / 4, rel=0.05)
    assert float(state["exp_avg_sq_plain"].mean()) / bias == pytest.approx(mu * mu + s * s / 2, rel=0.05)


def test_more_replicas_remove_more_noise() -> None:
    def update(replicas: int) -> float:
        p = torch.zeros(1, requires_grad=True)
        opt = SwarmAdamW([p], lr=1.0, betas=(0.0, 0.0), eps=0.0)
        opt.replicas = replicas
        step_with(opt, p, [torch.tensor([3.0]), torch.tensor([1.0])])  # ḡ 2, noise 1
        return -float(p.detach())
    # 4 − (1 − 1/M): M = 2 → 3.5, M = 4 → 3.25
    assert update(2) == pytest.approx(2 / math.sqrt(3.5))
    assert update(4) == pytest.approx(2 / math.sqrt(3.25))
    assert update(1) == pytest.approx(1.0)


def test_clipping_scales_the_observed_squares_like_the_gradient() -> None:
    # Adam's step does not depend on a constant gradient scale: clipped (with grad_scale told)
    # and unclipped steps move the parameter alike
    def run(clip: float) -> torch.Tensor:
        torch.manual_seed(1)
        p = torch.zeros(20, requires_grad=True)
        opt = SwarmAdamW([p], lr=0.1, betas=(0.0, 0.0), eps=0.0)
        opt.replicas = 3
        step_with(opt, p, [torch.randn(20) + 1.0 for _ in range(3)], clip=clip)
        return p.detach()
    torch.testing.assert_close(run(0.01), run(1.0))


def test_second_moment_estimates_the_swarm_batch() -> None:
    # gradients μ + ε per microbatch, Var ε = s²: a replica's mean of K = 2 has E[ḡ²] = μ² + s²/2;
    # the M = 2 swarm's batch has μ² + s²/4, which the moment should find, where AdamW's finds the former
    torch.manual_seed(2)
    mu, s, n = 0.5, 2.0, 4000
    p = torch.zeros(200, requires_grad=True)
    opt = SwarmAdamW([p], lr=0.0, betas=(0.9, 0.999))
    opt.replicas = 2
    for _ in range(n):
        step_with(opt, p, [mu + s * torch.randn(200) for _ in range(2)])
    state = opt.state[p]
    bias = 1 - 0.999 ** n
    swarm = float(state["exp_avg_sq"].mean()) / bias
    plain = float(state["exp_avg_sq_plain"].mean()) / bias
    assert swarm == pytest.approx(mu * mu + s * s / 4, rel=0.05)
    assert plain == pytest.approx(mu * mu + s * s / 2, rel=0.05)


def test_zero_grad_forgets_the_observed_microbatches() -> None:
    p = torch.zeros(1, requires_grad=True)
    opt = SwarmAdamW([p], lr=1.0, betas=(0.0, 0.0), eps=0.0)
    opt.replicas = 2
    opt.observe([torch.tensor([100.0])])  # a skipped step's microbatch
    opt.zero_grad()
    step_with(opt, p, [torch.tensor([3.0]), torch.tensor([1.0])])
    assert -float(p.detach()) == pytest.approx(2 / math.sqrt(3.5))


def test_manifest_needs_two_microbatches_per_step() -> None:
    base = {"run_id": "t", "stages": {"count": 1}}
    with pytest.raises(ManifestError, match="inner.swarm_second_moment"):
        from_dict({**base, "inner": {"swarm_second_moment": True, "microbatches_per_step": 1}})
    assert from_dict({**base, "inner": {"swarm_second_moment": True, "microbatches_per_step": 2}}
                     ).inner.swarm_second_moment


def make_worker(swarm: bool) -> StageWorker:
    torch.manual_seed(0)
    clock = RoundClock(RoundsConfig(inner_steps=0, round_seconds=10.0), counts_steps=True, max_rounds=0, epoch=None)
    inner = InnerOptConfig(lr=0.05, microbatches_per_step=2, swarm_second_moment=swarm)
    return StageWorker(nn.Linear(4, 4), inner, torch.device("cpu"), lambda y, t: nn.functional.mse_loss(y, t),
                       clock, TrainingProgress(ScheduleConfig()))


def train(w: StageWorker, steps: int, path: str = "loss") -> torch.Tensor:
    async def main() -> None:
        torch.manual_seed(3)
        for _ in range(steps):
            for _ in range(2):
                x, t = torch.randn(5, 4), torch.randn(5, 4)
                async with w.admitted(wait=False):
                    if path == "loss":  # the last stage's (and a whole-model driver's) path
                        await w.forward_loss(x, t)
                    else:  # a first stage's: forward, then the gradient that came back
                        x_used, y = await w.forward(x)
                        await w.backward(x_used, y, 2 * (y.detach() - t) / y.numel(), x.shape[0])
            assert await w.maybe_step()
    asyncio.run(main())
    w.close()
    return torch.cat([p.detach().flatten() for p in w.module.parameters()])


@pytest.mark.parametrize("path", ["loss", "backward"])
def test_worker_with_one_replica_trains_as_adamw_and_with_two_steps_further(path: str) -> None:
    plain = train(make_worker(False), 10, path)
    alone = make_worker(True)
    alone.set_replicas(1)
    torch.testing.assert_close(train(alone, 10, path), plain, rtol=1e-5, atol=1e-6)
    paired = make_worker(True)
    paired.set_replicas(2)
    start = torch.cat([p.detach().flatten() for p in make_worker(False).module.parameters()])
    moved = train(paired, 10, path)
    assert not torch.allclose(moved, plain)
    # the noise-corrected steps are longer (never more than √2 × AdamW's one step at a time)
    assert float((moved - start).norm()) > float((plain - start).norm())
