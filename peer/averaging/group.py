"""Who averages together in a round, and who reduces what: pure decisions over the round's
registrations and the stage's tensor shapes, computed identically by every member from the same
view (peer/averaging/averager.py runs the round; tests/test_decisions.py checks these without a network)."""
from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Mapping

from swarmgrad.peer.evidence import NO_EVIDENCE, Evidence
from swarmgrad.peer.records import FAILED


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


@dataclass(frozen=True)
class CompletedGroup:
    group_hash: str
    digest: str
    members: tuple[str, ...]
    """Sorted: the ids whose sorted tuple hashes to group_hash."""


def completed_groups(votes: Mapping[str, str], registrations: Mapping[str, Mapping[str, Any]] | None = None
                     ) -> list[CompletedGroup]:
    """The groups of one round of one stage that completed, read from its outcome votes (peer id ->
    "<group hash>:<digest or failed>", peer/averaging/outcome.py): two or more ids voted one digest
    under the hash of exactly their sorted ids, so every member voted it and applied the round (a
    group of one posts no vote). With `registrations` (that round's), the group must also be the one
    `choose_group` forms from the registrations of the round's voters (one that registered after
    the group formed votes nothing): ids voting a group of their own beside the one matchmaking
    formed prove nothing, and nor does that group, since which of the two is real cannot be told.

    The one rule of what counts as work done: placement's evidence (peer/placement/evidence.py)
    and contribution credit (peer/averaging/credit.py) both read it."""
    chosen: tuple[str, ...] | None = None
    if registrations is not None:
        group = choose_group({p: dict(v) for p, v in registrations.items() if p in votes})
        chosen = group.members if group is not None else ()
    by_vote: dict[str, list[str]] = defaultdict(list)
    for peer_id, value in votes.items():
        by_vote[value].append(peer_id)
    out = []
    for value, voters in sorted(by_vote.items()):
        hash_, _, digest = value.partition(":")
        members = tuple(sorted(voters))
        if not digest or digest == FAILED or len(members) < 2 or group_hash(members) != hash_:
            continue
        if chosen is not None and members != chosen:
            continue
        out.append(CompletedGroup(hash_, digest, members))
    return out


def completed_voters(checks: Mapping[str, str], registrations: Mapping[str, Mapping[str, Any]] | None = None
                     ) -> frozenset[str]:
    """The members of the completed groups of one round of one stage (``checks``: its outcome
    votes; `completed_groups`). Empty when no group completed. What placement's evidence and a
    backup holder (peer/state/backup.py) count as a replica proven on a stage."""
    return frozenset(p for g in completed_groups(checks, registrations) for p in g.members)
