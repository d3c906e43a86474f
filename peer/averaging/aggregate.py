"""How a reducer combines the members' pseudo-gradients for its part: pure tensor code.

With one or two members the plain weighted mean is all there is (with two, neither can be told
from the other). With three or more, one bad member (a bug, a diverged replica, an attacker)
must only be able to move the result by a bounded amount, so the reducer uses **centered
clipping** (Karimireddy, He & Jaggi, "Learning from History for Byzantine Robust Optimization",
ICML 2021) around the coordinate-wise median:

    xᵢ ← xᵢ · min(1, 1.25 · max(1, wᵢ / w_med) · M / ‖xᵢ‖)      (norm cap, M = median ‖xᵢ‖)
    c   = coordinate-wise median of the contributions            (robust center)
    τ   = 2 × the median over members of ‖xᵢ − c‖                (robust radius)
    out = c + Σ wᵢ · clip(xᵢ − c, τ) / Σ wᵢ,   clip(v, τ) = v · min(1, τ / ‖v‖)

The norm cap comes first because centered clipping alone lets a member that sends its honest
pseudo-gradient × 100 add up to wᵢ/Σw · τ *along the honest direction*: an outer step made larger
than anyone trained for (measured in benchmarks/byzantine.py: +5.9 % val bits/byte with 1 of 4
members at × 100, clipping alone). Capped at 1.25 × the median norm (more for a member that
trained on more samples than the median, as a faster peer does in a wall-clock round), such a
member weighs like an honest one. Honest pseudo-gradients of one round have alike norms, so a
clean round is left unchanged.

Why this one: a coordinate-wise trimmed mean throws away most of every honest member's values
with few members (with 3, it keeps one per coordinate), and Krum-style selection keeps one
member; centered clipping leaves honest contributions (whose distances from the center are
alike, so all within twice the median distance) untouched, so a clean round equals the weighted
mean up to rounding, while a member sending ×100 or random
values moves the result by at most wᵢ/Σw · τ. Weights are self-declared sample counts, so they
are capped too: by what the member registered for the round (checked when its part arrives) and
at `max_weight_ratio` × the median weight.

Every reducer runs the same code on the same inputs in the same (sorted) order, and every
member decodes the reducer's bytes, so θ_global stays bit-identical whatever this computes.
"""
from __future__ import annotations

import torch


def weighted_mean(contributions: list[tuple[float, torch.Tensor]]) -> torch.Tensor:
    """Σ wᵢ·Δᵢ / Σ wᵢ in the given order; all-zero weights give zeros (the outer step then only
    carries momentum, identically everywhere)."""
    total = sum(w for w, _ in contributions)
    out = torch.zeros_like(contributions[0][1])
    if total <= 0:
        return out
    for w, t in contributions:
        out.add_(t, alpha=w / total)
    return out


def bound_weights(weights: dict[str, float], max_ratio: float) -> dict[str, float]:
    """Every member's weight for the round, bounded by what its group shows a member can train in
    the round: at most `max_ratio` × the group's lower-median weight, and in a group of two at most
    the other member's (neither can be told from the other, so neither chooses the mean by
    claiming more). Non-finite or negative claims count as 0. These bounded weights are the ones
    the mean uses *and* the ones the round's total (the swarm's schedule position,
    `trained_samples`) adds up, so a member claiming 10^9 samples moves neither. Pure and
    computed alike by every member from the same registrations."""
    clean = {p: (w if w == w and 0.0 <= w < float("inf") else 0.0) for p, w in weights.items()}
    if len(clean) < 2:
        return clean
    ordered = sorted(clean.values())
    median = ordered[(len(ordered) - 1) // 2]
    cap = median if len(clean) == 2 else max(0.0, max_ratio) * median
    return {p: min(w, cap) for p, w in clean.items()}


def cap_weights(weights: list[float], max_ratio: float) -> list[float]:
    """Cap each weight at `max_ratio` × the median weight (no cap for fewer than 3 members).
    Unequal peers legitimately train different sample counts, so the ratio is generous."""
    if len(weights) < 3 or max_ratio <= 0:
        return list(weights)
    ordered = sorted(weights)
    median = ordered[len(ordered) // 2]
    cap = max_ratio * median
    return [min(w, cap) for w in weights]


NORM_FACTOR = 1.25
"""A member's part may have at most this × the median member norm (× its weight over the median
weight, when above 1) before the center is computed."""
RADIUS_FACTOR = 2.0
"""τ as a multiple of the median distance from the center: honest members' distances are alike,
so twice the median leaves them unclipped."""


def centered_clip(members: list[tuple[float, dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Centered clipping of whole-part contributions (each a dict of named tensors) around their
    coordinate-wise median, radius RADIUS_FACTOR × the median distance; see the module docstring."""
    names = sorted(members[0][1])
    members = cap_norms(members, names)
    center = {n: torch.stack([m[n] for _, m in members]).median(dim=0).values for n in names}
    distances = []
    for _, m in members:
        sq = sum(float((m[n] - center[n]).double().pow(2).sum()) for n in names)
        distances.append(sq ** 0.5)
    ordered = sorted(distances)
    tau = RADIUS_FACTOR * ordered[len(ordered) // 2]
    total = sum(w for w, _ in members)
    out = {n: center[n].clone() for n in names}
    if total <= 0:
        return out
    for (w, m), dist in zip(members, distances):
        scale = 1.0 if dist <= tau or dist == 0 else tau / dist
        for n in names:
            out[n].add_(m[n] - center[n], alpha=(w / total) * scale)
    return out


def cap_norms(members: list[tuple[float, dict[str, torch.Tensor]]], names: list[str], lower: bool = False
              ) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """Each member's part scaled down to at most NORM_FACTOR × max(1, wᵢ / w_med) × the median norm
    (`lower`: the lower median, the smaller of a pair's norms)."""
    norms = [sum(float(m[n].double().pow(2).sum()) for n in names) ** 0.5 for _, m in members]
    median_norm = sorted(norms)[(len(norms) - 1) // 2 if lower else len(norms) // 2]
    weights = sorted(w for w, _ in members)
    median_w = weights[len(weights) // 2]
    out = []
    for (w, m), norm in zip(members, norms):
        allowed = NORM_FACTOR * max(1.0, w / median_w if median_w > 0 else 1.0) * median_norm
        if norm > allowed and norm > 0:
            m = {n: t * (allowed / norm) for n, t in m.items()}
        out.append((w, m))
    return out


def reduce_part(members: list[tuple[float, dict[str, torch.Tensor]]], robust_min_members: int,
                max_weight_ratio: float) -> dict[str, torch.Tensor]:
    """The part's aggregate: weighted mean below `robust_min_members` members (0 disables the
    robust path), centered clipping with capped weights from there on."""
    if robust_min_members and len(members) >= robust_min_members:
        weights = cap_weights([w for w, _ in members], max_weight_ratio)
        return centered_clip([(w, m) for w, (_, m) in zip(weights, members)])
    names = sorted(members[0][1])
    if robust_min_members and len(members) == 2:
        # a pair has no median to clip around, but neither member may choose the mean by sending
        # a huge Δ: each part is capped at NORM_FACTOR × the smaller norm (honest pairs have alike norms)
        members = cap_norms(members, names, lower=True)
    return {n: weighted_mean([(w, m[n]) for w, m in members]) for n in names}
