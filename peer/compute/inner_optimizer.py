"""A stage replica's inner optimiser: where microbatch gradients accumulate and how an inner step
turns them into a parameter update (the mean over the step's samples, the finiteness check,
clipping, the lr the schedule gives at the swarm's position, AdamW or SwarmAdamW).

Microbatches may differ in size (inner.microbatch_sizes), so each one's gradient is weighted by
its samples: the last stage scales a microbatch's mean loss by n / inner.microbatch_size before its
backward (`weighted`), every earlier stage receives gradients already scaled so, and a step divides
the sum by the step's samples in the same unit. That is the whole step's mean gradient, and with
equal microbatches both factors are exactly 1 and 1 / microbatches: the plain mean over them.

Pure compute on tensors, called on the worker's compute thread; *when* a step may run (nothing in
flight, nothing held) is the gate's and the worker's (peer/compute/gate.py, peer/compute/worker.py).
"""
from __future__ import annotations

import torch
from torch import nn

from swarmgrad.peer.compute.lookahead import Grads
from swarmgrad.peer.manifest import InnerOptConfig
from swarmgrad.peer.compute.schedule import TrainingProgress
from swarmgrad.peer.compute.swarm_adamw import SwarmAdamW
from swarmgrad.peer.compute.precision import fused_adamw_supported


class InnerOptimizer:
    def __init__(self, module: nn.Module, inner: InnerOptConfig, progress: TrainingProgress):
        self.module = module
        self.cfg = inner
        self.progress = progress
        self.lr = inner.lr
        """The inner lr of the last step (the schedule's value at the swarm's position then)."""
        params = module.parameters()
        betas = (inner.betas[0], inner.betas[1])
        if inner.swarm_second_moment:
            self.optimizer: torch.optim.Optimizer = SwarmAdamW(params, lr=inner.lr, betas=betas,
                                                               weight_decay=inner.weight_decay)
        else:
            device = next(module.parameters(), torch.empty(0)).device
            fused = True if fused_adamw_supported(device) else None  # None: torch's default kernel
            self.optimizer = torch.optim.AdamW(params, lr=inner.lr, betas=betas, weight_decay=inner.weight_decay,
                                               fused=fused)
        self._swarm_adamw = self.optimizer if isinstance(self.optimizer, SwarmAdamW) else None
        """The optimizer when inner.swarm_second_moment: it sees each microbatch's gradients one by
        one (it measures the spread between them), not only their sum in .grad."""

    @property
    def per_microbatch(self) -> bool:
        """Whether gradients must arrive one microbatch at a time through `add` (SwarmAdamW), not
        summed into .grad by autograd."""
        return self._swarm_adamw is not None

    @property
    def moment_replicas(self) -> int | None:
        """The M of inner.swarm_second_moment's steps now (None when it is off)."""
        return None if self._swarm_adamw is None else self._swarm_adamw.replicas

    def set_replicas(self, count: int) -> None:
        """The replicas this one's steps are averaged with (inner.swarm_second_moment scales its
        noise correction by it); the round runner sets it from each round's group."""
        if self._swarm_adamw is not None:
            self._swarm_adamw.replicas = max(1, count)

    def params(self) -> list[torch.Tensor]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def weight(self, batch: int) -> float:
        """A microbatch of `batch` samples in units of a full one (inner.microbatch_size)."""
        return batch / self.cfg.microbatch_size

    def weighted(self, loss: torch.Tensor, batch: int) -> torch.Tensor:
        """The loss whose backward gives a microbatch of `batch` samples its share of a step
        (module docstring). A full microbatch's loss is returned as it is, not multiplied by 1.0:
        full microbatches then run exactly the unweighted loss's backward."""
        return loss if batch == self.cfg.microbatch_size else loss * self.weight(batch)

    def add(self, grads: list[Grads], batches: list[int]) -> None:
        """Add microbatches' parameter gradients (in `params()` order), of `batches` samples each,
        to .grad."""
        params = self.params()
        for one, batch in zip(grads, batches, strict=True):
            if self._swarm_adamw is not None:
                self._swarm_adamw.observe(one, self.weight(batch))
            into, added = [], []
            for p, g in zip(params, one):
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    into.append(p.grad)
                    added.append(g)
            if into:  # one batch of tensor ops, not one per tensor
                torch._foreach_add_(into, added)

    def step(self, microbatches: int, samples: int, step_samples: int) -> bool:
        """One step on the mean gradient of the `microbatches` accumulated ones, of `step_samples`
        samples in all, at the lr of the swarm's position plus our `samples` this round. False (and
        no step) if a gradient is not finite: one bad microbatch must not poison the stage's
        parameters and optimiser state."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if any(not bool(torch.isfinite(g).all()) for g in grads):
            self.optimizer.zero_grad(set_to_none=True)
            return False
        weight = self.weight(step_samples)
        scale = 1.0 / weight
        for g in grads:
            g.mul_(scale)  # the mean over the step's samples, as the whole model would see it
        norm = None
        if self.cfg.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.grad_clip)
        self.lr = self.cfg.lr * self.progress.multiplier(samples)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        if self._swarm_adamw is None:
            self.optimizer.step()
        else:  # the factor clip_grad_norm_ applied (read only here: float() waits for the device)
            clipped = 1.0 if norm is None else min(1.0, self.cfg.grad_clip / (float(norm) + 1e-6))
            self._swarm_adamw.step(microbatches=microbatches, weight=weight, grad_scale=clipped)
        self.optimizer.zero_grad(set_to_none=True)
        return True
