"""Poll intervals that start short and grow to a cap.

A member waiting on another member's DHT record (its round registration, its outcome vote) is
usually waiting on something that lands within a fraction of a second, and the round's critical
path runs through that wait: with a fixed 0.2-0.25 s interval the last member to finish its
exchange waited 0.3-0.45 s for a vote posted ~0.1 s after its own (benchmarks/wan.py, 20 Mbit,
`vote_s` in round events). Short first intervals catch that; the cap keeps a long wait (a
straggler, a dead member) from reading the DHT faster than the fixed interval did.
"""
from __future__ import annotations

from typing import Iterator

FIRST_POLL_SECONDS = 0.02
POLL_GROWTH = 1.5


def poll_intervals(cap: float, first: float = FIRST_POLL_SECONDS, growth: float = POLL_GROWTH) -> Iterator[float]:
    """first, first·growth, … up to `cap`, then `cap` for ever."""
    if cap <= 0 or first <= 0 or growth < 1:
        raise ValueError(f"poll_intervals needs cap > 0, first > 0, growth >= 1 (got {cap}, {first}, {growth})")
    delay = min(first, cap)
    while True:
        yield delay
        delay = min(cap, delay * growth)
