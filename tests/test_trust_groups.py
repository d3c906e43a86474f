"""Group choice and re-sync against one admitted id and against voiceless floods (issue 43;
docs/trust.md, "State to adopt"): a claim one round ahead is believed only when the round's
outcome votes show it agreed with another voice (`group.corroborated_leads`), and voiceless
registrants join a voiced group only up to a cap (`group.choose_group`).

The pure decisions first, then real peers in one event loop (tests/support/swarm.py). Each swarm
test failed on the code before this change."""
from __future__ import annotations

import asyncio

import pytest

from swarmgrad.peer import decisions
from swarmgrad.peer.averaging.group import choose_group, corroborated_leads, group_hash, voiceless_cap, \
    voiceless_order, witnessed_members
from swarmgrad.peer.averaging.outcome import vote
from swarmgrad.peer.evidence import Evidence, EvidenceLedger

from support.records import rec


def reg(digest: str, applied: int, weight: float = 1.0) -> dict:
    return {"digest": digest, "applied_rounds": applied, "weight": weight}


def veterans(*peers: str, position: int = 5) -> Evidence:
    """The evidence of a replica that applied rounds with `peers` and stands at `position`."""
    ledger = EvidenceLedger(stage=1)
    for r in range(3):
        ledger.applied(r, peers, position - 2 + r)
    return ledger.snapshot()


def completed(members: tuple[str, ...], mean: str = "m") -> dict[str, str]:
    """The votes of a group of `members` that completed a round."""
    return {p: vote(group_hash(tuple(sorted(members))), mean) for p in members}


# ------------------------------------------------------------ a claim one round ahead needs a witness
def test_a_claim_one_round_ahead_is_a_lead_only_with_another_voice_in_its_completed_group() -> None:
    ev = veterans("h", "a", "w")  # h's evidence: h, a and w have voices; h stands at 5
    at5 = {p: reg("d", 5) for p in ("h", "a", "w", "s")}
    assert corroborated_leads([(completed(("a", "w")), at5)], ev) == {"a", "w"}
    # a group of the claimant with voiceless ids proves nothing, nor do votes of a group of one
    assert corroborated_leads([(completed(("a", "s")), at5)], ev) == frozenset()
    assert corroborated_leads([({"a": vote(group_hash(("a",)), "m")}, at5)], ev) == frozenset()
    # a failed vote, or a member missing, is no completed group
    assert corroborated_leads([({**completed(("a", "w")), "w": vote(group_hash(("a", "w")), None)}, at5)],
                              ev) == frozenset()
    # registered elsewhere than our position: that round did not take them from 5 to 6
    assert corroborated_leads([(completed(("a", "w")), {"a": reg("d", 4), "w": reg("d", 4)})], ev) == frozenset()
    # our own digest vote is no witness: a group of ours that completed after our wait is one we
    # apply ourselves (Averager.confirm_late), and a partner may have withheld its vote till then
    assert corroborated_leads([(completed(("h", "a")), at5)], ev, me="h") == frozenset()
    assert corroborated_leads([(completed(("h", "a", "w")), at5)], ev, me="h") == {"a", "w"}
    # any of the rounds read
    assert corroborated_leads([({}, {}), (completed(("a", "w")), at5)], ev) == {"a", "w"}


def test_a_voice_one_round_ahead_without_a_witness_is_not_believed() -> None:
    ev = veterans("h", "a")
    assert ev.credible(6, "a") and ev.leading([("a", 6)]) and not ev.leading([("a", 5), ("s", 6)])
    alone = ev.with_leads(corroborated_leads([({}, {})], ev))
    assert not alone.credible(6, "a") and alone.credible(5, "a") and alone.credible(5, "s")
    witnessed = ev.with_leads({"a"})
    assert witnessed.credible(6, "a") and not witnessed.credible(6, "s") and not witnessed.credible(7, "a")


def test_in_a_pair_the_honest_replica_that_failed_keeps_its_state_and_is_not_pulled_into_the_claim() -> None:
    """h failed round 7; a, its only partner, claims 6 applied rounds (a state of its own): no
    completed group of round 7 holds a with another voice, so h takes no donor and keeps its line."""
    ev = veterans("h", "a")
    votes = {"h": vote(group_hash(("a", "h")), None)}
    refused = ev.with_leads(corroborated_leads([(votes, {"h": reg("d", 5), "a": reg("d", 5)})], ev))
    recs = [rec("h", applied=5, digest="d"), rec("a", applied=6, digest="evil", round_no=8)]
    assert decisions.resync_donors(recs, "h", 5, group=("a", "h"), stale=False, evidence=ev) == ["a"]  # before
    assert decisions.resync_donors(recs, "h", 5, group=("a", "h"), stale=False, evidence=refused) == []
    assert decisions.resync_donors(recs, "h", 5, group=("a",), stale=True, evidence=refused) == []
    # the next round: a's registration one round ahead does not win on "most applied rounds"
    regs = {"h": reg("d", 5), "a": reg("evil", 6)}
    assert choose_group(regs, ev, me="h").members == ("a",)  # before: h was stale, and re-synced from a
    g = choose_group(regs, refused, me="h")
    assert g is not None and g.members == ("h",) and g.digest == "d"
    # a (at 6) keeps its own line too: the pair trains as two lines until a third voice arrives
    a_view = veterans("h", "a", position=6)
    assert choose_group(regs, a_view, me="a").members == ("a",)


class Board:
    """What StateSync.resync reads of the DHT (tests/test_resync.py has the fuller fake)."""

    def __init__(self, votes: dict[str, str], registrations: dict[str, dict], records: list) -> None:
        self.votes, self.registrations, self.records = votes, registrations, records

    async def round_checks(self, stage: int, round_no: int) -> dict[str, str]:
        return dict(self.votes) if round_no == 7 else {}

    async def round_registrations(self, stage: int, round_no: int) -> dict[str, dict]:
        return dict(self.registrations) if round_no == 7 else {}

    async def post_abandoned(self, stage: int, round_no: int, peer_id: str, group_hash: str) -> bool:
        return True

    async def round_abandoned(self, stage: int, round_no: int) -> dict[str, str]:
        return {}

    async def stage_records(self, stage: int) -> list:
        return list(self.records)


def resynced(board: Board, ledger: EvidenceLedger, group: tuple[str, ...]) -> list[list[str]]:
    """Run StateSync.resync for "h" after round 7 failed for it in `group`; the donors it downloaded from."""
    from types import SimpleNamespace

    from swarmgrad.peer.averaging.averager import RoundResult
    from swarmgrad.peer.manifest import TimeoutsConfig
    from swarmgrad.peer.state.phase import ReplicaPhase
    from swarmgrad.peer.state.sync import StateSync

    s = StateSync(rpc=None, swarm=board, identity=None, peer_id="h", stage=1,  # type: ignore[arg-type]
                  state=SimpleNamespace(applied_rounds=5, digest="d"), worker=None,  # type: ignore[arg-type]
                  clock=SimpleNamespace(current=8), progress=None,  # type: ignore[arg-type]
                  events=SimpleNamespace(emit=lambda *a, **k: None), phase=ReplicaPhase(),  # type: ignore[arg-type]
                  timeouts=TimeoutsConfig(matchmaking=0.5, allreduce=0.5), max_numel=0, ledger=ledger)
    downloads: list[list[str]] = []

    async def download(peers: list[str], expected: object = None, credit: object = None) -> bool:
        downloads.append(list(peers))
        return True

    s.download = download  # type: ignore[method-assign]
    asyncio.run(s.resync(7, RoundResult(False, "part 1: timed out", group, None)))
    return downloads


def test_the_resync_takes_a_witnessed_state_and_refuses_one_voices_claim() -> None:
    ledger = EvidenceLedger(stage=1)
    for r in range(3):
        ledger.applied(r, ("h", "a", "w"), 3 + r)
    ours = group_hash(("a", "h", "w"))
    at5 = {p: reg("d", 5) for p in ("h", "a", "w")}
    # a and w completed round 7 as a pair (our group of three failed): each is the other's witness
    board = Board({**completed(("a", "w")), "h": vote(ours, None)}, at5,
                  [rec("h", applied=5, digest="d"), rec("a", applied=6, digest="e", round_no=8),
                   rec("w", applied=6, digest="e", round_no=8)])
    assert resynced(board, ledger, ("a", "h", "w")) == [["a"]]
    # a stage of two: a says it applied the round h failed; nobody saw it
    pair = EvidenceLedger(stage=1)
    for r in range(3):
        pair.applied(r, ("h", "a"), 3 + r)
    board = Board({"h": vote(group_hash(("a", "h")), None)}, {p: reg("d", 5) for p in ("h", "a")},
                  [rec("h", applied=5, digest="d"), rec("a", applied=6, digest="evil", round_no=8)])
    assert resynced(board, pair, ("a", "h")) == []


def test_a_round_whose_votes_came_after_our_wait_is_applied_with_our_own_mean() -> None:
    """The two-generals case of a pair: we voted the mean, the other member's vote came after our
    wait. Its claim of one round more has no witness now (ours does not count), so we apply the
    mean we hold once the votes show every member voted it; until they do, the round failed."""
    import torch

    from swarmgrad.peer.averaging.averager import Averager, RoundResult, mean_digest
    from swarmgrad.peer.averaging.exclusion import Standing

    from swarmgrad.peer.cli.launcher import small_manifest

    class Votes:
        def __init__(self) -> None:
            self.votes: dict[str, str] = {}

        async def round_checks(self, stage: int, round_no: int) -> dict[str, str]:
            return dict(self.votes)

    mean = {"w": torch.ones(3)}
    board = Votes()
    avg = Averager(small_manifest(), 0, "h", {"w": (3,)}, rpc=None, swarm=board,  # type: ignore[arg-type]
                   max_numel=2 ** 20, clock=None)  # type: ignore[arg-type]
    failed = RoundResult(False, "outcome vote: 1 member(s) posted no vote", ("a", "h"), None, total_weight=3.0,
                         voted_digest=True, unreachable=("a",), pending=mean, blamed=("a",))
    ours = vote(group_hash(("a", "h")), mean_digest(mean))

    async def confirm(votes: dict[str, str]) -> RoundResult:
        board.votes = votes
        avg._deferred = (7, [], {})
        avg.standings = {"a": Standing(strikes=1, until=9)}  # what the failed round held against a
        return await avg.confirm_late(7, failed)

    still = asyncio.run(confirm({"h": ours}))
    assert not still.complete and still.pending is None
    late = asyncio.run(confirm({"h": ours, "a": ours}))
    assert late.complete and late.mean_delta is mean and late.total_weight == 3.0 and not late.blamed
    assert avg.standings == {} and avg._last_members == ("a", "h")  # a completed the round after all
    assert not asyncio.run(confirm({"h": ours, "a": vote(group_hash(("a", "h")), "other")})).complete


def test_one_voice_at_our_position_does_not_win_on_its_digest() -> None:
    """a registers h's position with a digest of its own that sorts first: before, h took it as the
    group (the smaller digest breaks a tie) and re-synced from a. One voice against ours decides
    nothing; two voices against two still break the tie as before, so honest lines converge."""
    regs = {"h": reg("f" * 24, 5), "a": reg("0" * 24, 5)}
    assert choose_group(regs, veterans("h", "a"), me="h").members == ("h",)
    assert choose_group(regs, veterans("h", "a"), me="a").members == ("a",)
    four = {"h": reg("f" * 24, 5), "i": reg("f" * 24, 5), "a": reg("0" * 24, 5), "b": reg("0" * 24, 5)}
    assert choose_group(four, veterans("h", "i", "a", "b"), me="h").members == ("a", "b")


def test_a_joiner_without_a_voice_of_its_own_follows_its_donor_one_round_ahead() -> None:
    """j joined from h (it credits h) and has completed no round: h's round alone moved it on. j
    has no line of its own to keep, so it follows h without a witness, as before (matchmaking and
    the re-sync read the votes only for a replica with a voice of its own)."""
    ledger = EvidenceLedger(stage=1)
    ledger.adopted(5, backers=("h",))
    ev = ledger.snapshot()
    assert ev.voice("j") == 0 and ev.credible(6, "h") and ev.leading([("h", 6)])
    assert choose_group({"j": reg("d", 5), "h": reg("e", 6)}, ev, me="j").members == ("h",)


def test_a_replica_that_failed_a_round_its_two_partners_completed_re_syncs_as_before() -> None:
    ev = veterans("h", "a", "w")
    votes = {**completed(("a", "w")), "h": vote(group_hash(("a", "h", "w")), None)}
    regs = {p: reg("d", 5) for p in ("h", "a", "w")}
    leads = ev.with_leads(corroborated_leads([(votes, regs)], ev))
    recs = [rec("h", applied=5, digest="d"), rec("a", applied=6, digest="e", round_no=8),
            rec("w", applied=6, digest="e", round_no=8)]
    assert decisions.resync_donors(recs, "h", 5, group=("a", "h", "w"), stale=False, evidence=leads) == ["a", "w"]
    g = choose_group({"h": reg("d", 5), "a": reg("e", 6), "w": reg("e", 6)}, leads, me="h")
    assert g is not None and g.members == ("a", "w")  # h is stale and re-syncs from them, as before


# ------------------------------------------------------- voiceless registrants join a voiced group up to a cap
def test_voiceless_registrants_join_a_voiced_group_only_while_the_voiced_are_a_strict_majority() -> None:
    flood = {**{p: reg("d", 5) for p in ("a", "b")}, **{f"s{i}": reg("d", 5) for i in range(10)}}
    g = choose_group(flood, veterans("a", "b"), me="a", round_no=7)
    assert g is not None and set(g.members) >= {"a", "b"} and len(g.members) == 3  # two voices, one voiceless
    assert set(g.members) - {"a", "b"} == {voiceless_order([f"s{i}" for i in range(10)], 7, "d")[0]}
    three = choose_group({**flood, "c": reg("d", 5)}, veterans("a", "b", "c"), round_no=7)
    assert three is not None and len(three.members) == 5
    # the same registrations give every member the same group; the draw changes with the round
    assert {choose_group(flood, veterans("a", "b"), me=m, round_no=7) for m in ("a", "b", g.members[-1])} == {g}
    drawn = {choose_group(flood, veterans("a", "b"), round_no=r).members for r in range(40)}
    assert len({p for members in drawn for p in members} - {"a", "b"}) == 10
    # no voices (a newcomer's, an observer's, completed_groups'), or one: everybody joins
    assert len(choose_group(flood).members) == 12
    assert len(choose_group(flood, veterans("a"), round_no=7).members) == 12
    assert voiceless_cap(0) > 100 and voiceless_cap(1) > 100 and voiceless_cap(2) == 1 and voiceless_cap(5) == 4


def test_a_lone_replica_and_its_joiners_count_alike_with_no_cap_below_two_voices() -> None:
    """A stage of one replica that never averaged (no voice in its own ledger) and two joiners
    that credit it as their donor (one voice in theirs): below two voices nobody caps, so all
    three name the same group, the joiners included."""
    lone = EvidenceLedger(stage=1)
    lone.adopted(5)  # the seed: a position, no voices
    joiner = EvidenceLedger(stage=1)
    joiner.adopted(5, backers=("h",))
    regs = {p: reg("d", 5) for p in ("h", "j1", "j2")}
    groups = {choose_group(regs, lone.snapshot(), me="h", round_no=3),
              choose_group(regs, joiner.snapshot(), me="j1", round_no=3)}
    assert len(groups) == 1 and next(iter(groups)).members == ("h", "j1", "j2")


def test_an_honest_newcomer_among_k_others_is_drawn_in_k_plus_one_over_c_rounds_on_average() -> None:
    k, rounds = 9, 2000
    regs = {**{p: reg("d", 5) for p in ("a", "b", "c")}, "newcomer": reg("d", 5),
            **{f"s{i}": reg("d", 5) for i in range(k)}}
    ev = veterans("a", "b", "c")  # three voices: two free places
    drawn = sum("newcomer" in choose_group(regs, ev, round_no=r).members for r in range(rounds))
    assert abs(drawn / rounds - 2 / (k + 1)) < 0.04


def test_two_joiners_of_a_voiced_pair_come_in_one_after_the_other_with_the_same_group_everywhere() -> None:
    """h1, h2 averaged; j1 and j2 download their state at once. Every ledger names the same group
    in each round: one joiner, then (after the round it completed) the other, so no round fails
    on groups that differ (GROUP_MISMATCH)."""
    h = EvidenceLedger(stage=1)
    for r in range(3):
        h.applied(r, ("h1", "h2"), 3 + r)
    joiner = {j: EvidenceLedger(stage=1) for j in ("j1", "j2")}
    for ledger in joiner.values():
        ledger.adopted(5, backers=("h1", "h2"))
    regs = {p: reg("d", 5) for p in ("h1", "h2", "j1", "j2")}
    first = {choose_group(regs, led.snapshot(), me=m, round_no=8) for m, led in
             [("h1", h), ("j1", joiner["j1"]), ("j2", joiner["j2"])]}
    assert len(first) == 1
    (group,) = first
    inside, outside = (("j1", "j2") if "j1" in group.members else ("j2", "j1"))
    assert outside not in group.members
    # the round completes without the other joiner; it re-syncs and credits who completed it
    h.applied(8, group.members, 6)
    joiner[inside].applied(8, group.members, 6)
    left_out = joiner[outside]
    left_out.adopted(6, backers=("h1", "h2"))
    left_out.adopted(6, witnessed_members(completed(group.members), left_out.snapshot()))
    regs = {p: reg("e", 6) for p in ("h1", "h2", "j1", "j2")}
    second = {choose_group(regs, led.snapshot(), me=m, round_no=9) for m, led in
              [("h1", h), (inside, joiner[inside]), (outside, left_out)]}
    assert len(second) == 1 and len(next(iter(second)).members) == 4


def test_a_joiner_left_out_of_full_groups_follows_its_voices_however_far_ahead() -> None:
    """j downloaded at 2 and was left out (capped) of two rounds: the stage is at 4. Anchored at 2
    it would never believe 4 and would start a line of its own with the others left out; without a
    voice of its own it has none to defend, and follows its voiced donors. Voiceless claims still
    count for nothing, and a replica with a voice keeps the bound."""
    ledger = EvidenceLedger(stage=1)
    ledger.adopted(2, backers=("h1", "h2"))
    ev = ledger.snapshot()
    regs = {"j": reg("d", 2), "k": reg("d", 2), "h1": reg("e", 4), "h2": reg("e", 4), "s": reg("evil", 2 ** 40)}
    assert choose_group(regs, ev, me="j").members == ("j", "k")  # before: a line of the left-out
    g = choose_group(regs, ev.of_replica("j"), me="j")
    assert g is not None and g.members == ("h1", "h2")
    assert veterans("h1", "h2").of_replica("h1") == veterans("h1", "h2")
    assert EvidenceLedger(stage=1).snapshot().of_replica("j").corroborated_round == -1


def test_a_capped_group_still_completes_for_placement_credit_and_witnesses() -> None:
    """completed_groups recomputes choose_group without evidence from the registrations of the
    round's voters: registrants left out by the cap post no vote, so the group that completed is
    the one it names."""
    regs = {**{p: reg("d", 5) for p in ("a", "b")}, **{f"s{i}": reg("d", 5) for i in range(6)}}
    g = choose_group(regs, veterans("a", "b"), round_no=3)
    assert g is not None and len(g.members) == 3
    from swarmgrad.peer.averaging.group import completed_voters
    assert completed_voters(completed(g.members), regs) == set(g.members)
    assert witnessed_members(completed(g.members), veterans("a", "b")) == set(g.members)
    assert witnessed_members(completed(("a", "s0")), veterans("a", "b")) == frozenset()  # one voice's group


# ---------------------------------------------------------------------------- against real peers
def _rounds(peer, after: float = 0.0) -> list[dict]:
    return [e for e in peer.events("round") if e["complete"] and e["time"] > after]


@pytest.mark.timeout(120)
def test_one_admitted_id_in_a_pair_cannot_replace_the_honest_replicas_state(inprocess) -> None:
    """A stage of two, h and a, averages until each has the other's voice; then a turns hostile
    (the test takes over its id): every round it announces and registers one applied round more
    than h, with a state of its own. Before this change h, finding itself behind a voice, re-synced
    from a every round and trained from a's state; now a's claim has no witness in the votes, and
    h keeps its own state, training alone (rounds lost, not a state replaced)."""
    from swarmgrad.peer.net.rpc import FramedRPC, Traffic, stage_namespace
    from swarmgrad.peer.pipeline.stage_server import refusal
    from swarmgrad.peer.state.sync import state_response
    from swarmgrad.protocol import wire_pb2 as pb

    from support.dht import swarm_view
    from support.hostile import Forgers, forged_state
    from support.swarm import InProcessSwarm, step_manifest

    async def scenario() -> None:
        m = step_manifest(2, stages={"count": 1})
        async with InProcessSwarm(m) as swarm:
            h, a = swarm.start(0), swarm.start(0)
            await swarm.until(lambda: min(len([e for e in _rounds(p) if e["group_size"] == 2]) for p in (h, a)) >= 2,
                              60, "two complete rounds of the pair")
            await swarm.kill(a)  # from here on a's id is the attacker's: it writes and serves what it likes
            swarm.dht.unreachable.discard(a.peer_id)
            hostile = Forgers(swarm, 0)
            hostile.ids, hostile.views = [a.peer_id], {a.peer_id: swarm_view(swarm.dht, a.peer_id, m)}
            evil = forged_state(swarm, 0, applied_rounds=0, round_no=0)
            rpc = FramedRPC(swarm.net.node(a.peer_id), stage_namespace(m.run_id, 0), Traffic(),
                            max_message_bytes=64 << 20)

            async def serve(request: pb.StateRequest, caller: object) -> pb.StateResponse:
                snap = evil.snapshot  # the claim of the moment: one round past h's
                assert snap is not None
                return state_response(snap, list(request.names) or None)

            await rpc.add_handler("state", pb.StateRequest, serve, refusal(pb.StateResponse))
            since = max(e["time"] for e in h.events("round"))
            claims: list[int] = []

            async def attack_step() -> None:
                last = h.events("round")[-1]
                claim = last["applied_rounds"] + 1
                if claim != evil.applied_rounds:
                    evil.applied_rounds = claim
                    evil.commit(last["round"] + 1)
                claims.append(claim)
                await hostile.announce(0, applied_rounds=claim, digest=evil.digest, round_no=last["round"] + 1)
                await hostile.register(0, range(last["round"] + 1, last["round"] + 3), applied_rounds=claim,
                                       digest=evil.digest, weight=1.0)

            async def attack() -> None:
                while True:
                    await attack_step()
                    await asyncio.sleep(0.05)

            attacking = asyncio.create_task(attack())
            try:
                await swarm.until(lambda: len([e for e in h.events("round") if e["time"] > since]) >= 4, 60,
                                  "four more rounds of h under attack")
                assert not attacking.done(), attacking.exception()  # it attacked all along
            finally:
                attacking.cancel()
                await asyncio.gather(attacking, return_exceptions=True)
                await rpc.remove_handlers()
            # one round ahead of h, round after round (under load the attack loop can miss one of
            # h's rounds: [3, 5] was seen; what it proves is below, over all four rounds)
            assert len(set(claims)) >= 2, claims
            assert not [e for e in h.events("resynced") if e["time"] > since], h.events("resynced")
            forged = {e["digest"] for e in h.events() if e.get("digest") and e["time"] > since} & {evil.digest}
            assert not forged, "h adopted the hostile replica's state"
            assert h.alive

    inprocess(scenario, timeout=110)


@pytest.mark.timeout(150)
def test_newcomers_join_a_voiced_pair_a_few_at_a_time_and_all_earn_their_voices(inprocess) -> None:
    """Three newcomers start at once beside a pair that has averaged. Before this change all three
    joined its next group, outnumbering the two replicas whose voices the stage had (as many fresh
    ids would); now the voiced stay a strict majority of every group, and the newcomers still come
    in and earn their voices: within a few rounds all five average as one group, and no round
    fails on groups that differ."""
    from support.swarm import InProcessSwarm, step_manifest

    async def scenario() -> None:
        m = step_manifest(2, stages={"count": 1})
        async with InProcessSwarm(m) as swarm:
            pair = swarm.start(0), swarm.start(0)
            await swarm.until(lambda: min(len([e for e in _rounds(p) if e["group_size"] == 2]) for p in pair) >= 2,
                              60, "two complete rounds of the pair")
            since = max(e["time"] for e in pair[0].events("round"))
            newcomers = [swarm.start(0) for _ in range(3)]
            await swarm.until(lambda: any(e["group_size"] == 5 for e in _rounds(pair[0], since)), 90,
                              "a complete round of all five")
            # a member has a voice once it completed a round (with anyone: a replica that re-synced
            # credits the group that completed without it)
            done = [e for p in swarm.peers for e in _rounds(p) if e["group_size"] > 1]
            for e in [e for e in _rounds(pair[0]) if e["time"] > since]:
                voiced = {m for d in done if d["round"] < e["round"] for m in d["group"]}
                fresh = set(e["group"]) - voiced
                assert len(fresh) < len(set(e["group"]) & voiced), (e["round"], len(fresh), e["group_size"])
            for p in (*pair, *newcomers):
                assert not [e for e in p.events("round") if "GROUP_MISMATCH" in e.get("reason", "")], p.name

    inprocess(scenario, timeout=140)
