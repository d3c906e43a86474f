"""Replicas that start the next inner step before this one is applied (`pipeline.lookahead`):
PipeDream-2BW's double-buffered weights.

Without it every inner step drains its pipeline: the step needs the gradients of all its
microbatches, so after the last request of a step the driver's uplink waits for that
microbatch's answer, its backward and the step before the next step's first request can leave.
Over a slow link that fill and drain is a large share of the time (docs/measurements.md, "Does the pipeline
fill its link?"). And a later stage that has answered its step's quota waits for the driver's
commits before it steps, so the next step's requests queue there while its downlink is idle.
With lookahead, once a step's quota of microbatches is taken a replica admits up to a quota of
the next step's: they run forward against a stash, a copy of the weights as they are now (the
step about to be applied does not change it), and their gradients are computed against the
stash and go into the next step (on a stage ≥ 1, once their driver commits them). So a step's
first gradients may be one step stale, the staleness 2BW bounds to one, on every stage.

A driver admits no microbatch ahead when this step ends its round; a later stage ends its round
when a microbatch of the next round arrives, and its pause first steps what ran ahead. So
averaging still sees every replica at rest. A stash costs one copy of the stage's parameters
while any microbatch that ran against it is in flight.

Measured (docs/measurements.md, "Lookahead across inner steps"): over 20 Mbit the reference pipeline trains
1.17-1.19x the samples/s, but at its learning rate one step of staleness costs +20 % val
bits/byte at equal samples with half the microbatches ahead: off by default, experimental. It
is here so that the trade can be measured on other models (benchmarks/pipeline_link.py,
benchmarks/lookahead_quality.py, benchmarks/wan.py's swarmgrad-pipe-la).

`pipeline.stale_correction` (peer/compute/staleness.py) may move each new stash to where the
ahead microbatches should run (`extrapolate`: along Adam's momentum, or to the predicted weights)
or compensate their gradients as they join their step; `none` keeps the stash as copied.

Pure tensor code: the gate owns the counts in flight (peer/compute/gate.py), the worker ties them
together (peer/compute/worker.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.func import functional_call

Grads = list[torch.Tensor | None]


@dataclass(frozen=True, eq=False)  # compared by identity: a stash is tensors
class Slot:
    """A microbatch's place in flight: the inner step its gradient goes into, and the weights it
    runs against (None: the live parameters; else a stash of them, a step older than that)."""
    step: int
    """The worker's `steps_total` when the gradient joins the accumulation: the current step, or
    the next one for a microbatch admitted ahead."""
    stash: dict[str, torch.Tensor] | None = None
    position: int = 0
    """How many microbatches of its step had a place when it was admitted: its index in the step
    (inner.microbatch_sizes gives a driver the size of the batch it then draws)."""

    @property
    def ahead(self) -> bool:
        return self.stash is not None


def grads_wrt(out: torch.Tensor, params: list[torch.Tensor], x: torch.Tensor, grad_out: torch.Tensor | None
              ) -> tuple[Grads, torch.Tensor | None]:
    """Gradients of `out` w.r.t. `params` (live parameters or a stash's leaves) and w.r.t. the
    input `x` (None unless it requires grad, else on the CPU in fp32), without adding them to .grad."""
    wrt = params + ([x] if x.requires_grad else [])
    grads = torch.autograd.grad(out, wrt, grad_outputs=grad_out, allow_unused=True)
    grad_x = grads[len(params)] if x.requires_grad else None
    return [None if g is None else g.detach() for g in grads[:len(params)]], \
        (None if grad_x is None else grad_x.detach().to("cpu", torch.float32))


PLAIN = Slot(step=-1)
"""The slot of an evaluation (and of a caller that passes none): live parameters."""


class Lookahead:
    """The stash the next step's microbatches run against, and their finished gradients until the
    current step is applied."""

    def __init__(self, module: nn.Module, extrapolate: Callable[[list[torch.Tensor]], None] | None = None):
        """`extrapolate`: moves a fresh stash's trainable tensors in place, where the ahead
        microbatches should run instead (pipeline.stale_correction, peer/compute/staleness.py)."""
        self.module = module
        self.extrapolate = extrapolate
        # the Parameter objects themselves: `forward` (functional_call, on the compute thread)
        # swaps the module's attributes for the stash's tensors while it runs, and `stash` runs on
        # the event loop meanwhile, so reading them through the module could copy a stash
        self._params = dict(module.named_parameters())
        self._names = [n for n, p in self._params.items() if p.requires_grad]
        self._stash: tuple[int, dict[str, torch.Tensor]] | None = None
        self._held: list[tuple[Grads, int, dict[str, torch.Tensor]]] = []

    def stash(self, step: int) -> dict[str, torch.Tensor]:
        """The weights microbatches of inner step `step` run against, copied once per step (call
        only while the parameters cannot change: the worker's gate is open and no step runs)."""
        if self._stash is None or self._stash[0] != step:
            with torch.no_grad():
                copy = {n: p.detach().clone() for n, p in self._params.items()}
                if self.extrapolate is not None:
                    self.extrapolate([copy[n] for n in self._names])
            for n, p in self._params.items():
                copy[n].requires_grad_(p.requires_grad)
            self._stash = (step, copy)
        return self._stash[1]

    def leaves(self, stash: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The stash's trainable tensors, in the order of the module's trainable parameters."""
        return [stash[n] for n in self._names]

    def forward(self, stash: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.module, stash, (x,))

    def hold(self, grads: Grads, batch: int, stash: dict[str, torch.Tensor]) -> None:
        """A microbatch of the next step, run against `stash`, finished before this step was applied."""
        self._held.append((grads, batch, stash))

    @property
    def held(self) -> int:
        return len(self._held)

    def take(self) -> list[tuple[Grads, int, dict[str, torch.Tensor]]]:
        """At the step: the held gradients (they join the next step) and the stash is let go
        (microbatches still in flight keep their own reference to it)."""
        held, self._held, self._stash = self._held, [], None
        return held
