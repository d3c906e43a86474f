"""Who averages together in a round, and who reduces what: pure decisions over the round's
registrations and the stage's tensor shapes, computed identically by every member from the same
view (peer/averaging/averager.py runs the round; tests/test_decisions.py checks these without a network)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from swarmgrad.peer.evidence import NO_EVIDENCE, Evidence


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


def choose_group(registrations: dict[str, dict[str, Any]], evidence: Evidence = NO_EVIDENCE,
                 me: str | None = None) -> Group | None:
    """The registrants that hold the reference state, by evidence before claims
    (peer/evidence.py): registrations claiming more applied rounds than this replica can
    corroborate (`Evidence.credible`: one round more only from a peer with a voice) are ignored;
    then the (applied rounds, digest) held by the most voices wins, then the one held by the most
    registrants, then the most applied rounds, then the smallest digest. (Registrants before
    rounds: a replica that applied rounds alone, with no voice to show for them, follows the
    stage instead of leading it.) A replica that knows voices never follows a candidate that has
    none unless it is its own (`me`'s): ids that did no work, however many, cannot be its group,
    even in a round none of its voiced peers registered for.

    Every registrant of the winning candidate joins, with a voice or without: a newcomer earns its
    voice by completing rounds, and which ids have a voice may differ between members until they
    have completed a round together (a joiner credits its donors, they do not know it yet), so
    membership must not depend on it. Members compute the same group from the same view; voices
    only order candidates, where honest members' ledgers agree."""
    regs = {p: v for p, v in registrations.items() if evidence.credible(int(v["applied_rounds"]), p)}
    if not regs:
        return None
    candidates: dict[tuple[int, str], list[str]] = {}
    for p, v in regs.items():
        candidates.setdefault((int(v["applied_rounds"]), v["digest"]), []).append(p)

    def score(key: tuple[int, str]) -> tuple:
        applied, digest = key
        members = candidates[key]
        return (sum(evidence.voice(p) for p in members), len(members), applied, tuple(-ord(c) for c in digest))

    if evidence.voiced:
        candidates = {k: m for k, m in candidates.items()
                      if any(evidence.voice(p) for p in m) or (me is not None and me in m)}
        if not candidates:
            return None
    applied, digest = max(candidates, key=score)
    return Group(tuple(sorted(candidates[(applied, digest)])), digest, applied)
