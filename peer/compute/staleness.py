"""Corrections of the one-step-stale gradients that `pipeline.lookahead` produces
(`pipeline.stale_correction`; peer/compute/lookahead.py says where staleness comes from).

Notation, per trainable tensor of a stage. Inner step t is about to be applied: its quota of
microbatches is taken and draining, the weights are w_t, the inner optimiser (AdamW) holds its
moments m, v after k = t steps, its decoupled weight decay wd, betas (β₁, β₂), ε, and the lr of
the last step η. A microbatch of step t + 1 admitted now (ahead) runs against a stash s and its
gradient g = ∇f(s) joins step t + 1, which is applied at w_{t+1} = w_t + Δ_t. Without a
correction s = w_t: g is one step stale. Adam's bias-corrected direction now is

    d = (m / (1 − β₁ᵏ)) / (√(v / (1 − β₂ᵏ)) + ε)        (d = 0 before the first step)

and σ is `pipeline.stale_correction_scale` (default 1: one step, the delay lookahead bounds).

- ``none``: s = w_t (PipeDream-2BW's stash as it is).
- ``nesterov``: the stash is extrapolated along Adam's momentum, s = w_t − σ·η·β₁·d. Step t's
  update is −η·(β₁·m + (1 − β₁)·g_t)/(…) − η·wd·w_t: its momentum part β₁·m is known before g_t
  arrives, so the stale gradient is evaluated at the look-ahead point NAG (and NAdam, Dozat 2016)
  evaluates its gradient at, and the delay acts as Nesterov's look-ahead (Ajanthan et al., ICML
  2025, "Nesterov method for asynchronous pipeline parallel optimization"; their reference code
  reaches the same point through NAdamW on stashed weights with β₁ = 0.99).
- ``predict``: weight prediction (SpecTrain; PipeMare's discrepancy correction): the stash is
  the weights predicted for the step the gradient lands in, assuming the coming gradient
  continues Adam's moments (m, v unchanged): s = w_t − σ·η·(d + wd·w_t), the whole predicted update.
- ``delay_comp``: delay compensation (DC-ASGD, Zheng et al. 2017): the gradient, not the stash,
  is corrected when it joins step t + 1, by the diagonal of the outer-product Hessian estimate:
  g' = g + λ·g⊙g⊙(w_{t+1} − s), λ = σ. A microbatch of weight ω (inner.microbatch_sizes) carries
  ω·ĝ, so g' = g + λ·g⊙g⊙(w_{t+1} − s)/ω: exactly DC-ASGD's formula for its mean gradient ĝ.

Under inner.swarm_second_moment the same d is used with SwarmAdamW's moments (its own denominator
also takes the noise-corrected maximum; the prediction is then an approximation). The worker
applies `extrapolate` to each new stash (on the event loop, while no step can run) and
`compensate` where an ahead gradient joins the accumulation (on the compute thread, after the
step before its own: the live weights are then w_{t+1}). Pure tensor code.

Measured (docs/measurements.md, "Correcting the stale gradients"): in one process on the reference
task with half of every step's microbatches ahead, lookahead's cost at equal samples was +16.1 / +16.5 %
(two seeds) without a correction, +9.4 / +11.7 % with `nesterov`, +11.3 / +8.1 % with `predict`:
neither reaches 1 %, so the default is `none`.
`delay_comp`'s term is ~10⁻⁵ of the gradient there at λ = 1.
"""
from __future__ import annotations

from typing import Callable

import torch

from swarmgrad.peer.compute.lookahead import Grads


class StaleCorrection:
    """`pipeline.stale_correction` for one stage replica: `kind`, `scale` (σ above), over the
    trainable parameters `params` (in the optimiser's order) and `optimizer` (its state and
    hyperparameters are read, never written)."""

    def __init__(self, kind: str, scale: float, params: list[torch.Tensor], optimizer: torch.optim.Optimizer,
                 lr: Callable[[], float]):
        self.kind = kind
        self.scale = scale
        self._params = params
        self._optimizer = optimizer
        self._lr = lr
        """The lr of the last inner step (InnerOptimizer.lr): the next one's is the schedule's at a
        position not known yet, and differs from it by one step of the schedule."""

    @property
    def moves_stash(self) -> bool:
        return self.kind in ("nesterov", "predict")

    @property
    def compensates(self) -> bool:
        return self.kind == "delay_comp"

    def direction(self) -> list[torch.Tensor | None]:
        """d for each parameter (None before its first step)."""
        group = self._optimizer.param_groups[0]
        (b1, b2), eps = group["betas"], group["eps"]
        out: list[torch.Tensor | None] = []
        for p in self._params:
            state = self._optimizer.state.get(p)
            k = 0 if not state else float(state["step"])
            if k == 0:
                out.append(None)
                continue
            denom = (state["exp_avg_sq"] / (1.0 - b2 ** k)).sqrt_().add_(eps)
            out.append(state["exp_avg"] / (1.0 - b1 ** k) / denom)
        return out

    def extrapolate(self, stash: list[torch.Tensor]) -> None:
        """Move a fresh stash's trainable tensors (a copy of `params`, same order) in place to the
        point the module docstring gives for `kind` (no-op for none and delay_comp)."""
        if not self.moves_stash:
            return
        group = self._optimizer.param_groups[0]
        b1, wd = group["betas"][0], group["weight_decay"]
        step = self.scale * self._lr()
        with torch.no_grad():
            for s, d in zip(stash, self.direction(), strict=True):
                if d is None:
                    continue
                if self.kind == "nesterov":
                    s.sub_(d, alpha=step * b1)
                else:  # predict: the whole predicted update, weight decay included
                    s.mul_(1.0 - step * wd).sub_(d, alpha=step)

    def compensate(self, grads: Grads, stash: list[torch.Tensor], weight: float) -> Grads:
        """delay_comp: g + λ·g⊙g⊙(w_now − s)/ω for a microbatch of weight ω whose gradients
        `grads` were computed against `stash`, with the live `params` as w_now (other kinds:
        `grads` as they are)."""
        if not self.compensates or self.scale == 0:
            return grads
        lam = self.scale / weight
        out: Grads = []
        with torch.no_grad():
            for g, s, p in zip(grads, stash, self._params, strict=True):
                out.append(None if g is None else g + lam * g * g * (p.detach() - s.detach()))
        return out
