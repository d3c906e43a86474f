"""The reducer's aggregate, pure: weighted mean for small groups, centered clipping from 3 members."""
from __future__ import annotations

import torch

from swarmgrad.peer.averaging.aggregate import RADIUS_FACTOR, cap_weights, centered_clip, reduce_part, weighted_mean


def honest(n: int, seed: int = 0, size: int = 4096) -> list[dict[str, torch.Tensor]]:
    """Pseudo-gradients of replicas of one stage: a shared direction plus each replica's noise."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(size, generator=g)
    return [{"w": common + 0.3 * torch.randn(size, generator=g), "b": torch.randn(8, generator=g)} for _ in range(n)]


def mean_of(members: list[tuple[float, dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    return {n: weighted_mean([(w, m[n]) for w, m in members]) for n in members[0][1]}


def dist(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return sum(float((a[n] - b[n]).double().pow(2).sum()) for n in a) ** 0.5


def test_small_groups_use_the_exact_weighted_mean() -> None:
    members = [(3.0, m) for m in honest(2)]
    out = reduce_part(members, robust_min_members=3, max_weight_ratio=8.0)
    ref = mean_of(members)
    for n in ref:
        assert torch.equal(out[n], ref[n])


def test_clean_round_equals_the_weighted_mean() -> None:
    members = [(w, m) for w, m in zip([10.0, 12.0, 9.0, 11.0], honest(4))]
    out = reduce_part(members, robust_min_members=3, max_weight_ratio=8.0)
    ref = mean_of(members)
    for n in ref:
        assert torch.allclose(out[n], ref[n], atol=1e-5), "honest members must not be clipped"


def test_one_bad_member_moves_the_result_by_a_bounded_amount() -> None:
    good = honest(3, seed=1)
    clean = mean_of([(1.0, m) for m in good])
    for bad in ({n: 100 * t for n, t in good[0].items()},                     # scaled x100
                {n: 50 * torch.randn_like(t) for n, t in good[0].items()},    # random, large
                {n: torch.full_like(t, 1e6) for n, t in good[0].items()}):    # absurd
        members = [(1.0, m) for m in good] + [(1.0, bad)]
        plain = mean_of(members)
        robust = reduce_part(members, robust_min_members=3, max_weight_ratio=8.0)
        spread = max(dist(m, clean) for m in good)
        # the bad member's pull is at most its weight share times the clipping radius
        assert dist(robust, clean) <= 0.25 * RADIUS_FACTOR * 2 * spread + 1e-3
        assert dist(robust, clean) < dist(plain, clean) / 10


def test_claimed_weight_is_capped() -> None:
    assert cap_weights([1.0, 1.0, 1.0, 1000.0], 8.0) == [1.0, 1.0, 1.0, 8.0]
    assert cap_weights([1.0, 1000.0], 8.0) == [1.0, 1000.0]  # two members: no median to trust
    good = honest(3, seed=2)
    bad = {n: 10 * t for n, t in good[0].items()}
    members = [(1.0, m) for m in good] + [(10**9, bad)]
    out = reduce_part(members, robust_min_members=3, max_weight_ratio=8.0)
    assert all(torch.isfinite(t).all() for t in out.values())
    assert dist(out, mean_of([(1.0, m) for m in good])) < dist(bad, mean_of([(1.0, m) for m in good]))


def test_robust_path_can_be_switched_off_and_is_deterministic() -> None:
    members = [(1.0, m) for m in honest(4, seed=3)]
    off = reduce_part(members, robust_min_members=0, max_weight_ratio=8.0)
    ref = mean_of(members)
    assert all(torch.equal(off[n], ref[n]) for n in ref)
    a, b = centered_clip(members), centered_clip([(w, {n: t.clone() for n, t in m.items()}) for w, m in members])
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_byzantine_testing_aid_corrupts_as_documented() -> None:
    from swarmgrad.peer.rounds.runner import corrupt
    torch.manual_seed(0)
    delta = {"w": torch.randn(64, 64) * 0.01, "b": torch.zeros(8)}
    scaled = corrupt(delta, "scale", round_no=3)
    assert torch.equal(scaled["w"], delta["w"] * 100.0)
    noise = corrupt(delta, "random", round_no=3)
    rms = float(delta["w"].pow(2).mean().sqrt())
    assert noise["w"].shape == delta["w"].shape and 7 * rms < float(noise["w"].pow(2).mean().sqrt()) < 13 * rms
    assert torch.equal(noise["w"], corrupt(delta, "random", round_no=3)["w"])  # seeded by the round
    assert not torch.equal(noise["w"], corrupt(delta, "random", round_no=4)["w"])


def test_a_scaled_honest_update_weighs_like_an_honest_one() -> None:
    """x 100 of an honest pseudo-gradient points the right way: clipping alone would let it add up to
    its share of the radius along that direction; the norm cap leaves it one honest member's pull."""
    from swarmgrad.peer.averaging.aggregate import NORM_FACTOR, cap_norms
    good = honest(3, seed=4)
    clean = mean_of([(1.0, m) for m in good])
    scaled = {n: 100 * t for n, t in good[0].items()}
    robust = reduce_part([(1.0, m) for m in good] + [(1.0, scaled)], robust_min_members=3, max_weight_ratio=8.0)
    as_if_honest = mean_of([(1.0, m) for m in good] + [(1.0, {n: NORM_FACTOR * t for n, t in good[0].items()})])
    assert dist(robust, clean) <= 1.05 * dist(as_if_honest, clean)
    # a member that trained on twice the median samples may send a proportionally larger update
    norm = dist(good[0], {n: torch.zeros_like(t) for n, t in good[0].items()})
    capped = cap_norms([(1.0, good[1]), (1.0, good[2]), (2.0, {n: 2 * t for n, t in good[0].items()})], ["b", "w"])
    assert abs(dist(capped[2][1], {n: torch.zeros_like(t) for n, t in good[0].items()}) - 2 * norm) < 1e-3
