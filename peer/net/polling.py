"""The DHT poll policy: intervals that start short and grow to a cap (a `retry.Backoff`).

A member waiting on another member's DHT record (its round registration, its outcome vote) is
usually waiting on something that lands within a fraction of a second, and the round's critical
path runs through that wait: a fixed interval of the cap's length makes the last member to finish
its exchange wait most of an interval for a vote posted just after its own. Short first intervals
catch that; the cap keeps a long wait (a straggler, a dead member) from reading the DHT faster
than once per cap. (Measured: docs/measurements.md, "Notes moved from the code".)
"""
from __future__ import annotations

from typing import Iterator

from swarmgrad.peer.net.retry import Backoff

FIRST_POLL_SECONDS = 0.02
POLL_GROWTH = 1.5


def poll_intervals(cap: float, first: float = FIRST_POLL_SECONDS, growth: float = POLL_GROWTH) -> Iterator[float]:
    """first, first·growth, … up to `cap`, then `cap` for ever. Raises ValueError for cap or
    first <= 0 or growth < 1."""
    return Backoff(first=first, cap=cap, growth=growth).waits()
