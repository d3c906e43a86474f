"""State sync of any size: a state fetched in parts from two donors and checked whole at the end."""
from __future__ import annotations

import asyncio

import pytest

from swarmgrad.peer.state.sync import fetch_state, plan_parts
from swarmgrad.protocol.framing import ProtocolError
from swarmgrad.protocol.validation import RunIdentity

from support.state import Donors, trained

ID = RunIdentity("run", "h" * 32)


def test_plan_parts_bounds_each_part() -> None:
    shapes = {"a": (100,), "b": (100,), "c": (1000,), "d": (10,)}
    parts = plan_parts(shapes, 8 * 210)
    assert sorted(n for p in parts for n in p) == sorted(shapes)
    assert all(sum(8 * shapes[n][0] for n in p) <= 8 * 210 or len(p) == 1 for p in parts)
    assert plan_parts(shapes, 1 << 30) == [sorted(shapes)]


def test_parts_from_two_donors_assemble_the_exact_state() -> None:
    state = trained()
    donors = Donors({"A": state.snapshot, "B": state.snapshot})
    snap = asyncio.run(fetch_state(donors, ["A", "B"], ID, 1, state.shapes, 1 << 20, 5.0, part_bytes=4096))
    assert snap.digest == state.digest and snap.trained_samples == 64 and snap.round == 2
    assert {p for p, _ in donors.asked} == {"A", "B"} and len(donors.asked) > 2  # spread over both


def test_parts_of_different_states_or_tampered_are_refused() -> None:
    a, b = trained(0), trained(1)
    with pytest.raises(ProtocolError, match="different states"):
        asyncio.run(fetch_state(Donors({"A": a.snapshot, "B": b.snapshot}), ["A", "B"], ID, 1, a.shapes, 1 << 20,
                                5.0, part_bytes=4096))
    with pytest.raises(ProtocolError, match="digest"):
        asyncio.run(fetch_state(Donors({"A": a.snapshot, "B": a.snapshot}, tamper="B"), ["A", "B"], ID, 1, a.shapes,
                                1 << 20, 5.0, part_bytes=4096))
