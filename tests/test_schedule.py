"""Learning-rate schedules over the swarm's samples, pure (no network)."""
from __future__ import annotations

import math

import pytest

from swarmgrad.peer.manifest import ManifestError, ScheduleConfig, from_dict
from swarmgrad.peer.compute.schedule import TrainingProgress, lr_multiplier

REFERENCE = ScheduleConfig(kind="cosine", warmup_samples=3200, total_samples=32000, min_lr_ratio=0.1)


def test_reference_cosine_values() -> None:
    f = lambda s: lr_multiplier(REFERENCE, s)  # noqa: E731
    assert f(0) == pytest.approx(1 / 3200)
    assert f(1599) == pytest.approx(0.5)
    assert f(3200) == pytest.approx(1.0)
    # halfway through the decay: the midpoint between peak and floor
    assert f(3200 + 14400) == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(32000) == pytest.approx(0.1)
    assert f(10**9) == pytest.approx(0.1)  # stays at the floor past total_samples
    values = [f(s) for s in range(3200, 32001, 800)]
    assert all(a >= b for a, b in zip(values, values[1:])), "cosine decay must not increase"


def test_linear_and_constant() -> None:
    lin = ScheduleConfig(kind="linear", warmup_samples=0, total_samples=1000, min_lr_ratio=0.0)
    assert lr_multiplier(lin, 0) == 1.0
    assert lr_multiplier(lin, 250) == pytest.approx(0.75)
    assert lr_multiplier(lin, 1000) == 0.0
    const = ScheduleConfig(kind="constant", warmup_samples=100)
    assert lr_multiplier(const, 49) == pytest.approx(0.5)
    assert lr_multiplier(const, 100) == lr_multiplier(const, 10**7) == 1.0
    assert lr_multiplier(ScheduleConfig(), 0) == 1.0  # the default changes nothing


def test_negative_or_nan_free() -> None:
    for s in (-5, 0, 1e12):
        v = lr_multiplier(REFERENCE, s)
        assert math.isfinite(v) and 0 < v <= 1


def test_swarm_of_2_and_20_drivers_follow_one_curve_per_sample() -> None:
    """The position is the swarm's samples: 2 replicas with 32 samples each and 20 with 3.2 each
    are at the same point after a round."""
    two, twenty = TrainingProgress(REFERENCE), TrainingProgress(REFERENCE)
    two.expect_group(2)
    twenty.expect_group(20)
    # within the first round, each extrapolates its own samples by its share
    assert two.position(32) == pytest.approx(64) and twenty.position(3.2) == pytest.approx(64)
    two.completed_round(total_weight=64, own_weight=32)
    twenty.completed_round(total_weight=64, own_weight=3)
    assert two.trained == twenty.trained == 64
    assert two.round_multiplier() == twenty.round_multiplier()


def test_late_joiner_uses_the_same_lr() -> None:
    veteran = TrainingProgress(REFERENCE)
    for _ in range(10):
        veteran.completed_round(total_weight=640, own_weight=320)
    joiner = TrainingProgress(REFERENCE, trained=veteran.trained)  # what state sync hands it
    joiner.expect_group(2)
    assert joiner.multiplier(0) == veteran.multiplier(0)
    assert joiner.multiplier(100) == pytest.approx(veteran.multiplier(100))


def test_unequal_share_is_learned_from_the_last_round() -> None:
    slow = TrainingProgress(REFERENCE)
    slow.completed_round(total_weight=400, own_weight=100)
    assert slow.share == pytest.approx(0.25)
    assert slow.position(50) == pytest.approx(400 + 200)


@pytest.mark.parametrize("section, field", [
    ({"kind": "step"}, "schedule.kind"),
    ({"kind": "cosine", "total_samples": 0}, "schedule.total_samples"),
    ({"kind": "cosine", "warmup_samples": 100, "total_samples": 50}, "schedule.total_samples"),
    ({"min_lr_ratio": 1.5}, "schedule.min_lr_ratio"),
    ({"warmup_samples": -1}, "schedule"),
])
def test_bad_schedules_name_the_field(section: dict, field: str) -> None:
    with pytest.raises(ManifestError, match=field.replace(".", r"\.")):
        from_dict({"run_id": "x", "schedule": section})
