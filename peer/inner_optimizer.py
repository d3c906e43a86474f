"""A stage replica's inner optimiser: where microbatch gradients accumulate and how an inner step
turns them into a parameter update (the mean over the step's microbatches, the finiteness check,
clipping, the lr the schedule gives at the swarm's position, AdamW or SwarmAdamW).

Pure compute on tensors, called on the worker's compute thread; the gate that decides *when* a
step may run (nothing in flight, nothing held) stays in peer/worker.py.
"""
from __future__ import annotations

import torch
from torch import nn

from swarmgrad.peer.lookahead import Grads
from swarmgrad.peer.manifest import InnerOptConfig
from swarmgrad.peer.schedule import TrainingProgress
from swarmgrad.peer.swarm_adamw import SwarmAdamW


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
            self.optimizer = torch.optim.AdamW(params, lr=inner.lr, betas=betas, weight_decay=inner.weight_decay)
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

    def add(self, grads: list[Grads]) -> None:
        """Add microbatches' parameter gradients (in `params()` order) to .grad."""
        params = self.params()
        for one in grads:
            if self._swarm_adamw is not None:
                self._swarm_adamw.observe(one)
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

    def step(self, microbatches: int, samples: int) -> bool:
        """One step on the mean of the `microbatches` accumulated gradients, at the lr of the swarm's
        position plus our `samples` this round. False (and no step) if a gradient is not finite: one
        bad microbatch must not poison the stage's parameters and optimiser state."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if any(not bool(torch.isfinite(g).all()) for g in grads):
            self.optimizer.zero_grad(set_to_none=True)
            return False
        scale = 1.0 / microbatches
        for g in grads:
            g.mul_(scale)  # the mean over microbatches, as the whole model would see it
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
            self._swarm_adamw.step(microbatches=microbatches, grad_scale=clipped)
        self.optimizer.zero_grad(set_to_none=True)
        return True
