"""Learning-rate schedules over the samples the whole swarm has trained.

A schedule's position is not a peer's local step count: a late joiner, a slow replica and a
fast one must all use the same learning rate for the same point of the run, and a swarm of 2
or 20 drivers must follow the same curve per sample. The position is therefore

    trained_samples (agreed: the sum of every complete round's total weight, identical on every
                     replica of a stage because each round's total comes from the reducers and
                     is checked to be equal on all parts)
  + this round's local samples × share⁻¹ (an estimate: our share of the stage's work in the
                     last complete round; corrected at the next boundary)

so every replica's lr agrees exactly at round boundaries and stays close within a round. With
overlapped rounds (peer/rounds/overlap.py) the samples of a round whose averaging is still in flight
are not agreed yet either: they count like this round's own (`pending`), until the mean lands.
"""
from __future__ import annotations

import math

from swarmgrad.peer.manifest import ScheduleConfig


def lr_multiplier(cfg: ScheduleConfig, samples: float) -> float:
    """The factor applied to the peak lr after `samples` samples of the whole swarm.

    Linear warmup from 0 over `warmup_samples`; then `constant` stays at 1, `cosine` and `linear`
    decay to `min_lr_ratio` at `total_samples` and stay there.
    """
    samples = max(0.0, float(samples))
    if cfg.warmup_samples > 0 and samples < cfg.warmup_samples:
        # (samples + 1): the very first step is not taken at lr 0, which would waste it
        return min(1.0, (samples + 1.0) / cfg.warmup_samples)
    if cfg.kind == "constant":
        return 1.0
    span = max(1.0, float(cfg.total_samples - cfg.warmup_samples))
    progress = min(1.0, (samples - cfg.warmup_samples) / span)
    floor = cfg.min_lr_ratio
    if cfg.kind == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (1.0 - floor) * (1.0 - progress)  # linear


class TrainingProgress:
    """Where this replica stands in the run, in samples of the whole swarm.

    `trained` is set only from agreed values (a complete round's total weight, a donor's
    state); `share` is this replica's fraction of its stage's samples in the last complete
    round, used to extrapolate within the current round.
    """

    def __init__(self, cfg: ScheduleConfig, trained: int = 0, share: float = 1.0):
        self.cfg = cfg
        self.trained = int(trained)
        self.share = share
        self.pending = 0
        """Our samples of rounds whose averaging is in flight (overlapped rounds; else 0)."""

    def position(self, local_samples: int) -> float:
        """Samples of the whole swarm so far, given ours since the round started."""
        return self.trained + (self.pending + local_samples) / max(self.share, 1e-3)

    def multiplier(self, local_samples: int = 0) -> float:
        return lr_multiplier(self.cfg, self.position(local_samples))

    def round_multiplier(self) -> float:
        """The factor at the last boundary: identical on every replica (used for the outer lr)."""
        return lr_multiplier(self.cfg, self.trained)

    def completed_round(self, total_weight: float, own_weight: float) -> None:
        """A complete round: everyone adds the same total; our share is re-estimated."""
        self.trained += int(round(total_weight))
        self.pending = 0
        if total_weight > 0:
            self.share = min(1.0, max(1e-3, own_weight / total_weight))

    def adopt(self, trained: int) -> None:
        """A downloaded state's agreed position; our own unaveraged work was dropped with θ_local."""
        self.trained = int(trained)
        self.pending = 0

    def expect_group(self, size: int) -> None:
        """Before any round completed: assume an even share over `size` replicas."""
        self.share = 1.0 / max(1, size)
