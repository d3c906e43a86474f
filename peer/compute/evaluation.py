"""The module copy evaluations run on: a stage's committed θ_global rather than θ_local."""
from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn

Weights = dict[str, torch.Tensor]


class EvalCopy:
    """A copy of the stage's module that holds the weights `weights()` returns, for forwards with
    train=False.

    The replica points `weights` at θ_global's committed snapshot, so a validation loss scores the
    model the stage group agreed on at its last round boundary on every stage, not θ_local part-way
    through inner steps, which other drivers' microbatches keep moving while an evaluation passes
    through.

    Invariants:
    - The live module's parameters are never touched: a copy rather than `functional_call` on the
      module, which swaps the module's own parameters for the call's duration while the event loop
      reads them (a lookahead stash).
    - The copy is refreshed once per snapshot (`module_now` compares the snapshot's identity: a
      snapshot's tensors are never changed in place). Its parameters are the snapshot's; its
      buffers (a BatchNorm's statistics, which θ_global does not hold) the live module's.
    - Where the module is fp32 on the CPU the copy's parameters are the snapshot's own tensors, so
      it costs no memory; elsewhere one copy on the module's device (placement counts it:
      peer/placement/cost.py).
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self.weights: Callable[[], Weights | None] | None = None
        """Where evaluations take their weights. None (or returning None): the live module's."""
        self._copy: nn.Module | None = None
        self._source: Weights | None = None

    def module_now(self) -> nn.Module | None:
        """The copy holding the current snapshot, or None for the live module (compute thread)."""
        source = self.weights() if self.weights is not None else None
        if source is None:
            return None
        if self._copy is None:
            self._copy = copy.deepcopy(self.module).requires_grad_(False)
            for p in self._copy.parameters():
                p.grad = None
        if self._source is not source:
            with torch.no_grad():
                for name, p in self._copy.named_parameters():
                    t = source[name]
                    if t.device == p.device and t.dtype == p.dtype:
                        p.data = t
                    else:
                        p.copy_(t)
                live = dict(self.module.named_buffers())
                for name, b in self._copy.named_buffers():
                    b.copy_(live[name])
            self._source = source
        return self._copy
