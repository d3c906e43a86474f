"""AdamW whose second moment is estimated for the swarm's batch, not this replica's.

M replicas that each take AdamW steps on their own batch of b samples and average their
parameters train as if at a lower lr than data-parallel training on the M·b batch: each replica
normalises by its own gradient's square, E[g²] = μ² + σ²/b, where data parallelism normalises by
μ² + σ²/(M·b). Wherever noise dominates a coordinate the averaged step is up to √M shorter
(on the reference task: 2.5 % worse bits/byte than DDP even when averaging after every step).

The replica cannot see the other replicas' gradients between rounds, but it can measure its own
gradient noise: the spread between the K microbatches of a step (sample variance s²) says that
the step's mean gradient carries noise s²/K, of which averaging with M−1 others removes a share
(1 − 1/M). So the observation fed to the second moment is

    ĝ² = ḡ² − (1 − 1/M) · s² / K          (unbiased for the M·b batch's E[g²])

One step's ĝ² is noisy and may be negative; the moment is an EMA of it, and the step divides by
max(v̂, r̂ / M), where r̂ is the EMA of the plain ḡ²: the M·b batch's E[g²] is never below
E[ḡ²] / M, so no coordinate's step grows more than √M times AdamW's.
With M = 1 or K = 1 it is AdamW exactly (up to float rounding).

Microbatches of different sizes (inner.microbatch_sizes) arrive weighted by their samples in
units of a full microbatch (w_k = n_k / microbatch_size: the caller scaled their losses so) and
ḡ is their weighted mean, Σ w_k g_k / W with W = Σ w_k. Then Σ w_k (g_k − ḡ)² / (K − 1) estimates
the noise of one full microbatch, so the mean's noise is

    s²/K  →  (Σ w_k g_k² − W ḡ²) / ((K − 1) · W)

which is the formula above when every w_k is 1 (W = K).
"""
from __future__ import annotations

from typing import Iterable

import torch


class SwarmAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with the swarm-batch second moment described above.

    The caller adds every microbatch's gradients to `.grad` and passes them to `observe`; before
    `step` it turns `.grad` into the mean over microbatches and clips it by `grad_scale`."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.replicas = 1
        """M: the replicas this one's steps are averaged with (the last round's group)."""
        self._squares: dict[torch.Tensor, torch.Tensor] = {}
        """Σ over this step's microbatches of w_k g_k² (module docstring) for each parameter."""

    @torch.no_grad()
    def observe(self, grads: Iterable[torch.Tensor | None], weight: float = 1.0) -> None:
        """One microbatch's gradients (parameter order of the groups; None for an unused one), as
        added to .grad: w_k g_k for a microbatch of `weight` w_k full ones."""
        params = [p for g in self.param_groups for p in g["params"]]
        first, first_g, more, more_g = [], [], [], []
        for p, g in zip(params, grads):
            if g is None:
                continue
            if p in self._squares:
                more.append(self._squares[p])
                more_g.append(g)
            else:
                first.append(p)
                first_g.append(g.float())
        # batched tensor ops, as torch.optim's foreach implementations: the same arithmetic per
        # element; on the reference model no faster measurably (docs/measurements.md, "On a faster machine")
        if first_g:
            squares = torch._foreach_mul(first_g, first_g)
            if weight != 1.0:
                torch._foreach_div_(squares, weight)
            self._squares.update(zip(first, squares))
        if more:
            torch._foreach_addcmul_(more, more_g, more_g, value=1.0 / weight)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self._squares.clear()

    @torch.no_grad()
    def step(self, closure: None = None, *, microbatches: int = 1, weight: float | None = None,  # type: ignore[override]
             grad_scale: float = 1.0) -> None:
        """One step on `.grad` (the weighted mean over `microbatches` whose weights sum to `weight`,
        None: as many as there are microbatches; already multiplied by `grad_scale`, the clipping
        factor: the observed squares were not)."""
        if closure is not None:
            raise ValueError("SwarmAdamW takes no closure")
        m = max(1, int(self.replicas))
        share = (1.0 - 1.0 / m) if microbatches >= 2 else 0.0
        for group in self.param_groups:
            by_step: dict[int, list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                    state["exp_avg_sq_plain"] = torch.zeros_like(p)
                state["step"] += 1
                by_step.setdefault(state["step"], []).append(p)
            for t, params in by_step.items():  # one batch per step count: normally all of them
                self._update(group, params, t, m, share, microbatches,
                             float(microbatches) if weight is None else weight, grad_scale)

    def _update(self, group: dict, params: list[torch.Tensor], t: int, m: int, share: float, microbatches: int,
                weight: float, grad_scale: float) -> None:
        """The step of the module docstring for `params`, whose step count is `t`, as batched tensor
        ops (the same elementwise arithmetic, in the same order, as one tensor at a time)."""
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        grads = [p.grad for p in params]
        states = [self.state[p] for p in params]
        exp_avg = [s["exp_avg"] for s in states]
        exp_avg_sq = [s["exp_avg_sq"] for s in states]
        exp_avg_sq_plain = [s["exp_avg_sq_plain"] for s in states]
        plain = torch._foreach_mul(grads, grads)
        observed = list(plain)
        corrected = [i for i, p in enumerate(params) if p in self._squares] if share > 0 else []
        if corrected:
            # s²/K of the unclipped mean, from Σ w_k g_k² and the mean itself; then clipped like ḡ
            mean_sq = torch._foreach_div([plain[i] for i in corrected], grad_scale * grad_scale)
            torch._foreach_mul_(mean_sq, weight)
            noise = torch._foreach_sub([self._squares[params[i]] for i in corrected], mean_sq)
            torch._foreach_clamp_min_(noise, 0)
            torch._foreach_div_(noise, (microbatches - 1) * weight)
            torch._foreach_mul_(noise, share * grad_scale * grad_scale)
            for i, value in zip(corrected, torch._foreach_sub([plain[i] for i in corrected], noise)):
                observed[i] = value
        torch._foreach_mul_(params, 1.0 - lr * wd)
        torch._foreach_mul_(exp_avg, b1)
        torch._foreach_add_(exp_avg, grads, alpha=1.0 - b1)
        torch._foreach_mul_(exp_avg_sq, b2)
        torch._foreach_add_(exp_avg_sq, observed, alpha=1.0 - b2)
        torch._foreach_mul_(exp_avg_sq_plain, b2)
        torch._foreach_add_(exp_avg_sq_plain, plain, alpha=1.0 - b2)
        denom = torch._foreach_maximum(exp_avg_sq, torch._foreach_div(exp_avg_sq_plain, m))
        torch._foreach_div_(denom, 1.0 - b2 ** t)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, exp_avg, denom, value=-lr / (1.0 - b1 ** t))
