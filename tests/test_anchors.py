"""Anchors: voices the run's owner vouches for (docs/trust.md, "Anchors: voices the owner vouches
for"; peer/net/vouchers.py, peer/evidence.py `Evidence.anchors`).

Three gaps that voices earned by rounds cannot close, because nobody has a voice yet: (a) a stage
before its first averaged round, (b) a newcomer with no evidence (its donors and the run's epoch),
(c) a stage of two replicas with one hostile admitted id. Each test below shows the attack
working without an anchor and failing with one anchor present; a stage without an anchor decides
as before (the existing tests of tests/test_trust_evidence.py and tests/test_decisions.py)."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest


from swarmgrad.peer import decisions
from swarmgrad.peer.averaging.group import choose_group
from swarmgrad.peer.evidence import NO_EVIDENCE, Evidence, EvidenceLedger, quorum
from swarmgrad.peer.records import JOINING, PeerRecord

from support.records import rec


def anchor(record: PeerRecord) -> PeerRecord:
    """`record` as a reader that checked its owner's voucher reads it."""
    return dataclasses.replace(record, vouched=True)


def reg(digest: str, applied: int) -> dict:
    return {"digest": digest, "applied_rounds": applied, "weight": 1.0}


SEEDED = Evidence(1, {}, corroborated_round=0)
"""A replica at the seed of a stage that never averaged: a position, no voices."""
SYBILS = [f"sybil{i}" for i in range(5)]


# ---------------------------------------------------------------------------- evidence itself
def test_an_anchor_has_a_voice_only_where_its_online_record_is() -> None:
    records = [anchor(rec("owner")), rec("h")]
    ev = NO_EVIDENCE.among(records)
    assert ev.voiced and ev.voice("owner") == 1 and ev.voice("h") == 0 and ev.weight("h") == 0
    assert ev.credible(1, "owner") and ev.among([rec("h")]).anchors == frozenset()  # its record gone: no voice
    assert not NO_EVIDENCE.among([anchor(rec("owner", state=JOINING)), rec("h")]).voiced
    assert NO_EVIDENCE.among([rec("h")]) is NO_EVIDENCE  # no anchor: the same evidence, today's rules


def test_a_stage_whose_anchor_is_not_online_decides_by_ids_as_before() -> None:
    # an anchor still downloading must not silence the stage: quorum with no weight would be None forever
    records = [anchor(rec("owner", state=JOINING)), rec("a", digest="d"), rec("b", digest="d")]
    q = quorum(records, NO_EVIDENCE.among(records), exclude=("new",))
    assert q is not None and q.digest == "d"


# ---------------------------------------------------- (a) a stage before its first averaged round
def test_a_sybil_group_at_the_seed_is_no_group_with_an_anchor_in_the_stage() -> None:
    regs = {"h1": reg("seed", 0), "h2": reg("seed", 0), **{s: reg("evil", 0) for s in SYBILS}}
    records = [rec("h1", digest="seed"), rec("h2", digest="seed")] + [rec(s, digest="evil") for s in SYBILS]
    without = choose_group(regs, SEEDED.among(records), me="h1")
    assert without is not None and without.digest == "evil"  # today: five ids outnumber two replicas

    records.append(anchor(rec("owner", digest="seed")))
    g = choose_group({**regs, "owner": reg("seed", 0)}, SEEDED.among(records), me="h1")
    assert g is not None and g.digest == "seed" and set(g.members) == {"h1", "h2", "owner"}
    # the anchor did not register this round (it lags): the ids are still nobody's group
    g = choose_group(regs, SEEDED.among(records), me="h1")
    assert g is not None and g.members == ("h1", "h2")


def test_a_stale_replica_before_the_first_round_takes_no_state_the_sybils_serve() -> None:
    records = [rec("me", digest="seed"), rec("h2", digest="seed")] + [rec(s, digest="evil") for s in SYBILS]
    # our state was not the group's reference: the group was the sybils'
    assert decisions.resync_donors(records, "me", 0, SYBILS, stale=True, evidence=SEEDED.among(records)) == SYBILS
    records.append(anchor(rec("owner", digest="seed")))
    assert decisions.resync_donors(records, "me", 0, SYBILS, stale=True, evidence=SEEDED.among(records)) == []
    # the anchor went ahead in a group we missed: its state is the one to take, and only its
    records[-1] = anchor(rec("owner", applied=1, digest="next"))
    assert decisions.resync_donors(records, "me", 0, SYBILS + ["owner"], stale=True,
                                   evidence=SEEDED.among(records)) == ["owner"]


# ---------------------------------------------------------------- (b) a newcomer with no evidence
def test_a_newcomer_counts_the_anchors_voices_not_ids_for_its_donors() -> None:
    records = [rec("h1", digest="d"), rec("h2", digest="d")] + [rec(s, digest="evil") for s in SYBILS]
    assert decisions.join_donors(records, "new", NO_EVIDENCE.among(records)) == SYBILS  # today
    records.append(anchor(rec("owner", digest="d")))
    assert decisions.join_donors(records, "new", NO_EVIDENCE.among(records)) == ["h1", "h2", "owner"]
    # a superseded join follows the anchors' state too
    assert decisions.join_superseded([*records[:-1], anchor(rec("owner", applied=1, digest="d"))], "new", 0,
                                     NO_EVIDENCE.among(records)) == ["h1", "h2", "owner"]


def test_a_newcomer_takes_the_anchors_epoch_not_the_sybils(inprocess) -> None:
    from support.dht import MemoryDHT, announce
    from support.swarm import peer_ids, peer_keys
    from swarmgrad.peer.net.dht_view import SwarmView
    from swarmgrad.peer.net.identity import fingerprint
    from swarmgrad.peer.net.vouchers import OwnVoucher

    owner_key = peer_keys(1, "epoch-owner")[0]
    run = f"tiny@{fingerprint(owner_key)}"
    honest, sybils, newcomer = peer_ids(2, "epoch-honest"), peer_ids(5, "epoch-sybils"), peer_ids(1, "epoch-new")[0]

    async def main(with_anchor: bool) -> float:
        dht = MemoryDHT()
        view = {p: SwarmView(dht.node(p), run, "h", 1, 5.0, 30.0) for p in honest + sybils + [newcomer]}
        if with_anchor:
            view[honest[0]].own_voucher = OwnVoucher(owner_key=owner_key, run_id=run, peer_id=honest[0])
        for p in honest:
            await announce(view[p], 0)
            await view[p].refresh_epoch(1000.0)
        for p in sybils:
            await announce(view[p], 0)
            await view[p].refresh_epoch(10.0)
        return await view[newcomer].epoch()

    assert inprocess(lambda: main(False)) == 10.0
    assert inprocess(lambda: main(True)) == 1000.0


# ------------------------------------------- (c) a stage of two with one hostile admitted id
def test_a_hostile_replica_of_a_pair_cannot_hand_its_state_over_an_anchor() -> None:
    ledger = EvidenceLedger(stage=1)
    for r in range(3):
        ledger.applied(r, ("me", "hostile"), 3 + r)
    ev = ledger.snapshot()  # the hostile replica earned its voice: it did the rounds
    pair = [rec("me", applied=5, digest="d"), rec("hostile", applied=6, digest="evil")]
    # we failed a round; the hostile one claims it applied it: today we take its state
    assert decisions.resync_donors(pair, "me", 5, ("me", "hostile"), stale=False, evidence=ev.among(pair)) == ["hostile"]
    stage = pair + [anchor(rec("owner", applied=5, digest="d"))]  # the owner's peer did not apply it either
    assert decisions.resync_donors(stage, "me", 5, ("me", "hostile", "owner"), stale=False,
                                   evidence=ev.among(stage)) == []
    # the owner's peer applied the round: its state, not the hostile one's
    stage[-1] = anchor(rec("owner", applied=6, digest="next"))
    assert decisions.resync_donors(stage, "me", 5, ("me", "hostile", "owner"), stale=False,
                                   evidence=ev.among(stage)) == ["owner"]
    # an anchor behind us says nothing of this round: the rule of a stage without one
    stage[-1] = anchor(rec("owner", applied=4, digest="old"))
    assert decisions.resync_donors(stage, "me", 5, ("me", "hostile"), stale=False,
                                   evidence=ev.among(stage)) == ["hostile"]
    stage[-1] = anchor(rec("owner", applied=5, digest="d"))
    # the hostile one registers the round after ours: with one voice each, its claim of one round more wins
    regs = {"me": reg("d", 5), "hostile": reg("evil", 6)}
    g = choose_group(regs, ev.among(pair), me="me")
    assert g is not None and g.members == ("hostile",)  # today: we are stale, and re-sync from its group
    g = choose_group({**regs, "owner": reg("d", 5)}, ev.among(stage), me="me")
    assert g is not None and g.members == ("me", "owner") and g.digest == "d"
    # and a newcomer's donors are no longer a tie of the pair
    assert decisions.join_donors(pair, "new") == []
    assert decisions.join_donors(stage, "new", NO_EVIDENCE.among(stage)) == ["me", "owner"]


# ------------------------------------------------------------- real peers under a flood, before round one
def _flood_before_the_first_round(anchored: bool):  # type: ignore[no-untyped-def]
    """An honest pair of a one-stage public run, under twenty fresh ids that announce ONLINE records
    with a digest of their own at the first peer's position, register for every coming round there
    (ten to one against the pair) and serve a state of their own, from before the pair's first
    averaged round. `anchored`: the first peer is the owner's (`--owner-key`: it vouches for itself).
    The scenario returns what the honest peers saw."""
    from support.hostile import Forgers, forged_state
    from support.swarm import InProcessSwarm, peer_keys, step_manifest
    from swarmgrad.peer.net.identity import fingerprint
    from swarmgrad.peer.public.signed_manifest import public_manifest

    owner = peer_keys(1, "flood-owner")[0]
    m = public_manifest(step_manifest(2, stages={"count": 1}), fingerprint(owner))

    async def scenario() -> dict:
        async with InProcessSwarm(m) as swarm:
            a = swarm.start(0, owner_key=owner if anchored else None)
            await swarm.until(lambda: bool(a.events("online")), 30, "the first peer online")
            sybils = Forgers(swarm, 20, "seed-flood")
            evil = forged_state(swarm, 0, applied_rounds=0, round_no=0)
            await sybils.serve_state(0, evil)

            async def flood() -> None:
                rounds = a.events("round")
                applied, next_round = (rounds[-1]["applied_rounds"], rounds[-1]["round"] + 1) if rounds else (0, 0)
                await sybils.announce(0, applied_rounds=applied, digest=evil.digest, round_no=next_round, driver=True)
                await sybils.register(0, range(next_round, next_round + 4), applied_rounds=applied,
                                      digest=evil.digest, weight=1e9)

            await flood()
            b = swarm.start(0)
            attacking = asyncio.create_task(_repeat(flood, 0.1))

            def settled() -> bool:
                online = [e["time"] for e in b.events("online")]
                after = [e for e in a.events("round") if e["complete"] and online and e["time"] > online[0]]
                return len(after) >= 4 and bool(b.events("round"))
            try:
                await swarm.until(lambda: settled() or any(
                    e["digest"] == evil.digest for p in (a, b) for e in p.events("round")), 60,
                    "four complete rounds of the first peer after the second came online, or one on the sybils' state")
            except AssertionError:
                pass  # without an anchor the pair may complete no round: what it saw is the answer
            finally:
                attacking.cancel()
                await asyncio.gather(attacking, return_exceptions=True)
                await sybils.close()
            return {"evil": evil.digest, "sybils": set(sybils.ids), "ids": (a.peer_id, b.peer_id),
                    "rounds": [e for p in (a, b) for e in p.events("round")],
                    "resynced": [e for p in (a, b) for e in p.events("resynced")], "peers": (a, b)}

    return scenario


async def _repeat(step, pause: float) -> None:  # type: ignore[no-untyped-def]
    while True:
        await step()
        await asyncio.sleep(pause)


@pytest.mark.timeout(120)
def test_a_flood_before_the_first_round_leaves_an_anchored_stage_as_it_is(inprocess) -> None:
    """With one anchor (the owner's peer) in the stage, twenty voiceless ids at its position are no
    group and no donor: the stage trains on its own digests, the second peer joins the anchor's
    state and averages with nobody else. Without the anchor (`_flood_before_the_first_round(False)`,
    run by hand) the second peer joins from the sybils' state, and the first one's rounds wait for
    the sybils' group. (Whether the second peer, an
    unvouched volunteer, averages with the anchor in every round is the flood rule's race,
    matchmaking.waited_for: under a flood the anchor waits only for the voiced.)"""
    seen = inprocess(_flood_before_the_first_round(anchored=True), timeout=110)
    a, b = seen["peers"]
    complete = [e for e in seen["rounds"] if e["complete"]]
    assert len([e for e in a.events("round") if e["complete"]]) >= 4
    assert all(e.get("digest") != seen["evil"] for p in (a, b) for e in p.events())
    assert all(set(e["group"]) <= set(seen["ids"]) for e in complete)
    assert all(e["source"] == a.peer_id for e in b.events("state_loaded") + b.events("resynced")), b.events()
    assert not a.events("resynced") and not a.events("state_loaded")
    pairs: dict[int, set[str]] = {}
    for e in complete:
        if e["group_size"] == 2:
            pairs.setdefault(e["round"], set()).add(e["digest"])
    assert all(len(d) == 1 for d in pairs.values()), pairs  # a round the pair averaged: one state
