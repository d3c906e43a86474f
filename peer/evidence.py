"""Trust from evidence, not claims: whose word a replica counts in a stage's majorities.

Any peer can write a record or a registration saying anything about itself (a digest, 2^40
applied rounds, 10^9 samples), and in a public run any number of fresh ids can. So no decision
that picks a state, a donor or a group counts ids or believes a claimed position. It counts
**voices**, and a voice is earned by work this replica saw done: a peer took part in a completed,
voted round of the stage that this replica applied itself (every member posted exactly our
outcome vote, "<group hash>:<digest>", under {run}/round/{stage}/{round}/check; the group hash is
that of the sorted member list, so nobody is credited for a group it was not in, and in public
and private runs each vote is signed by its peer: peer/net/record_signing.py). Ids that did no
work weigh nothing, and forged ids voting among themselves earn nothing: their rounds are not
rounds this replica applied. docs/trust.md states, decision by decision, what is counted and what
an attacker can still do.

The API, kept small for the other subsystems that count evidence:

- `EvidenceLedger(stage, window=WINDOW)`: one per replica, fed by the round runner and state sync:
  `applied(round_no, members, applied_rounds)` after a round this replica applied (its group
  voted as one), `adopted(applied_rounds, backers)` after it took a state it verified (the seed,
  a quorum's state, a restore), `snapshot()` → `Evidence`.
- `Evidence` (frozen, what pure decisions read): `earned(peer_id)` (completed voted rounds it took
  part in, within the last `window` rounds this replica applied), `voice(peer_id)` (1 if it earned
  any, else 0), `corroborated_round` (the applied-round count of the newest state this replica
  applied or verified; -1 for none), `anchored` (it has any), `credible(applied_rounds, peer_id)`
  (a claim is believed up to `corroborated_round`, one round more (MAX_LEAD) only from a peer
  with a voice, never further; a newcomer believes anything and relies on majorities),
  `anchors` and `among(records)` (peers the run's owner vouches for, with a voice from the start
  where their ONLINE record is: docs/trust.md, "Anchors").
- `quorum(records, evidence, ...)`: the digest a strict majority of voices announces (a tie, or
  no majority, decides nothing: None), with the records that back it and the round they are in.
- `voiced_majority(values, evidence)`: the same rule over any per-peer claim (the run's epoch).
- `WorkSeen`: who a reader saw vote in completed rounds of each stage, from the DHT's votes
  rather than from rounds it applied itself (a reader of other stages: placement, a backup holder).

A replica with no evidence at all (a newcomer) has nobody to weigh: it counts ids, one each, still
by strict majority (ties refuse, and it asks again). An honest swarm is then what it reads; a
swarm of forged ids outnumbering the honest replicas can give a newcomer its state, but never
the replicas that hold evidence, which do not group with it (docs/trust.md, "State to adopt").
In a public run whose owner anchors the stage (a vouched record there), the newcomer counts the
anchors' voices instead of ids, and so does a stage before its first averaged round.
Pure: no I/O, imports only `records`.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, Sequence, TypeVar

from swarmgrad.peer.records import ONLINE, PeerRecord

MAX_LEAD = 1
"""How many applied rounds a claim may be ahead of the stage's corroborated position: one round
(a member that applied the round we are failing) is normal, more is never believed."""
WINDOW = 64
"""Rounds of this replica's own history a voice is earned over: a peer that stopped taking part
loses its voice after this many applied rounds."""

T = TypeVar("T")


@dataclass(frozen=True)
class Evidence:
    """What one replica saw done in its stage, frozen for pure decisions."""
    stage: int
    rounds: Mapping[str, int] = field(default_factory=dict)
    """peer id -> completed voted rounds (within the window) it took part in."""
    corroborated_round: int = -1
    """Applied rounds of the newest state this replica applied or verified (-1: none yet)."""
    anchors: frozenset[str] = frozenset()
    """Peers the run's owner vouches for (peer/net/vouchers.py) whose ONLINE record is among the
    records this snapshot was taken with (`among`): each has a voice from the start, before any
    round was averaged, for a newcomer too. Only where their record is: a stage without one
    decides as without anchors."""

    @property
    def anchored(self) -> bool:
        """This replica has a state of its own to measure claims against."""
        return self.corroborated_round >= 0

    @property
    def voiced(self) -> bool:
        """Anyone has a voice here (else decisions count ids: the newcomer's rule)."""
        return bool(self.anchors) or any(n > 0 for n in self.rounds.values())

    def earned(self, peer_id: str) -> int:
        return int(self.rounds.get(peer_id, 0))

    def voice(self, peer_id: str) -> int:
        """1 for a peer that earned its voice or is an anchor, 0 for one that did no work we saw."""
        return 1 if self.earned(peer_id) > 0 or peer_id in self.anchors else 0

    def credible(self, applied_rounds: int, peer_id: str | None = None) -> bool:
        """Is a claimed applied-round count believed? Anything, by a replica with no position of
        its own (a newcomer); up to our position by anyone; one round more (MAX_LEAD) only from a
        peer with a voice (`peer_id`; None: from anyone); never further."""
        if not self.anchored or applied_rounds <= self.corroborated_round:
            return True
        return applied_rounds <= self.corroborated_round + MAX_LEAD and (peer_id is None or self.voice(peer_id) > 0)

    def weight(self, peer_id: str) -> int:
        """A peer's weight in a majority: its voice, or 1 per id when nobody has one yet."""
        return self.voice(peer_id) if self.voiced else 1

    def among(self, records: Iterable[PeerRecord]) -> "Evidence":
        """This evidence with the anchors of `records` (a stage's, as just read): the ONLINE ones
        whose reader found their owner's voucher valid (`PeerRecord.vouched`). Replaces the anchors
        it had: an anchor counts only while its record is there."""
        anchors = frozenset(r.peer_id for r in records if r.vouched and r.state == ONLINE)
        return self if anchors == self.anchors else replace(self, anchors=anchors)


NO_EVIDENCE = Evidence(stage=-1)
"""A newcomer's (or an observer's): no voices, no position; majorities count ids."""


class EvidenceLedger:
    """One replica's record of the stage rounds it applied and the states it verified."""

    def __init__(self, stage: int, window: int = WINDOW):
        self.stage = stage
        self.window = window
        self._rounds: deque[tuple[int, frozenset[str]]] = deque(maxlen=window)
        self._position = -1

    def applied(self, round_no: int, members: Iterable[str], applied_rounds: int) -> None:
        """This replica applied round `round_no` with `members` (all of whom voted its own vote);
        its state now has `applied_rounds`. A group of one earns nobody a voice: nobody else saw
        the round, and a replica that went ahead alone must not count itself against the others."""
        members = frozenset(members)
        if len(members) > 1:
            self._rounds.append((round_no, members))
        self._position = max(self._position, applied_rounds)

    def adopted(self, applied_rounds: int, backers: Iterable[str] = ()) -> None:
        """This replica took a state it verified (a quorum's digest, its own seed, a restore):
        its position is that state's, and the voices that backed it (the quorum's records) are
        credited one round each, so a joiner counts the replicas it joined as they count each other."""
        self._position = applied_rounds
        backers = frozenset(backers)
        if backers:
            self._rounds.append((-1, backers))

    def snapshot(self) -> Evidence:
        counts: Counter[str] = Counter()
        for _, members in self._rounds:
            counts.update(members)
        return Evidence(self.stage, dict(counts), self._position)


@dataclass(frozen=True)
class Quorum:
    """A digest that a strict majority of voices announces."""
    digest: str
    applied_rounds: int
    backers: tuple[str, ...]
    """The ONLINE records announcing it that carry weight (sorted)."""
    holders: tuple[str, ...]
    """Every ONLINE credible record announcing it (sorted): donors to download from."""
    round: int
    """The round its backers are in (their median): a downloaded state may move our clock at most
    one round past it."""


def quorum(records: Sequence[PeerRecord], evidence: Evidence = NO_EVIDENCE, exclude: Iterable[str] = ()
           ) -> Quorum | None:
    """The digest held by a strict majority of the weight (`Evidence.weight`) of the stage's
    ONLINE, credible records, not counting `exclude` (the caller itself). Ties and pluralities
    decide nothing (None); so does a stage whose records carry no weight at all."""
    skip = set(exclude)
    online = [r for r in records if r.state == ONLINE and r.digest and r.peer_id not in skip
              and evidence.credible(r.applied_rounds, r.peer_id)]
    weights: Counter[str] = Counter()
    for r in online:
        weights[r.digest] += evidence.weight(r.peer_id)
    total = sum(weights.values())
    if total <= 0:
        return None
    digest, best = max(weights.items(), key=lambda kv: kv[1])
    if 2 * best <= total:
        return None
    holders = sorted({r.peer_id for r in online if r.digest == digest})
    backing = [r for r in online if r.digest == digest and evidence.weight(r.peer_id) > 0]
    rounds = sorted(r.round for r in backing)
    applied = sorted(r.applied_rounds for r in backing)
    return Quorum(digest, applied[(len(applied) - 1) // 2], tuple(sorted(r.peer_id for r in backing)),
                  tuple(holders), rounds[(len(rounds) - 1) // 2])


def voiced_majority(values: Mapping[str, T], evidence: Evidence = NO_EVIDENCE) -> T | None:
    """The value (a per-peer claim, such as the run's epoch) a strict majority of weight announces;
    None on a tie or a plurality."""
    weights: Counter = Counter()
    for peer, value in values.items():
        weights[value] += evidence.weight(peer)
    total = sum(weights.values())
    if total <= 0:
        return None
    value, best = max(weights.items(), key=lambda kv: kv[1])
    return value if 2 * best > total else None


def bounded_round(claimed: int, corroborated: int) -> int:
    """The round a downloaded state may move a clock to: its claim, at most one past the round
    its quorum is in."""
    return min(claimed, corroborated + MAX_LEAD)


EVIDENCE_ROUNDS = 10
"""A replica stays proven on a stage for this many rounds after the last completed round it was
seen voting in there (`WorkSeen`). Long enough to outlast a few rounds a reader missed (the
rebalancer reads each stage's last two rounds per check, and a vote expires within four announce
TTLs); short enough that a peer that stopped doing work there stops counting soon."""


class WorkSeen:
    """Who this peer has seen complete voted rounds, per stage: (peer id, stage) -> the latest such
    round (averaging/group.py `completed_voters` of what it read). Owned by one reader (the
    rebalancer, for placement; a backup store, for whose copies it takes); no I/O (the owner reads
    the votes and feeds them)."""

    def __init__(self, window: int = EVIDENCE_ROUNDS) -> None:
        self.window = window
        self._last: dict[tuple[str, int], int] = {}
        self._settled: set[tuple[int, int]] = set()
        self._stages: set[int] = set()
        self.seen_any = False
        """A completed round was ever seen: from then on no record counts without evidence (even
        when all evidence has aged out, or ids voting groups of their own deny it for a while)."""

    def settled(self, stage: int, round_no: int) -> bool:
        """A completed group of this round was already seen: no need to read it again."""
        return (stage, round_no) in self._settled

    def seen(self, stage: int) -> bool:
        """A completed round of `stage` was ever seen (`seen_any`, for one stage)."""
        return stage in self._stages

    def observe(self, stage: int, round_no: int, voters: Iterable[str]) -> None:
        voters = list(voters)
        if voters:
            self._settled.add((stage, round_no))
            self._stages.add(stage)
            self.seen_any = True
        for peer in voters:
            key = (peer, stage)
            self._last[key] = max(self._last.get(key, -1), round_no)

    def proven(self, current_round: int) -> frozenset[tuple[str, int]]:
        """(peer id, stage) pairs seen in a completed round within the last ``window`` rounds.
        Forgets older entries (its memory stays the size of the swarm's recent workers)."""
        oldest = current_round - self.window
        self._last = {k: r for k, r in self._last.items() if r >= oldest}
        self._settled = {k for k in self._settled if k[1] >= oldest}
        return frozenset(self._last)
