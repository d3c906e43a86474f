"""What placement may believe of a stage record: evidence of work, not the writer's word.

A stage record ({run}/stage/{s}) is signed by its writer, and anyone can write one: a signature
says who wrote it, not that it is true. Placement used to take every record as it came, so one
id writing LEAVING under every stage made every stage "have a mover" (nothing was ever moved to
refill an empty stage), and a record claiming a top throughput beside a stage's one real replica
planned that replica away (issue 43, point 7). Here, pure functions over what the deciding peer
read turn records into a ``Snapshot`` that counts only what has evidence (docs/trust.md,
"Placement capacity"):

- one stage record per peer id (``one_record_per_id``): an id with records under several stages
  counts in none of them, except the one pair a move makes (its old stage's record departing:
  LEAVING or moving; its new stage's not). Not "its newest": a record's expiry is chosen by its
  writer, so "newest" would let a forger pick which stage it counts in;
- a replica is *proven* on a stage when it voted in a completed round of that stage, one whose
  group (``choose_group`` over that round's registrations) all voted one digest under that
  group's hash (``completed_voters``): its parts went through every member's all-reduce, so it
  held the stage's state and did the exchange. ``WorkSeen`` (owned by the rebalancer) keeps who
  was seen so for ``EVIDENCE_ROUNDS`` rounds, since the votes expire from the DHT within a few
  rounds;
- only a proven replica marks its stage as having a mover, and a replica leaves a stage only while
  a proven one stays (``Snapshot.has_mover``, ``Snapshot.may_leave``);
- an unproven replica's throughput counts at most as the largest proven replica's, expressed for
  its stage (``bound_claims``): a claim is bounded by a rate someone showed by doing work;
- unproven live records hold a stage only while something shows it served, or for one window
  after (``StageService``, ``vacate_unserved``, ``unserved_after``): a proven replica there, or
  the deciding peer's own replica training (which needs every stage). Counted per stage, so
  records rotated through fresh ids renew nothing; a stage of one replica, never proven, keeps its
  place while the pipeline trains.

Until the reader has seen a completed round (a swarm's first rounds, or a reader that just
started and has not read one yet), every record counts as before: there is nothing to bound claims by, and a swarm that
moves nobody until its first voted round cannot fill a stage its first peers left empty. The
evidence ledger of completed voted rounds (docs/trust.md) can later replace ``WorkSeen``: it
answers the same question, "did this id do work in stage s lately".
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Iterable, Mapping, Sequence

# re-exported: placement's evidence rules read them here; they live lower so that a backup holder
# (peer/state/backup.py) counts the same proof
from swarmgrad.peer.averaging.group import completed_voters
from swarmgrad.peer.evidence import EVIDENCE_ROUNDS, WorkSeen
from swarmgrad.peer.manifest import TimeoutsConfig
from swarmgrad.peer.placement.plan import LIVE, Snapshot
from swarmgrad.peer.records import LEAVING, ONLINE, PeerRecord

def likely_round(view: Mapping[int, Sequence[PeerRecord]]) -> int:
    """The round the swarm is in, for a reader without a clock yet (a newcomer choosing its stage):
    the low median of the ONLINE records' rounds, 0 with none. Records can lie; a wrong guess only
    reads rounds with no completed group, and then no evidence is found and every record counts,
    as before."""
    rounds = sorted(r.round for records in view.values() for r in records if r.state == ONLINE)
    return rounds[(len(rounds) - 1) // 2] if rounds else 0


def _departing(record: PeerRecord) -> bool:
    return record.state == LEAVING or record.moving


def one_record_per_id(view: Mapping[int, Sequence[PeerRecord]]) -> dict[int, list[PeerRecord]]:
    """The view with at most one stage record per peer id, except the pair a move makes: an id
    with records under two stages, exactly one of them departing (LEAVING or moving), keeps both;
    any other id with records under several stages keeps none (which one is true cannot be told
    from the records, and the writer chooses their expiry)."""
    stages_of: dict[str, list[PeerRecord]] = defaultdict(list)
    for records in view.values():
        for r in records:
            stages_of[r.peer_id].append(r)

    def counts(peer: str) -> bool:
        mine = stages_of[peer]
        if len(mine) == 1:
            return True
        return len(mine) == 2 and len({r.stage for r in mine}) == 2 and sum(map(_departing, mine)) == 1
    return {s: [r for r in records if counts(r.peer_id)] for s, records in view.items()}


UNPROVEN_STAGE_SHARE = 0.0
"""The daemon's ``bound_claims(stage_share=...)``: the unproven records of a stage count together
for at most one top proven replica. Measured with the simulator (1000 peers, 3 h, seeds 0-2, movers
proven; docs/trust.md, "Placement capacity"): with no attack it serves 0.962 of the optimum
against 0.972 with the bound per record alone (real newcomers count for less until their first
completed round); with 20 forged records under one stage 0.939, against 0.303. A share of 0.25
costs nothing without an attack but 10 points under one; 1.0 costs 30."""


def bound_claims(snapshot: Snapshot, stage_share: float | None = None) -> Snapshot:
    """The snapshot with each unproven replica's rate at most the largest rate of a proven live
    replica, expressed for the unproven one's stage (r·c_a/c_b). Unchanged when no live replica
    is proven (nothing to bound by).

    With ``stage_share`` (k), the unproven live records of each stage also count *together* for at
    most the larger of one such top replica and k × the stage's proven live capacity: their rates
    are scaled down alike to fit. The bound per record alone lets n forged records add n top
    replicas to a stage (it looks served, and help goes elsewhere); the bound per stage keeps a
    flood to one top replica, or a share of what the stage shows, while a real wave of newcomers
    (unproven until their first completed round) still counts up to that much."""
    costs = snapshot.costs
    shown = [r.rate * costs[s] for s, reps in enumerate(snapshot.stages) for r in reps if r.proven and r.state in LIVE]
    if not shown:
        return snapshot
    top = max(shown)
    stages = [[r if r.proven or r.rate * costs[s] <= top else dataclasses.replace(r, rate=top / costs[s])
               for r in reps] for s, reps in enumerate(snapshot.stages)]
    if stage_share is not None:
        for s, reps in enumerate(stages):
            unproven = sum(r.rate for r in reps if not r.proven and r.state in LIVE)
            proven = sum(r.rate for r in reps if r.proven and r.state in LIVE)
            allowed = max(top / costs[s], stage_share * proven)
            if unproven > allowed > 0:
                scale = allowed / unproven
                stages[s] = [r if r.proven or r.state not in LIVE else dataclasses.replace(r, rate=r.rate * scale)
                             for r in reps]
    return dataclasses.replace(snapshot, stages=tuple(tuple(reps) for reps in stages))


def unserved_after(timeouts: TimeoutsConfig) -> float:
    """Seconds a stage may go without evidence that it is served before its unproven live records
    stop holding it (``StageService``): a refill's time with room to spare, so that an honest
    joiner's record is not doubled. A refill is detected and confirmed within a few rebalancing
    checks, then downloads (at most ``state_download``) and is waited for by its donors (at most
    ``join_hold``): twice those, and four checks. 240 s by default."""
    return 2 * (timeouts.state_download + timeouts.join_hold) + 4 * timeouts.rebalance_check


class StageService:
    """When this peer last saw each stage served, by evidence rather than records (seconds of a
    monotonic clock). A stage is seen served when a proven replica (``WorkSeen``) has a live record
    there, or when this peer's own replica trained a microbatch: it went forward and back through
    every stage, so every stage was served by someone, whoever its records name. That is how a stage of one replica, which never votes and so is never proven,
    shows it is served. Nothing a record says refreshes it, so fresh ids rotating their records
    under a stage that nobody serves hold it for at most one window (``unserved``), counted per
    stage, not per id. State owned by one rebalancer; the caller passes the time (pure)."""

    def __init__(self, n_stages: int, now: float) -> None:
        self.served_at = [now] * n_stages
        """Last time each stage was seen served; a stage is given one window from when this peer
        started looking."""

    def observe(self, now: float, proven_stages: Iterable[int], trained: bool) -> None:
        """At a check: the stages with a proven live replica, and whether this peer's replica
        trained a microbatch since the last check."""
        for s in (range(len(self.served_at)) if trained else proven_stages):
            self.served_at[s] = now

    def unserved(self, now: float, window: float) -> frozenset[int]:
        """Stages not seen served for longer than ``window`` seconds."""
        return frozenset(s for s, t in enumerate(self.served_at) if now - t > window)


def vacate_unserved(view: Mapping[int, Sequence[PeerRecord]], proven: frozenset[tuple[str, int]],
                    unserved: Iterable[int]) -> dict[int, list[PeerRecord]]:
    """The view without the unproven live records of the ``unserved`` stages (``StageService``):
    they claim a stage that no evidence shows served, and left in place they make it look occupied,
    so placement never refills it. Kept: the record of a move's target (its writer proven on the
    stage it is leaving: a replica moving in to refill it)."""
    unserved = set(unserved)
    if not unserved:
        return {s: list(records) for s, records in view.items()}
    movers = {r.peer_id for s, records in view.items() for r in records if _departing(r) and (r.peer_id, s) in proven}
    return {s: [r for r in records if s not in unserved or r.state not in LIVE or (r.peer_id, s) in proven
                or r.peer_id in movers] for s, records in view.items()}


def evidenced(view: Mapping[int, Sequence[PeerRecord]], proven: frozenset[tuple[str, int]], seen_any: bool,
              unserved: Iterable[int] = ()
              ) -> tuple[dict[int, list[PeerRecord]], frozenset[tuple[str, int]] | None]:
    """(the records placement counts, the proven pairs to mark, or None where the reader never
    saw a completed round (``WorkSeen.seen_any``): then every record counts as proven, as in a
    swarm's first rounds, and no stage is vacated). ``unserved``: stages whose unproven live records
    no longer count (``vacate_unserved``)."""
    if not seen_any:
        return one_record_per_id(view), None
    return vacate_unserved(one_record_per_id(view), proven, unserved), proven
