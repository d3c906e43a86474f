"""Waits between tries: capped exponential backoff, the one rule every retry and poll uses.

The n-th wait (n = 1, 2, ...) is `first`·`growth`^(n−1), capped at `cap`, and shortened by up to
`jitter` (a fraction) at random. Who uses it and why each shape:

- DHT polls (peer/net/polling.py): a record usually lands within a fraction of a second, so the
  first waits are short; the cap keeps a long wait from reading the DHT faster than needed.
- A driver's wait on a replica between rounds (peer/pipeline/driver.py: NOT_READY).
- Bans of peers that failed us (peer/pipeline/routing.py: `BanList`), doubling per failure.
- A start waiting for its initial peers (peer/cli/peer.py: --bootstrap-wait), at a fixed pace.
- State sync's next try (peer/state/sync.py), at a fixed pace: a join or a re-sync after busy
  donors or an unreadable record, and a joiner of an empty stage asking the coordinator again.

Jitter spreads peers that failed together so they do not try again together; a wait with no
jitter is exactly the formula, which is what tests of the rules above check.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class Backoff:
    """Capped exponential waits (seconds). `first` above `cap` means every wait is `cap`;
    `growth` 1 is a fixed pace. Raises ValueError for a cap or first wait that is not positive,
    a growth under 1, or a jitter outside [0, 1)."""
    first: float
    cap: float
    growth: float = 2.0
    jitter: float = 0.0
    """Each wait is drawn uniformly from [w·(1 − jitter), w]: never longer than the rule says."""

    def __post_init__(self) -> None:
        if not (self.cap > 0 and self.first > 0 and self.growth >= 1 and 0 <= self.jitter < 1):
            raise ValueError(f"Backoff needs cap > 0, first > 0, growth >= 1 and 0 <= jitter < 1 (got cap "
                             f"{self.cap}, first {self.first}, growth {self.growth}, jitter {self.jitter})")

    def wait(self, n: int, rng: random.Random | None = None) -> float:
        """The n-th wait (n >= 1), e.g. after the n-th failure in a row. `rng` draws the jitter
        (default: the `random` module's)."""
        if n < 1:
            raise ValueError(f"the first wait is n = 1 (got {n})")
        try:
            seconds = min(self.cap, self.first * self.growth ** (n - 1))
        except OverflowError:  # thousands of failures in a row: long past the cap
            seconds = self.cap
        if self.jitter:
            seconds *= 1.0 - self.jitter * (rng or random).random()
        return seconds

    def waits(self, rng: random.Random | None = None) -> Iterator[float]:
        """The 1st, 2nd, ... wait, for ever (the caller ends the loop)."""
        n = 0
        while True:
            n += 1
            yield self.wait(n, rng)
