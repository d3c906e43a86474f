"""benchmarks/overlap.py's pure parts: which [rounds] fields a mode sets, and the time a run's
scored points first reach a target (the swarm runs themselves need namespaces and minutes)."""
from __future__ import annotations

import math

import pytest

from benchmarks import overlap as bench


def test_modes_name_the_rounds_fields() -> None:
    assert bench.parse_mode("off") == {"overlap": False}
    assert bench.parse_mode("on") == {"overlap": True}
    assert bench.parse_mode("on:1") == {"overlap": True, "overlap_steps": 1}
    for bad in ("on:0", "on:", "on:x", "off:1", "eager", "on:-1"):
        with pytest.raises(ValueError, match="on:N"):
            bench.parse_mode(bad)


def test_time_to_interpolates_the_first_crossing() -> None:
    points = [(0.0, 0, 8.0), (10.0, 100, 4.0), (20.0, 200, 2.0), (30.0, 300, 2.9)]
    assert bench.time_to(points, 3.0) == pytest.approx(15.0)
    assert bench.time_to(points, 4.0) == 10.0
    assert math.isnan(bench.time_to(points, 1.0))
    assert math.isnan(bench.time_to([], 3.0))
