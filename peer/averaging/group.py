"""Who averages together in a round, and who reduces what: pure decisions over the round's
registrations and the stage's tensor shapes, computed identically by every member from the same
view (peer/averaging/averager.py runs the round; tests/test_decisions.py checks these without a network)."""
from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

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
                 me: str | None = None, round_no: int = 0) -> Group | None:
    """The registrants that hold the reference state, by evidence before claims
    (peer/evidence.py): registrations claiming more applied rounds than this replica can
    corroborate (`Evidence.credible`: one round more only from a peer with a voice) are ignored;
    then the (applied rounds, digest) held by the most voices wins, then the one held by the most
    registrants, then the most applied rounds, then the smallest digest. (Registrants before
    rounds: a replica that applied rounds alone, with no voice to show for them, follows the
    stage instead of leading it.) Where candidates tie on all three and the tie is of one voice
    or none, the candidate holding `me` wins: one voice's word against ours decides nothing (in a
    stage of two, one admitted id would otherwise choose the state by its digest; a tie of two
    voices or more is broken by the digest, so honest lines still converge). A claim one round
    ahead counts only where `evidence.leads` allows it (`corroborated_leads`, read by matchmaking
    for a replica with a voice of its own). A replica that knows voices never follows a candidate that has
    none unless it is its own (`me`'s): ids that did no work, however many, cannot be its group,
    even in a round none of its voiced peers registered for.

    Every registrant of the winning candidate with a voice joins, and those without one (a
    newcomer earns its voice by completing rounds) join up to `voiceless_cap`: all of them while
    the candidate has fewer than two voices, else one fewer than its voices, so the voiced stay a
    strict majority of the group. Which of them join when there are more is `voiceless_order`
    (sha256 of the round, the candidate's digest and the id: it rotates every round). Members
    compute the same group from the same registrations where their ledgers agree on who of the
    candidate has a voice: an honest joiner credits its donors on adoption and, when it was left
    out, the group that completed without it (state/sync.py), so they do once a round has
    completed; docs/trust.md says what is left."""
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
    best = max(score(k)[:3] for k in candidates)
    tied = [k for k in candidates if score(k)[:3] == best]
    own = [k for k in tied if me is not None and me in candidates[k]]
    # one voice's word against ours: a tie decides nothing, so we keep our own line rather than
    # take the smaller digest (one admitted id in a stage of two would otherwise choose the state)
    applied, digest = own[0] if own and len(tied) > 1 and best[0] <= 1 else max(tied, key=score)
    members = candidates[(applied, digest)]
    voiced = [p for p in members if evidence.voice(p)]
    voiceless = voiceless_order([p for p in members if not evidence.voice(p)], round_no, digest)
    return Group(tuple(sorted(voiced + voiceless[:voiceless_cap(len(voiced))])), digest, applied)


def voiceless_cap(voiced: int) -> int:
    """How many registrants without a voice join a group with `voiced` voices: one fewer, so the
    voiced stay a strict majority, once there are two; unbounded below that. A stage of one voiced
    replica (or of none) cannot hold the cap to a majority anyway, and its replica's ledger and a
    joiner's disagree on its voice (a lone replica earned none; the joiner credits it as its
    donor), which a cap would turn into different groups every round."""
    return voiced - 1 if voiced >= 2 else 1 << 30


def voiceless_order(peers: Iterable[str], round_no: int, digest: str) -> list[str]:
    """The order in which registrants without a voice take the group's free places: by sha256 of
    (round, the candidate's digest, id), the same for every member, and a new draw every round, so
    no id holds a place for good: among k others an honest newcomer is drawn within (k + 1) / c
    rounds on average for c free places (docs/trust.md, "State to adopt")."""
    return sorted(peers, key=lambda p: hashlib.sha256(f"{round_no}/{digest}/{p}".encode()).digest())


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


def corroborated_leads(rounds: Iterable[tuple[Mapping[str, str], Mapping[str, Mapping[str, Any]]]],
                       evidence: Evidence, me: str | None = None) -> frozenset[str]:
    """The peers whose claim of one round past our position (`evidence.corroborated_round` + 1)
    the outcome votes bear out: in one of `rounds` (each: that round's votes, peer id ->
    "<group hash>:<digest>", and its registrations) a group completed (`completed_groups`: every
    member voted one digest under the hash of exactly their ids) in which the claimant and at
    least one other member with a voice in `evidence` both registered at our position. That other
    voice saw the claimant's round agreed; a voice alone (a partner of a pair saying it applied
    the round we failed) is a claim. Our own voice (`me`) is no witness: a group we were in that
    completed after our vote wait ended is one whose mean we hold and apply ourselves
    (Averager.confirm_late); a partner that withheld its vote until then could serve any state
    as that round's result. Pure; the caller reads the rounds (`Evidence.with_leads`)."""
    position = evidence.corroborated_round
    leads: set[str] = set()
    for votes, registrations in rounds:
        for group in completed_groups(votes):
            at = [p for p in group.members if _applied(registrations.get(p)) == position]
            for p in at:
                if p != me and evidence.voice(p) and any(q not in (p, me) and evidence.voice(q) for q in at):
                    leads.add(p)
    return frozenset(leads)


def witnessed_members(votes: Mapping[str, str], evidence: Evidence) -> frozenset[str]:
    """The members of the completed groups of one round (`completed_groups` of its votes) in which
    at least two members have a voice in `evidence`: what a replica that re-synced after the round
    credits (state/sync.py), so that it counts a newcomer that completed the round without it as
    the group's members do, and its next group is theirs (`voiceless_cap`). Two voices, as for
    `corroborated_leads`: one voice's group is its own word. Pure."""
    return frozenset(p for g in completed_groups(votes) if sum(evidence.voice(q) for q in g.members) >= 2
                     for p in g.members)


def _applied(registration: Mapping[str, Any] | None) -> int | None:
    try:
        return int(registration["applied_rounds"]) if registration is not None else None
    except (KeyError, TypeError, ValueError):
        return None
