"""peer/net/retry.py: the one backoff rule (capped exponential, optional jitter) and the waits each
of its users get from it."""
from __future__ import annotations

import itertools
import random

import pytest

from swarmgrad.peer.net.retry import Backoff


def test_waits_grow_by_the_factor_and_stay_at_the_cap() -> None:
    b = Backoff(first=0.2, cap=1.0, growth=1.5)
    assert list(itertools.islice(b.waits(), 7)) == pytest.approx([0.2, 0.3, 0.45, 0.675, 1.0, 1.0, 1.0])
    assert [b.wait(n) for n in (1, 2, 5, 100)] == pytest.approx([0.2, 0.3, 1.0, 1.0])


def test_doubling_and_a_fixed_pace() -> None:
    assert [Backoff(5.0, 60.0).wait(n) for n in range(1, 8)] == [5.0, 10.0, 20.0, 40.0, 60.0, 60.0, 60.0]
    assert list(itertools.islice(Backoff(2.0, 2.0, growth=1.0).waits(), 3)) == [2.0, 2.0, 2.0]
    assert Backoff(first=0.5, cap=0.1).wait(1) == 0.1  # a first wait above the cap is the cap


def test_endless_failures_stay_at_the_cap() -> None:
    assert Backoff(5.0, 60.0).wait(100_000) == 60.0  # 2**99999 overflows a float: the cap, not an error


def test_jitter_only_shortens_and_spreads() -> None:
    b = Backoff(first=1.0, cap=8.0, jitter=0.5)
    rng = random.Random(0)
    for n in range(1, 8):
        plain = Backoff(1.0, 8.0).wait(n)
        drawn = [b.wait(n, rng) for _ in range(200)]
        assert all(plain * 0.5 <= w <= plain for w in drawn)
        assert max(drawn) - min(drawn) > plain * 0.3  # peers that failed together part ways
    assert list(itertools.islice(b.waits(random.Random(1)), 5)) == list(itertools.islice(b.waits(random.Random(1)), 5))


@pytest.mark.parametrize("kwargs", [dict(first=0.0, cap=1.0), dict(first=1.0, cap=0.0), dict(first=1.0, cap=1.0, growth=0.5),
                                    dict(first=1.0, cap=1.0, jitter=1.0), dict(first=1.0, cap=1.0, jitter=-0.1)])
def test_nonsense_is_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        Backoff(**kwargs)
    with pytest.raises(ValueError):
        Backoff(1.0, 1.0).wait(0)


def test_its_users_waits() -> None:
    """The rules built on it keep their waits: bans double from timeouts.ban_base to ban_max, the
    driver's NOT_READY wait grows 0.2 s x 1.5 to 1 s, DHT polls start at 20 ms."""
    from swarmgrad.peer.net.polling import poll_intervals
    from swarmgrad.peer.pipeline.driver import NOT_READY_BACKOFF
    from swarmgrad.peer.pipeline.routing import BanList
    bans = BanList(2.0, 100.0)
    assert [bans.ban("p", now=0.0) for _ in range(8)] == [2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 100.0, 100.0]
    assert list(itertools.islice(NOT_READY_BACKOFF.waits(), 6)) == pytest.approx([0.2, 0.3, 0.45, 0.675, 1.0, 1.0])
    assert list(itertools.islice(poll_intervals(0.25), 2)) == pytest.approx([0.02, 0.03])
