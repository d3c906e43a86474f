"""The rate a replica announces: forward+backward samples per second of its compute."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RateMeter:
    """Exponential moving average of events per second, for announced throughput."""
    alpha: float = 0.2
    rate: float = 0.0

    def update(self, events: int, seconds: float) -> float:
        if seconds > 0 and events > 0:
            sample = events / seconds
            self.rate = sample if self.rate == 0 else (1 - self.alpha) * self.rate + self.alpha * sample
        return self.rate
