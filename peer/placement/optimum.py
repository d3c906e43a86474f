"""What placement can reach: the best min over stages of capacity any assignment of peers to
stages gives (``optimum``), exact for a handful of peers and the fluid bound for larger swarms.
Pure; the yardstick of the placement policy's margin (``rules.py``) and of the simulator."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

EXACT_LIMIT = 12
"""Swarms of at most this many peers get the exact optimum; larger ones the fluid bound."""


@dataclass(frozen=True)
class Optimum:
    throughput: float
    method: str
    """"exact" (branch and bound over assignments) or "bound" (fluid upper bound)."""
    assignment: tuple[int, ...] | None = None
    """Stage per peer (exact only; -1: fits no stage)."""


def fits(offer: int, need: int) -> bool:
    """A memory offer covers a need (0: unknown, assumed to fit)."""
    return offer <= 0 or offer >= need


def fluid_bound(work: Sequence[float], costs: Sequence[float], memory: Sequence[int] = (),
                memory_need: Sequence[int] = (), fixed: Sequence[int] = ()) -> float:
    """Upper bound on T when work may be split freely: T·Σc ≤ Σ w (w_i = r_i·c_i, a peer's
    rate normalised by stage cost). With memory, fitting is nested (a peer that fits a stage
    fits every stage needing less), so for every threshold m the peers offering ≥ m must cover
    the stages needing ≥ m: T ≤ Σ_{mem ≥ m} w / Σ_{need ≥ m} c. Exact for the relaxation.
    ``fixed[i]`` >= 0: peer i stays on that stage (pinned); then also T ≤ the water level of
    the free work poured over the pinned work (``_water_level``), and the bound is the lower."""
    pinned = _water_level(work, costs, fixed) if any(s >= 0 for s in fixed) else math.inf
    if not memory_need or not memory:
        return min(math.fsum(work) / math.fsum(costs), pinned)
    best = pinned
    for m in sorted(set(memory_need)):
        c = math.fsum(cs for cs, need in zip(costs, memory_need) if need >= m)
        w = math.fsum(wi for wi, offer in zip(work, memory) if fits(offer, m))
        best = min(best, w / c)
    return best


def _water_level(work: Sequence[float], costs: Sequence[float], fixed: Sequence[int]) -> float:
    """The largest T with Σ_s max(0, T·c_s − F_s) ≤ W: F_s the work pinned to stage s, W the
    free work, split freely (memory aside)."""
    pinned = [0.0] * len(costs)
    free = 0.0
    for i, w in enumerate(work):
        if i < len(fixed) and fixed[i] >= 0:
            pinned[fixed[i]] += w
        else:
            free += w
    # raise the level stage by stage, in the order the pinned work alone would serve them
    order = sorted(range(len(costs)), key=lambda s: pinned[s] / costs[s])
    level, filled_c, filled_f = 0.0, 0.0, 0.0
    for k, s in enumerate(order):
        filled_c += costs[s]
        filled_f += pinned[s]
        level = (free + filled_f) / filled_c  # every stage so far at one level
        if k + 1 == len(order) or level <= pinned[order[k + 1]] / costs[order[k + 1]]:
            return level
    return level


def optimum(work: Sequence[float], costs: Sequence[float], memory: Sequence[int] = (),
            memory_need: Sequence[int] = (), exact_limit: int = EXACT_LIMIT, fixed: Sequence[int] = ()) -> Optimum:
    """The best T any placement reaches: exact (branch and bound) for ≤ ``exact_limit`` peers,
    else the fluid bound (``fluid_bound``), which the exact value approaches as peers grow.
    ``fixed[i]`` >= 0 keeps peer i on that stage (a pinned replica); -1 or absent: free."""
    if len(work) > exact_limit:
        return Optimum(fluid_bound(work, costs, memory, memory_need, fixed), "bound")
    return _exact(list(work), list(costs), list(memory) or [0] * len(work), list(memory_need) or [0] * len(costs),
                  list(fixed) + [-1] * (len(work) - len(fixed)))


def _exact(work: list[float], costs: list[float], memory: list[int], need: list[int],
           fixed: list[int]) -> Optimum:
    """Raise T step by step: find any assignment with every stage strictly above T·c_s (a
    depth-first search that only feeds stages still at or under the bar, so a peer either
    lifts one of them or is set aside), take its value as the new T, repeat until none exists."""
    n, s_count = len(work), len(costs)
    allowed = [[fixed[i]] if fixed[i] >= 0 else [s for s in range(s_count) if fits(memory[i], need[s])]
               for i in range(n)]
    order = sorted((i for i in range(n) if allowed[i]), key=lambda i: (-work[i], i))

    def place_rest(assign: list[int]) -> tuple[float, list[int]]:
        load = [0.0] * s_count
        for i, s in enumerate(assign):
            if s >= 0:
                load[s] += work[i]
        for i in order:  # set-aside peers go where they lift the lowest stage
            if assign[i] < 0:
                s = min(allowed[i], key=lambda s: (load[s] / costs[s], s))
                assign[i] = s
                load[s] += work[i]
        return min(load[s] / costs[s] for s in range(s_count)), assign

    if len(order) < s_count or any(not any(s in allowed[i] for i in order) for s in range(s_count)):
        return Optimum(0.0, "exact", tuple(place_rest([-1] * n)[1]) if order else tuple([-1] * n))
    best_t, best_assign = place_rest([-1] * n)
    bound = fluid_bound([work[i] for i in order], costs, [memory[i] for i in order], need, [fixed[i] for i in order])
    while best_t < bound * (1 - 1e-9):
        found = _above(best_t, work, costs, allowed, order)
        if found is None:
            break
        t, assign = place_rest(found)
        if t <= best_t:
            break  # float ties: no strict progress
        best_t, best_assign = t, assign
    return Optimum(best_t, "exact", tuple(best_assign))


def _above(bar: float, work: list[float], costs: list[float], allowed: list[list[int]],
           order: list[int]) -> list[int] | None:
    """An assignment (-1: set aside) putting every stage strictly above bar·c_s, or None."""
    s_count = len(costs)
    load = [0.0] * s_count
    assign = [-1] * len(work)
    suffix = [0.0] * (len(order) + 1)
    for k in range(len(order) - 1, -1, -1):
        suffix[k] = suffix[k + 1] + work[order[k]]

    def search(k: int) -> bool:
        # A stage within rounding of the bar is still under it, or the loop would not progress.
        short = {s: bar * costs[s] * (1 + 1e-9) - load[s] for s in range(s_count)
                 if load[s] <= bar * costs[s] * (1 + 1e-9)}
        if not short:
            return True
        if len(short) > len(order) - k or math.fsum(short.values()) >= suffix[k]:
            return False
        i = order[k]
        tried = set()
        for s in sorted((s for s in allowed[i] if s in short), key=lambda s: (-short[s], s)):
            sym = (costs[s], load[s])  # identical stages: try one of them
            if sym in tried:
                continue
            tried.add(sym)
            load[s] += work[i]
            assign[i] = s
            if search(k + 1):
                return True
            load[s] -= work[i]
            assign[i] = -1
        return search(k + 1)  # set this peer aside

    return assign if search(0) else None
