"""Members that fail rounds are left out of groups for a growing time (issue 43, point 8).

One member that votes "failed" every round, or withholds its part, fails every round of its stage:
a member applies a round only when every member of its group voted the same digest
(peer/averaging/outcome.py). Matchmaking chose the group from every registration, so it stayed in.
Now each replica keeps a `Standing` per peer (state owned by its Averager, updated by the pure
functions below) and drops the registrations of the members it excludes before the group is
chosen (peer/averaging/matchmaking.py).

What counts is only what this replica observed itself in a round that failed (`blame`), so a
stranger cannot get an honest member excluded by saying so:
- a part failed (refused, timed out, no answer) before any failed vote: the members whose
  contribution never reached our own part withheld it (every member sends all its parts as the
  exchange starts, so by the time a reducer gives up they had long arrived; a request refused
  because its sender formed another group counts as sent); if none did, the
  reducers that gave us no answer at all (not a refusal: a reducer refusing because a third
  member withheld from it says so truthfully);
- no part failed of itself (the exchange completed, or a failed vote made us abandon the rest):
  the members that voted "failed" under our group's hash, and, where our exchange completed,
  those that posted no vote by the deadline.
Another member's word (its failed vote naming a reason, a reducer's refusal text) blames nobody.

A strike excludes the member for 2^(strikes-1) rounds (at most MAX_EXCLUSION_ROUNDS); every
FORGIVE_ROUNDS rounds it then completes with us take one strike away. An honest member that failed
once by bad luck is back after one round and forgiven after a few; a member that fails rounds on
purpose is out for 1, 2, 4, ... rounds and must complete FORGIVE_ROUNDS rounds for each failure it
causes to stay where it is. Replicas that saw the same failure (every member reads the same votes)
exclude the same member for the same rounds, so their groups stay equal; where their observations
differ (a part withheld from one reducer only) their groups differ and that round fails for them,
as it would have anyway.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable, Mapping

MAX_EXCLUSION_ROUNDS = 64
"""The longest exclusion: a member that fails rounds for good is tried again this often."""
FORGIVE_ROUNDS = 8
"""Rounds a member must complete with us to have one strike forgotten."""


@dataclass(frozen=True)
class Standing:
    """What this replica holds against one peer."""
    strikes: int = 0
    until: int = -1
    """Excluded from groups up to and including this round."""
    good: int = 0
    """Rounds completed with us since its last strike was given or forgiven."""


def blame(*, me: str, members: Collection[str], contributed: Collection[str], part_failed: bool,
          silent_reducers: Collection[str] = (), failed_votes: Collection[str] = (),
          missing_votes: Collection[str] = (), wrong_round: bool = False,
          forged: Collection[str] = ()) -> frozenset[str]:
    """The members this replica holds responsible for a failed round, from what it observed itself
    (module docstring). `contributed`: the members whose contribution reached our part;
    `part_failed`: a part failed of itself (not abandoned because of a failed vote);
    `silent_reducers`: members whose reducer gave us no answer at all; `failed_votes`: members that
    voted failed under our group's hash; `missing_votes`: members without a vote at the deadline
    (pass them only where our exchange completed); `wrong_round`: a reducer refused our part as
    being of another round than its own. That round failed because its members disagree about the
    round, not because one withheld: a replica that fell behind (a joiner whose download took
    rounds) forms its group from registrations its peers wrote before they went on alone, and would
    otherwise exclude, for growing times, exactly the replicas it needs to catch up with. Clocks and
    re-syncs settle a disagreement; nobody is blamed for it. `forged` (averaging.verify): reducers
    whose answer we showed false ourselves (a mean that is not the aggregate of the signed parts it
    came with, a part its member did not sign): they alone are blamed, since the failed votes of the
    others are their reaction to the same answer."""
    if forged:
        return frozenset((set(members) - {me}) & set(forged))
    if wrong_round:
        return frozenset()
    others = set(members) - {me}
    if part_failed:
        withheld = others - set(contributed)
        return frozenset(withheld if withheld else others & set(silent_reducers))
    return frozenset(others & (set(failed_votes) | set(missing_votes)))


def after_round(standings: Mapping[str, Standing], round_no: int, blamed: Iterable[str] = (),
                completed_with: Iterable[str] = ()) -> dict[str, Standing]:
    """The standings after round `round_no`: each blamed member gets a strike and is excluded from
    the next 2^(strikes-1) rounds; each member of a completed round moves towards forgiveness.
    Peers with nothing held against them are dropped (the state stays the size of the trouble)."""
    out = dict(standings)
    for peer in set(blamed):
        old = out.get(peer, Standing())
        strikes = old.strikes + 1
        out[peer] = Standing(strikes, round_no + min(2 ** (strikes - 1), MAX_EXCLUSION_ROUNDS), 0)
    for peer in set(completed_with) - set(blamed):
        old = out.get(peer)
        if old is None:
            continue
        good = old.good + 1
        out[peer] = Standing(old.strikes - 1, old.until, 0) if good >= FORGIVE_ROUNDS else Standing(
            old.strikes, old.until, good)
    return {p: s for p, s in out.items() if s.strikes > 0 or s.until >= round_no}


def excluded(standings: Mapping[str, Standing], round_no: int) -> frozenset[str]:
    """The peers left out of round `round_no`'s group."""
    return frozenset(p for p, s in standings.items() if s.until >= round_no)
