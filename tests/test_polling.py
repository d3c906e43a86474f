"""peer/net/polling.py: poll intervals start short (a record usually lands within a fraction of a
second) and never poll faster than the cap once a wait is long."""
from __future__ import annotations

import itertools

import pytest

from swarmgrad.peer.net.polling import poll_intervals


def test_intervals_grow_from_the_first_to_the_cap_and_stay() -> None:
    got = list(itertools.islice(poll_intervals(0.25, first=0.02, growth=1.5), 12))
    assert got[0] == 0.02
    assert all(b >= a for a, b in zip(got, got[1:]))
    assert max(got) == 0.25 and got[-3:] == [0.25] * 3
    # within the first 0.3 s of a wait more than the old fixed interval's single read
    elapsed = list(itertools.accumulate(got))
    assert sum(1 for t in elapsed if t <= 0.3) >= 5


def test_a_first_interval_above_the_cap_is_the_cap() -> None:
    assert list(itertools.islice(poll_intervals(0.1, first=0.5), 3)) == [0.1, 0.1, 0.1]


@pytest.mark.parametrize("cap,first,growth", [(0.0, 0.02, 1.5), (0.2, 0.0, 1.5), (0.2, 0.02, 0.5)])
def test_nonsense_is_refused(cap: float, first: float, growth: float) -> None:
    with pytest.raises(ValueError):
        next(poll_intervals(cap, first, growth))
