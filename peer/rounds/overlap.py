"""Averaging overlapped with compute (`[rounds] overlap = true`): the worker trains round r + 1
while round r's pseudo-gradient is averaged, and the outer step lands one round late.

At the boundary of round r the runner takes Δ_r = θ_global − θ_local, keeps θ_local as the
*anchor*, and resumes training at once from θ_local (not from θ_global: nothing new has
arrived). When the mean of Δ_r arrives, every replica applies θ_global ← OuterOpt(θ_global,
mean Δ_r), as in a plain round, and moves θ_local to

    θ_global_new + (θ_local_now − anchor)

i.e. onto the new global point, keeping the progress it made since the snapshot. The next
pseudo-gradient Δ_{r+1} = θ_global_new − θ_local is then exactly the work of round r + 1, each
sample counted once. The move happens right after an inner step (nothing in flight, nothing held,
no gradient accumulated: `StageWorker.rebase`), or at the next boundary if no step comes
first; a boundary always waits for the previous round's mean, so at most one round is in flight
and the error-feedback residuals are used by one encode at a time.

Which variant, and why. Kale et al. 2025 ("Eager updates for overlapped communication and
computation in DiLoCo") compare a naive one-outer-step-delayed update, in which the next inner
phase starts from a global point that lacks the last round's work (its own included), with
"eager" updates, in which each replica's outer step mixes its own fresh pseudo-gradient with the
others' delayed ones. Eager updates recover most of what the delay costs, but each replica's outer step
then differs, so replicas no longer hold one bit-identical θ_global, which everything here relies
on (the group is the holders of one digest; joiners, re-syncs and backups take any replica's
state; the outer momentum is part of the digest). Streaming DiLoCo (Douillard et al. 2025)
overlaps the exchange of a fragment with τ inner steps and merges the arriving global fragment
with the local one. What we do is the delayed outer step of the first kind, applied identically
on every replica, with the merge made so that the local work of the overlapped steps is kept
whole rather than mixed in (the eager update's purpose, reached through θ_local instead of
through the outer optimiser): θ_global stays bit-identical, and the only delay is that round
r's outer step (and the other replicas' work in it) reaches θ_local during round r + 1 rather
than at its start. Resuming instead from the outer step of an eager estimate (our Δ at our
share, the last mean for the others'), which keeps θ_global one, was measured and lost more per
sample than resuming from θ_local: at a few steps per round a replica's own point is nearer the
coming mean than the estimate is (docs/measurements.md, "Overlapped averaging"). What the delay
costs is set by how many steps run before the mean lands, so `rounds.overlap_steps` bounds them
as Streaming DiLoCo's τ does: after that many steps the worker waits for the mean
(`StageWorker.expect_mean`; the move then opens its gate). Fragments (streaming) are not used:
the whole-model exchange of a small model is one message per part anyway, and one delayed round
already hides it.

What stays exact: a boundary with no inner step between the snapshot and the mean's arrival
(a fast link, or a replica that got no work) copies θ_global_new into the module, exactly what
a plain round does, so such rounds equal plain rounds bit for bit. The last round of a bounded
run and a round after which the replica moves away are plain rounds (nothing trains after them).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn


@dataclass
class RoundReport:
    """What a round's event says, gathered at its boundary (the averaging fills the rest)."""
    samples: int
    losses: list[float]
    steps: int
    lr: float
    lr_start: float
    boundary: float
    """time.monotonic() when the boundary began (averaging_s counts from it)."""
    round_s: float
    utilisation: float
    avg_sent0: int
    avg_recv0: int
    overlapped: bool = False
    mean_wait0: float = 0.0
    """The worker's mean_wait_total when the round's mean went in flight."""
    mean_wait_s: float = 0.0
    """How long the worker's gate stayed closed for this round's mean (rounds.overlap_steps)."""


@dataclass
class InFlight:
    """An overlapped round whose averaging runs in the background while the next one trains."""
    round: int
    weight: float
    """Our samples in it (with those carried from a round that applied nothing)."""
    anchor: dict[str, torch.Tensor]
    """θ_local (fp32, CPU) at the boundary; turned in place into the shift once the mean lands."""
    steps_at_snapshot: int
    report: RoundReport
    task: asyncio.Task | None = field(default=None, repr=False)


def snapshot_local(module: nn.Module) -> dict[str, torch.Tensor]:
    """θ_local as fp32 CPU copies (the anchor)."""
    return {n: p.detach().to("cpu", torch.float32).clone() for n, p in module.named_parameters()}


def into_shift(anchor: dict[str, torch.Tensor], new_global: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """θ_global_new − anchor, computed in the anchor's own tensors (no extra copy of the model)."""
    for name, a in anchor.items():
        a.neg_().add_(new_global[name].detach())
    return anchor


def rebase(module: nn.Module, shift: dict[str, torch.Tensor], new_global: dict[str, torch.Tensor],
           moved: bool) -> None:
    """Move θ_local onto the new global point keeping its progress since the snapshot
    (θ_local += θ_global_new − anchor). With `moved` False (no inner step since the snapshot,
    so θ_local is the anchor) copy θ_global_new instead: the plain round's result, bit for bit."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if moved:
                p.add_(shift[name].to(p.device, p.dtype))
            else:
                p.copy_(new_global[name].detach().to(p.device, p.dtype))


def rebase_fn(module: nn.Module, shift: dict[str, torch.Tensor], new_global: dict[str, torch.Tensor],
              steps_at_snapshot: int, steps_now: Callable[[], int]) -> Callable[[], None]:
    """The closure the worker runs at its next step (or the runner at the boundary)."""
    def run() -> None:
        rebase(module, shift, new_global, moved=steps_now() != steps_at_snapshot)
    return run


def is_last_round(*, leaving: bool, max_rounds: int, rounds_done: int) -> bool:
    """Must this round be a plain (waited-for) one? When the replica leaves after it, or when it
    may be the run's last counted round: nothing would train on while its mean travels, and the
    final θ_global (and the drivers' final evaluation of θ_local) must include it."""
    return leaving or (max_rounds > 0 and rounds_done + 1 >= max_rounds)
