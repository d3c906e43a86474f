"""Who averages together in a round, and who reduces what: pure decisions over the round's
registrations and the stage's tensor shapes, computed identically by every member from the same
view (peer/averaging/averager.py runs the round; tests/test_decisions.py checks these without a network)."""
from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Any


def partition(shapes: dict[str, tuple[int, ...]], n_parts: int) -> dict[str, int]:
    """Assign whole tensors to parts, largest first to the lightest part (deterministic LPT).

    Whole tensors (not slices of a flat vector) keep shapes intact for codecs like PowerSGD and
    keep error-feedback residuals per named tensor.
    """
    loads = [0] * n_parts
    out = {}
    for name in sorted(shapes, key=lambda n: (-_numel(shapes[n]), n)):
        part = min(range(n_parts), key=lambda i: (loads[i], i))
        out[name] = part
        loads[part] += _numel(shapes[name])
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class Group:
    members: tuple[str, ...]
    digest: str
    applied_rounds: int

    @property
    def hash(self) -> str:
        return group_hash(self.members)


def group_hash(members: tuple[str, ...]) -> str:
    return hashlib.sha256(",".join(members).encode()).hexdigest()[:16]


def choose_group(registrations: dict[str, dict[str, Any]]) -> Group | None:
    """The registrants that hold the reference state: the most applied rounds, then the most common
    digest, then the smallest digest. Every member computes the same answer from the same view."""
    if not registrations:
        return None
    newest = max(v["applied_rounds"] for v in registrations.values())
    digests = Counter(v["digest"] for v in registrations.values() if v["applied_rounds"] == newest)
    best = max(digests.values())
    digest = min(d for d, n in digests.items() if n == best)
    members = tuple(sorted(p for p, v in registrations.items()
                           if v["digest"] == digest and v["applied_rounds"] == newest))
    return Group(members, digest, newest)
