"""The daemon's small decisions, as pure functions over what it has gathered.

The daemon gathers a snapshot (its clock, its worker's counters, the DHT records it read) and
calls these; they decide, it acts. Each is tested without a network (tests/test_daemon_decisions.py).
"""
from __future__ import annotations

import hashlib
from typing import Collection, Iterable, Mapping, Sequence

from swarmgrad.peer.records import FAILED
from swarmgrad.peer.evidence import NO_EVIDENCE, Evidence, quorum
from swarmgrad.peer.records import JOINING, ONLINE, PeerRecord


def round_ended(*, round_no: int, seen: int, counts_steps: bool, inner_steps: int, steps_per_round: int,
                now: float, wall_end: float | None, drivers_min_round: int | None) -> bool:
    """Has round `round` ended for this replica? Whichever comes first:
    - a microbatch of a later round arrived (`seen`);
    - on a driver with H-step rounds, H inner steps were taken;
    - the shared wall clock passed the round's end;
    - on a later stage without a wall clock, every online driver is already past it (their
      records say so: a replica that gets no more work still ends its round).
    """
    if seen > round_no:
        return True
    if counts_steps and steps_per_round and inner_steps >= steps_per_round:
        return True
    if wall_end is not None and now >= wall_end:
        return True
    return drivers_min_round is not None and drivers_min_round > round_no


def drivers_min_round(drivers: Sequence[PeerRecord]) -> int | None:
    """The lowest round among online drivers (None when there are none)."""
    rounds = [r.round for r in drivers if r.state == ONLINE and r.driver]
    return min(rounds) if rounds else None


def drivers_gone(stage0: Sequence[PeerRecord]) -> bool:
    return not any(r.state == ONLINE for r in stage0)


def majority_digest(records: Sequence[PeerRecord], evidence: Evidence = NO_EVIDENCE,
                    exclude: Iterable[str] = ()) -> str | None:
    """The θ_global digest a strict majority of the stage's voices announces (peer/evidence.py:
    earned voices, or one per id for a peer with no evidence), or None: a tie decides nothing,
    and nobody wins by claiming a bigger applied_rounds."""
    q = quorum(records, evidence, exclude)
    return q.digest if q is not None else None


def join_donors(records: Sequence[PeerRecord], self_id: str, evidence: Evidence = NO_EVIDENCE) -> list[str]:
    """Replicas a joiner may take θ_global from: online, not itself, announcing the digest of the
    stage's quorum (`evidence.quorum`; sorted for a deterministic order). None on a tie."""
    q = quorum(records, evidence, exclude=(self_id,))
    return list(q.holders) if q is not None else []


def join_superseded(records: Sequence[PeerRecord], self_id: str, own_applied: int,
                    evidence: Evidence = NO_EVIDENCE) -> list[str]:
    """The donors to download again from when a joiner's download is already old: a replica it
    would take θ_global from (`join_donors`) announces more applied rounds than the state that
    arrived (none when it is current). A download that spans the donor's
    round boundary delivers the state that round replaced (the snapshot is immutable), and the
    joiner would fail its first round with a group the donor no longer has, and its second as
    stale. Seen right after the donors' announce, a second download has the donors' whole next
    round to arrive in (enough when rounds are much longer than a download)."""
    donors = join_donors(records, self_id, evidence)
    moved = any(r.applied_rounds > own_applied for r in records if r.peer_id in donors)
    return donors if moved else []


def join_hold(served: dict[str, float], records: Sequence[PeerRecord], own_digest: str, now: float,
              hold: float, connected: set[str] | None = None, *, shares: Mapping[str, float] | None = None,
              min_share: float = 0.0, held_before: Collection[str] = (), active: Mapping[str, float] | None = None,
              stall: float = float("inf"), unannounced: float = 0.0) -> tuple[list[str], list[str]]:
    """(the peers a replica waits for at its round boundary, the peers it may forget).

    At a boundary the replica holds (worker paused, state served, nothing averaged) for the peers
    that downloaded its state (`served`: peer id -> when their first request arrived) less than
    `hold` seconds ago and do not serve it yet. A peer serves it when its record is ONLINE with
    our digest; one whose record is gone or LEAVING never will: both are forgotten, and so is one
    that `connected` (the peers our p2p daemon holds a connection to; None: not known) lacks: a
    joiner killed mid-download keeps its JOINING record until it expires (`announce_ttl`), and the
    stage would wait that long for nobody. One whose hold ran out is neither waited for nor
    forgotten, so asking again does not start a new hold.

    Over a slow link a download outlasts a short round: unheld, the donor (alone, or with the
    stage's other replicas) applies the round meanwhile, the state arrives superseded, and the
    joiner downloads again or fails its first round as stale, round after round (measured:
    docs/measurements.md, "Notes moved from the code"). A round held until the download lands
    costs the donors that wait once.

    Who may be waited for at all (docs/trust.md, "Join hold"): a hold stalls the whole stage, so it
    is granted only to a plausible joiner, never on a request alone. Besides a record of this stage
    that is JOINING (or ONLINE and re-syncing) and a live connection, the peer must have asked us
    for at least `min_share` of the state (`shares`: peer -> the fraction of the state's tensors,
    by size, it asked for; a joiner asks every donor for its part of the whole state at once, so
    one small part does not qualify), and it must not be in `held_before` (the peers a boundary was
    already held for: one hold per peer id). A peer whose download from us has not moved for `stall`
    seconds (`active`: peer -> when it last asked or had a stream open to us) is no longer waited
    for: its download stalled, or ended long enough ago for a real joiner to have landed it. A peer
    that does not qualify is neither waited for nor forgotten. How long all holds together may last
    is `join_hold_left`'s.

    A peer with no record yet is not gone for `unannounced` seconds from its first request: a
    joiner asks for the state as soon as it starts, and its JOINING record can reach our view of
    the DHT after that (on loaded cores a 125M joiner's did: the hold ended after 4 s of a 52 s
    download, and the joiner's first round was of a stale round)."""
    by_id = {r.peer_id: r for r in records}
    waiting, settled = [], []
    for peer, since in served.items():
        record = by_id.get(peer)
        announcing = record is None and now - since < unannounced  # its JOINING record is on its way
        state = JOINING if announcing else (record.state if record is not None else None)
        if state not in (JOINING, ONLINE) or (
                record is not None and record.state == ONLINE and record.digest == own_digest) or (
                connected is not None and peer not in connected):
            settled.append(peer)
        elif now - since < hold and peer not in held_before and (
                shares is None or shares.get(peer, 0.0) >= min_share) and (
                active is None or now - active.get(peer, since) < stall):
            waiting.append(peer)
    return sorted(waiting), sorted(settled)


def join_hold_left(holds: Sequence[tuple[float, float]], now: float, hold: float, window: float) -> float:
    """Seconds this replica may still hold boundaries for joiners: at most `hold` seconds in all over
    any `window` seconds (`holds`: (start, end) of past holds, monotonic). However many ids ask,
    a stage stalls for joiners at most hold / window of its time."""
    spent = sum(max(0.0, end - max(start, now - window)) for start, end in holds if end > now - window)
    return max(0.0, hold - spent)


def finished_without_us(registrations: dict[str, dict], records: Sequence[PeerRecord], self_id: str,
                        members: Sequence[str]) -> list[str]:
    """Members of our group (`members`, chosen from this round's `registrations`) whose record
    already announces more applied rounds than they registered with: they have completed this
    round in a group without us (a replica averages a round only once, and not while we are still
    matching for it), so the θ_global we registered with is superseded. Seen with a joiner whose
    download landed as its donor finished the round alone: it would fail the round (GROUP_MISMATCH),
    read no outcome votes (a group of one posts none), conclude that nobody applied the round, and
    fail the next as stale before downloading again."""
    announced = {r.peer_id: r.applied_rounds for r in records}
    return sorted(p for p in members if p != self_id and p in registrations and p in announced
                  and announced[p] > int(registrations[p].get("applied_rounds", 0)))


def resync_donors(records: Sequence[PeerRecord], self_id: str, own_applied: int, group: Sequence[str],
                  stale: bool, evidence: Evidence = NO_EVIDENCE) -> list[str]:
    """After a failed round: the replicas whose state is newer than ours (or, if ours was not the
    group's reference, any member of the group), restricted to the digest a strict majority of
    *their* voices announces (peer/evidence.py: earned voices, credible claims only; ties decide
    nothing). Our own voice is not among them: a replica that failed a round knows it is the one
    behind, so in a stage of two the member that applied the round is followed. One replica
    claiming a large applied_rounds, or any number of ids that did no work, hand us nothing.

    Where the stage has an anchor other than us at our position or past it (`Evidence.anchors`: a
    peer the run's owner vouches for, ONLINE here), only anchors are followed: the owner's peer
    that did not apply the round says it was not applied, as far as the owner trusts anyone. So in
    a stage of two replicas and an anchor, the one admitted id that claims the round we failed
    hands us nothing (docs/trust.md, "Anchors"). An anchor behind us says nothing of this round."""
    newer = [r for r in records if r.peer_id != self_id and r.state == ONLINE and (
        r.applied_rounds > own_applied or (stale and r.peer_id in group))]
    if any(r.peer_id in evidence.anchors and r.peer_id != self_id and r.state == ONLINE
           and r.applied_rounds >= own_applied for r in records):
        newer = [r for r in newer if r.peer_id in evidence.anchors]
    q = quorum(newer, evidence)
    return list(q.holders) if q is not None else []


def resync_settled(records: Sequence[PeerRecord], others: Sequence[str], round_no: int,
                   abandoned: Iterable[str] = (), silent: Iterable[str] = ()) -> bool:
    """Has every other member of the failed round applied it or not, as far as anyone can learn?
    Each one has announced a later round (if none of them applied it, nobody did), or said it
    abandoned the round (it failed, did not apply it and re-syncs too), or posted no outcome vote
    that we could read by the end of our vote wait (`silent`: dead or cut off, as a member killed
    between the exchange and its vote is). Then waiting longer cannot produce a donor.

    Without `abandoned`, two members re-syncing after a third died before its vote would each wait
    for the other to announce a later round, which it does only after its own wait: both would
    stall for the whole wait (matchmaking + allreduce) and then keep their state anyway. A silent member
    that did apply the round (its vote unseen) is a replica the next round finds stale."""
    finished = {r.peer_id for r in records if r.peer_id in others and r.round > round_no}
    return set(others) <= finished | set(abandoned) | set(silent)


def nobody_applied(votes: dict[str, str], self_id: str, group_hash: str | None, voted_digest: bool,
                   failed: str = FAILED) -> bool:
    """After a failed round: is it certain that no replica applied it, so a re-sync need not wait?
    `votes`: the round's outcome votes, "<group hash>:<digest or `failed`>" (peer/averaging/outcome.py);
    `group_hash`: our group's (None: our θ_global was stale, we were in no group).

    A member applies a round only once every member of its group voted the same digest under
    that group's hash. A replica that voted a digest under another hash was in a group that
    excluded us (its matchmaking read other registrations): it may have applied the round, so we
    cannot tell. Otherwise every digest vote is from our group: if we did not vote a digest, or a
    member voted failed under our hash, none of them could see all digests, so nobody applied it."""
    if group_hash is None:
        return False  # our θ_global was stale: the group may well have applied the round
    ours = []
    for peer, value in votes.items():
        hash_, _, outcome = value.partition(":")
        if hash_ != group_hash:
            if peer != self_id and outcome != failed:
                return False
            continue
        ours.append(outcome)
    return not voted_digest or failed in ours


def eval_due(*, is_driver: bool, driving: bool, evaluating: bool, eval_every: int, rounds_done: int,
             finished: bool) -> bool:
    """A driver evaluates every `eval_every` counted rounds while it trains; not after the last
    round (it evaluates at the end anyway) and never twice at once."""
    if not (is_driver and driving and eval_every) or evaluating or finished:
        return False
    return rounds_done > 0 and rounds_done % eval_every == 0


def evaluates(*, me: str, group: Sequence[str], run_id: str, round_no: int, evaluators: int) -> bool:
    """Whether this driver is one of a due round's evaluators: the `evaluators` members of the
    round's averaging group that rank first under rendezvous hashing of (run, round). Every member
    knows the same group, so they agree without a message, and the round in the hash rotates the
    cost. A driver in no group (its round was incomplete, so its θ_global may not be the others')
    scores its own; `evaluators` 0: every driver evaluates."""
    if evaluators <= 0 or me not in group:
        return True
    rank = sorted(group, key=lambda p: hashlib.sha256(f"{run_id}/eval/{round_no}/{p}".encode()).digest())
    return me in rank[:evaluators]


def matchmaking_patience(matchmaking: float, round_s: float | None, step_rounds: bool,
                         fraction: float = 0.5, cap: float = 600.0) -> float:
    """How long matchmaking waits for the other online replicas to register.

    With wall-clock rounds every replica reaches the boundary at the same moment, so
    `timeouts.matchmaking` is enough. With H-step rounds a slower (or later-started) replica
    arrives up to a fraction of a round later; giving up after a fixed few seconds splits the
    stage into replicas that average alone and drift apart. So wait a fraction of the last
    round's duration as this replica measured it (a dead replica costs at most that; its record
    expires anyway).
    """
    if not step_rounds or not round_s or round_s <= 0:
        return matchmaking
    return min(cap, max(matchmaking, fraction * round_s))


def next_push_at(started: float, took: float, link_share: float) -> float:
    """When the next backup push may start, after one that started at `started` and took `took`
    seconds: pushes keep the stage's link busy for at most `link_share` of the time. Pure.

    A push is one message of the whole state (fp32 θ_global and outer momentum, 8 bytes per
    parameter) that fills the link while it lasts: a pipeline stage's activations or gradients
    queue behind it. Where a push is quick next to a round (a fast link, long rounds) this still
    pushes every round; over a slow link it spaces them out rather than stall every round."""
    return started + took / link_share if link_share < 1.0 else started
