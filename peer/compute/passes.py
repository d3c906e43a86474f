"""A stage's forward and backward passes: pure tensor code, run on the compute thread
(peer/compute/thread.py). The counts, the gate and the held commits are the worker's
(peer/compute/worker.py); where gradients accumulate and how a step uses them is the inner
optimiser's (peer/compute/inner_optimizer.py)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from swarmgrad.peer.compute.evaluation import EvalCopy
from swarmgrad.peer.compute.inner_optimizer import InnerOptimizer
from swarmgrad.peer.compute.lookahead import PLAIN, Grads, Lookahead, Slot, grads_wrt
from swarmgrad.peer.compute.precision import Precision

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class NonFiniteLoss(Exception):
    """The last stage computed a non-finite loss; the microbatch was not trained on."""


class StagePasses:
    """Forward, backward and loss over the stage's module, on the compute thread only.

    Invariants:
    - A pass's parameter gradients either join the accumulation (`backward`, `forward_loss`:
      into .grad, or the inner optimiser's per-microbatch sums) or are returned and added nowhere
      (`grads`, `forward_loss_grads`: the worker holds them for a commit or for the next step).
    - A slot admitted ahead runs against its stash (peer/compute/lookahead.py), never the live
      parameters; its gradients are always returned, never added here.
    - An evaluation (train=False) runs on the evaluation copy when there is one (peer/compute/evaluation.py).
    - A non-finite training loss raises NonFiniteLoss before anything is computed from it.
    - Gradients w.r.t. the stage input come back on the CPU in fp32 (None at stage 0).
    - Forwards run under the precision's autocast (peer/compute/precision.py); the parameters and
      their gradients stay fp32 whatever it computes in.
    """

    def __init__(self, module: nn.Module, device: torch.device, loss_fn: LossFn | None,
                 inner: InnerOptimizer, lookahead: Lookahead, evaluation: EvalCopy,
                 precision: Precision | None = None):
        self.module = module
        self.precision = precision or Precision(device)
        self.device = device
        self.loss_fn = loss_fn
        """The last stage's loss (None on the other stages)."""
        self.inner = inner
        self.lookahead = lookahead
        self.evaluation = evaluation

    def forward(self, x: torch.Tensor, train: bool, slot: Slot = PLAIN) -> tuple[torch.Tensor, torch.Tensor]:
        """(input as used, output). With train, both keep the graph for a backward."""
        x = x.to(self.device)
        if x.is_floating_point() and train:
            x.requires_grad_(True)
        with torch.set_grad_enabled(train), self.precision.autocast():
            if slot.stash is not None:
                return x, self.lookahead.forward(slot.stash, x)
            if not train and (evaluated := self.evaluation.module_now()) is not None:
                return x, evaluated(x)
            return x, self.module(x)

    def backward(self, x: torch.Tensor, y: torch.Tensor, grad_y: torch.Tensor) -> torch.Tensor | None:
        """Live parameters: their gradients join the accumulation; returns the input's."""
        if self.inner.per_microbatch:
            grads, grad_x = self.grads(x, y, grad_y, PLAIN)
            self.inner.add([grads], [x.shape[0]])
            return grad_x
        y.backward(grad_y.to(y.device, y.dtype))
        return None if x.grad is None else x.grad.detach().to("cpu", torch.float32)

    def grads(self, x: torch.Tensor, y: torch.Tensor, grad_y: torch.Tensor, slot: Slot
              ) -> tuple[Grads, torch.Tensor | None]:
        """(parameter gradients, the input's), added nowhere; w.r.t. the slot's stash if it ran ahead."""
        return self._grads_of(y, x, grad_y.to(y.device, y.dtype), slot)

    def forward_loss(self, x: torch.Tensor, targets: torch.Tensor, train: bool) -> tuple[float, torch.Tensor | None]:
        """Last stage: (loss, the input's gradient). With train, the parameter gradients join the
        accumulation."""
        x, loss = self._loss(x, targets, train)
        if not train:
            return loss.item(), None
        if self.inner.per_microbatch:
            grads, grad_x = self._grads_of(self.inner.weighted(loss, x.shape[0]), x, None, PLAIN)
            self.inner.add([grads], [x.shape[0]])
            return loss.detach().item(), grad_x
        self.inner.weighted(loss, x.shape[0]).backward()
        return loss.detach().item(), (None if x.grad is None else x.grad.detach().to("cpu", torch.float32))

    def forward_loss_grads(self, x: torch.Tensor, targets: torch.Tensor, slot: Slot
                           ) -> tuple[float, Grads, torch.Tensor | None]:
        """Last stage, training: (loss, parameter gradients added nowhere, the input's gradient)."""
        x, loss = self._loss(x, targets, True, slot)
        grads, grad_x = self._grads_of(self.inner.weighted(loss, x.shape[0]), x, None, slot)
        return loss.detach().item(), grads, grad_x

    def _grads_of(self, out: torch.Tensor, x: torch.Tensor, grad_out: torch.Tensor | None, slot: Slot
                  ) -> tuple[Grads, torch.Tensor | None]:
        params = self.inner.params() if slot.stash is None else self.lookahead.leaves(slot.stash)
        return grads_wrt(out, params, x, grad_out)

    def _loss(self, x: torch.Tensor, targets: torch.Tensor, train: bool, slot: Slot = PLAIN
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(input as used, loss); a non-finite training loss raises NonFiniteLoss (not trained on)."""
        assert self.loss_fn is not None
        x, y = self.forward(x, train, slot)
        loss = self.loss_fn(y.float(), targets.to(self.device))  # the loss in fp32 whatever the logits' dtype
        if train and not torch.isfinite(loss):
            raise NonFiniteLoss(f"non-finite loss {loss.item()}: not trained on")
        return x, loss
