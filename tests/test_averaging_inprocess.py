"""Outer rounds in one event loop: several Averagers joined by an in-memory loopback RPC
(tests/support/rpc.py) and SwarmViews over an in-memory DHT (tests/support/dht.py), no
processes, no sockets, so failures land exactly where the test puts them instead of where a sleep
hopes they land."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from swarmgrad.peer.averaging.aggregate import weighted_mean
from swarmgrad.peer.averaging.averager import Averager, RoundResult
from swarmgrad.peer.averaging.group import group_hash
from swarmgrad.peer.records import FAILED
from swarmgrad.peer.clock import RoundClock
from swarmgrad.peer.manifest import Manifest
from swarmgrad.peer.decisions import nobody_applied
from swarmgrad.peer.net.dht_view import SwarmView
from swarmgrad.peer.net.rpc import RPCFailed
from swarmgrad.protocol import wire_pb2 as pb

from conftest import small_manifest
from support.dht import MemoryDHT, announce, swarm_view
from support.rpc import LoopbackNetwork
from support.swarm import peer_ids

pytestmark = [pytest.mark.timeout(60), pytest.mark.inprocess]

PEERS = sorted(peer_ids(4, "averaging"))
"""Ed25519 peer ids (the records accept no other), in the order of the parts they reduce."""
SHAPES = {"w": (64, 64), "v": (4096 + 8,), "b": (16,)}
STAGE = 1


class Stage:
    """The stage's replicas as the DHT holds them: each member's own view, and its record."""

    def __init__(self, m: Manifest, members: list[str]):
        self.dht = MemoryDHT()
        self.views: dict[str, SwarmView] = {p: swarm_view(self.dht, p, m) for p in members}

    async def online(self, peer: str, applied_rounds: int = 0) -> None:
        """`peer`'s record says ONLINE, with `applied_rounds` rounds applied."""
        await announce(self.views[peer], STAGE, applied_rounds=applied_rounds)

    async def registrations(self, round_no: int) -> dict[str, dict]:
        return await next(iter(self.views.values())).round_registrations(STAGE, round_no)

    async def votes(self, round_no: int) -> dict[str, str]:
        return await next(iter(self.views.values())).round_checks(STAGE, round_no)


def manifest(codec: str = "fp32", ef: bool = False, robust: int = 3) -> Manifest:
    return small_manifest(averaging={"codec": codec, "error_feedback": ef, "robust_min_members": robust},
                          timeouts={"matchmaking": 0.5, "allreduce": 1.5})


async def group(n: int, m: Manifest, online: int | None = None) -> tuple[LoopbackNetwork, Stage, list[Averager]]:
    """`n` averagers of stage 1, the first `online` of them (default all) announced ONLINE."""
    net, stage = LoopbackNetwork(), Stage(m, PEERS[:n])
    averagers = []
    for peer in PEERS[:n]:
        clock = RoundClock(m.rounds, counts_steps=False, max_rounds=0, epoch=None)
        avg = Averager(m, STAGE, peer, SHAPES, net.rpc(peer), stage.views[peer], 1 << 24, clock)  # type: ignore[arg-type]
        net.handlers[peer] = avg.reducer.handle
        averagers.append(avg)
    for peer in PEERS[:n if online is None else online]:
        await stage.online(peer)
    return net, stage, averagers


def deltas(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    common = torch.Generator().manual_seed(999)
    return {n: scale * (torch.randn(s, generator=common) + 0.3 * torch.randn(s, generator=g)) for n, s in SHAPES.items()}


async def run_all(averagers: list[Averager], inputs: list[dict[str, torch.Tensor]], weights: list[float],
                  round_no: int = 0) -> list[RoundResult]:
    return await asyncio.gather(*(a.run_round(round_no, d, w, "digest", 0) for a, d, w in zip(averagers, inputs, weights)))


def test_three_members_agree_on_the_weighted_mean() -> None:
    async def main() -> None:
        _, _, avgs = await group(3, manifest())
        inputs, weights = [deltas(i) for i in range(3)], [10.0, 20.0, 30.0]
        results = await run_all(avgs, inputs, weights)
        assert all(r.complete for r in results), [r.reason for r in results]
        assert {r.total_weight for r in results} == {60.0}
        for r in results:  # where the round's time went (the round event's matchmaking_s, exchange_s, vote_s)
            assert set(r.phases) == {"matchmaking", "exchange", "vote"} and min(r.phases.values()) >= 0, r.phases
        for name in SHAPES:
            ref = weighted_mean([(w, d[name]) for w, d in zip(weights, inputs)])
            for r in results:
                assert torch.equal(r.mean_delta[name], results[0].mean_delta[name]), "members must agree bit for bit"
                assert torch.allclose(r.mean_delta[name], ref, atol=1e-5)
    asyncio.run(main())


def test_a_member_that_dies_mid_round_fails_the_round_for_everyone() -> None:
    async def main() -> None:
        net, swarm, avgs = await group(3, manifest())
        dying = avgs[2]
        await dying.matchmake(0, {"digest": "digest", "applied_rounds": 0, "weight": 5.0})  # it registered...
        net.dead.add(dying.peer_id)  # ...then vanished before sending or reducing anything
        results = await run_all(avgs[:2], [deltas(0), deltas(1)], [5.0, 5.0])
        assert not any(r.complete for r in results), "nobody may apply a partial mean"
        assert all(r.mean_delta is None for r in results)
        # a re-sync must not wait for the dead: both survivors voted the round failed, so the votes
        # say nobody applied it (before the votes: it skipped members listed as unreachable)
        votes = await swarm.votes(0)
        assert {p: v.split(":")[1] for p, v in votes.items()} == {a.peer_id: FAILED for a in avgs[:2]}, votes
        assert all(nobody_applied(votes, a.peer_id, group_hash(r.group), r.voted_digest) for a, r in zip(avgs, results))
    asyncio.run(main())


def test_a_member_killed_between_the_exchange_and_its_vote_fails_the_round_at_once() -> None:
    """Seen in the chaos soak: a member SIGKILLed after it had reduced and received its parts never
    voted, and the other two waited out timeouts.allreduce (8.4 s there, 20 s by default) for its
    vote. They hold no connection to it any more, so they fail the round as soon as they see that,
    and their re-sync does not wait for it (it is listed as unreachable)."""
    async def main() -> None:
        m = manifest().replace(timeouts={"allreduce": 30.0})  # a wait for the vote would fail the test's timeout
        net, swarm, avgs = await group(3, m)
        dying = avgs[2]
        view = swarm.views[dying.peer_id]

        class KilledAtItsVote:  # the DHT as the dying member sees it: it dies as it is about to vote
            def __getattr__(self, name: str) -> Any:
                return getattr(view, name)

            async def post_check(self, stage: int, round_no: int, peer_id: str, digest: str) -> bool:
                net.dead.add(peer_id)
                await asyncio.sleep(3600)
                return False

        dying.swarm = KilledAtItsVote()  # type: ignore[assignment]
        survivors = asyncio.gather(*(a.run_round(0, deltas(i), 1.0, "digest", 0) for i, a in enumerate(avgs[:2])))
        killed = asyncio.ensure_future(dying.run_round(0, deltas(2), 1.0, "digest", 0))
        results = await asyncio.wait_for(survivors, 10.0)
        killed.cancel()
        await asyncio.gather(killed, return_exceptions=True)
        for r in results:
            assert not r.complete and "left before voting" in r.reason, r.reason
            assert r.voted_digest and r.unreachable == (dying.peer_id,)
        votes = await swarm.votes(0)
        assert set(votes) == {a.peer_id for a in avgs[:2]}, "the dying member posted nothing"
    asyncio.run(main())


def test_failed_round_restores_error_feedback_residuals() -> None:
    async def main() -> None:
        net, _, avgs = await group(2, manifest(codec="int8", ef=True))
        first = await run_all(avgs, [deltas(0), deltas(1)], [1.0, 1.0], round_no=0)
        assert all(r.complete for r in first)
        before = avgs[0].feedback.state_dict()
        assert before, "int8 leaves residuals behind"
        avgs[0].reducer.clock.current = avgs[1].reducer.clock.current = 1
        await avgs[1].matchmake(1, {"digest": "digest", "applied_rounds": 0, "weight": 1.0})
        net.dead.add(avgs[1].peer_id)  # registered for round 1, then gone
        failed = await avgs[0].run_round(1, deltas(2), 1.0, "digest", 0)
        assert not failed.complete
        assert set(failed.phases) == {"matchmaking", "exchange", "vote"}, failed.phases  # it voted "failed"
        after = avgs[0].feedback.state_dict()
        assert after.keys() == before.keys()
        for name in before:
            assert torch.equal(after[name], before[name]), "a failed round's Δ must not stay in the residual"
    asyncio.run(main())


def test_a_stale_member_keeps_its_residuals_though_it_encoded_during_matchmaking() -> None:
    """Δ is encoded while matchmaking runs; a member that then finds itself stale (another θ_global
    is the group's reference) must get its residuals back as they were before that encode."""
    async def main() -> None:
        _, _, avgs = await group(2, manifest(codec="int8", ef=True))
        first = await run_all(avgs, [deltas(0), deltas(1)], [1.0, 1.0], round_no=0)
        assert all(r.complete for r in first)
        before = avgs[0].feedback.state_dict()
        avgs[0].reducer.clock.current = avgs[1].reducer.clock.current = 1
        await avgs[1].matchmake(1, {"digest": "newer", "applied_rounds": 5, "weight": 1.0})
        stale = await avgs[0].run_round(1, deltas(2), 1.0, "digest", 0)
        assert not stale.complete and stale.stale, stale.reason
        assert set(stale.phases) == {"matchmaking"}, stale.phases
        await asyncio.sleep(0.2)  # an encode still running would write its residuals by now
        after = avgs[0].feedback.state_dict()
        assert after.keys() == before.keys()
        assert all(torch.equal(after[n], before[n]) for n in before), "the stale round's Δ stayed in the residual"
    asyncio.run(main())


def test_a_member_that_finished_the_round_without_us_makes_us_stale_at_once() -> None:
    """A joiner whose donor completed the round alone (a group of one posts no outcome vote) used
    to fail the round with GROUP_MISMATCH, conclude that nobody applied it, and fail the next one as
    stale; now its matchmaking sees the donor's record announce the round applied."""
    async def main() -> None:
        _, swarm, avgs = await group(2, manifest())
        donor, joiner = avgs
        await donor.matchmake(1, {"digest": "digest", "applied_rounds": 0, "weight": 1.0})  # registered, then
        await swarm.online(donor.peer_id, applied_rounds=1)  # ...completed round 1 alone and announced it
        result = await joiner.run_round(1, deltas(0), 1.0, "digest", 0)
        assert not result.complete and result.stale, result.reason
        assert "already applied this round without us" in result.reason and donor.peer_id[-8:] in result.reason
        assert set(result.phases) == {"matchmaking"}, result.phases  # no exchange was attempted
        await swarm.online(donor.peer_id)  # the same registrations, the donor still matching: a normal round
        group_, _, superseded = await joiner.matchmake(1, {"digest": "digest", "applied_rounds": 0, "weight": 1.0})
        assert group_ is not None and set(group_.members) == {donor.peer_id, joiner.peer_id} and superseded == ""
    asyncio.run(main())


def test_the_last_members_request_wakes_a_member_waiting_in_matchmaking(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first member at the boundary polls the registrations; the last one sends its part as
    soon as its own matchmaking ends, and that request ends the first one's wait (with a poll
    interval of a minute, only the request can end it within the test's deadline)."""
    import itertools
    import swarmgrad.peer.averaging.matchmaking as matchmaking
    monkeypatch.setattr(matchmaking, "poll_intervals", lambda cap: itertools.repeat(60.0))

    async def main() -> None:
        _, swarm, avgs = await group(2, manifest())
        for a in avgs:
            a.patience = 120.0  # matchmaking's own deadline must not end the wait either
        first = asyncio.ensure_future(avgs[0].run_round(0, deltas(0), 1.0, "digest", 0))
        while not await swarm.registrations(0):  # until the first member registered and is waiting
            await swarm.dht.next_store()
        results = await asyncio.wait_for(asyncio.gather(first, avgs[1].run_round(0, deltas(1), 1.0, "digest", 0)), 20)
        assert all(r.complete for r in results), [r.reason for r in results]
    asyncio.run(main())


def test_the_first_member_sends_its_parts_to_last_rounds_group_while_it_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a complete round, a member that reaches the next boundary first sends its part to
    last round's group while it waits; the reducer holds it until its own matchmaking is done, and
    the round's mean is the same as without the early send."""
    early_senders: list[str] = []
    send_early = Averager._send_early

    async def counted(self: Averager, *args: Any) -> Any:
        early_senders.append(self.peer_id)
        return await send_early(self, *args)
    monkeypatch.setattr(Averager, "_send_early", counted)

    async def main() -> None:
        _, _, avgs = await group(2, manifest(codec="int8", ef=True))
        first = await run_all(avgs, [deltas(0), deltas(1)], [1.0, 3.0], round_no=0)
        assert all(r.complete for r in first) and early_senders == []  # no last round to send to early
        inputs = [deltas(2), deltas(3)]
        waiting = asyncio.ensure_future(avgs[0].run_round(1, inputs[0], 1.0, "digest", 0))
        async def early_part_arrived() -> None:  # its arrival made the slot: avgs[1] has not begun round 1
            while 1 not in avgs[1].reducer.slots:
                await asyncio.sleep(0.01)
        await asyncio.wait_for(early_part_arrived(), 10)
        assert not avgs[1].reducer.slots[1].ready.is_set() and not waiting.done()
        results = await asyncio.gather(waiting, avgs[1].run_round(1, inputs[1], 3.0, "digest", 0))
        assert all(r.complete for r in results), [r.reason for r in results]
        # the last to arrive sent its parts early too, while its own matchmaking read
        assert sorted(early_senders) == sorted(a.peer_id for a in avgs)
        for name in SHAPES:
            assert torch.equal(results[0].mean_delta[name], results[1].mean_delta[name])
            # a pair counts both members at the smaller weight (aggregate.bound_weights, issue 43 point 5)
            ref = weighted_mean([(1.0, inputs[0][name]), (1.0, inputs[1][name])])
            assert torch.allclose(results[0].mean_delta[name], ref, atol=0.05 * float(ref.abs().max()))
    asyncio.run(main())


def test_parts_sent_early_to_a_group_that_changed_are_refused_and_sent_again() -> None:
    """A third replica joins: the early parts went to last round's pair under its group hash;
    the reducer refuses them, the senders send their parts for the group of three, and the mean
    is that of all three."""
    async def main() -> None:
        _, swarm, avgs = await group(3, manifest(), online=2)  # round 0: the third is not online yet
        first = await run_all(avgs[:2], [deltas(0), deltas(1)], [1.0, 1.0], round_no=0)
        assert all(r.complete for r in first) and all(len(r.group) == 2 for r in first)
        await swarm.online(PEERS[2])
        inputs, weights = [deltas(i) for i in range(3, 6)], [1.0, 2.0, 3.0]
        results = await run_all(avgs, inputs, weights, round_no=1)
        assert all(r.complete for r in results), [r.reason for r in results]
        assert all(len(r.group) == 3 for r in results)
        for name in SHAPES:
            ref = weighted_mean([(w, d[name]) for w, d in zip(weights, inputs)])
            for r in results:
                assert torch.equal(r.mean_delta[name], results[0].mean_delta[name])
                assert torch.allclose(r.mean_delta[name], ref, atol=1e-5)
    asyncio.run(main())


def test_a_byzantine_member_moves_the_mean_by_a_bounded_amount() -> None:
    async def main() -> None:
        honest = [deltas(i) for i in range(3)]
        clean = {n: weighted_mean([(1.0, d[n]) for d in honest]) for n in SHAPES}
        for bad in ({n: 100 * t for n, t in honest[0].items()}, {n: 30 * torch.randn_like(t) for n, t in honest[0].items()}):
            for robust, bound in ((3, 0.6), (0, None)):
                _, _, avgs = await group(4, manifest(robust=robust))
                results = await run_all(avgs, [*honest, bad], [1.0] * 4)
                assert all(r.complete for r in results)
                shift = sum(float((results[0].mean_delta[n] - clean[n]).pow(2).sum()) for n in SHAPES) ** 0.5
                size = sum(float(clean[n].pow(2).sum()) for n in SHAPES) ** 0.5
                if bound is not None:
                    assert shift < bound * size, (shift, size)  # bounded: a fraction of the honest mean
                else:
                    assert shift > 2 * size, "without the robust aggregate the bad member dominates (guard)"
    asyncio.run(main())


def test_a_reducer_sending_different_bytes_is_caught() -> None:
    async def main() -> None:
        net, _, avgs = await group(3, manifest())
        cheat = avgs[0]

        async def two_faced(request: pb.AverageRequest, caller: str) -> pb.AverageResponse:
            resp = await cheat.reducer.handle(request, caller)
            if caller == avgs[2].peer_id and resp.status == pb.OK:  # a different mean for one member only
                fp32 = resp.tensors[0].tensor
                data = bytearray(fp32.buffers[0])
                data[0] ^= 0x01
                fp32.buffers[0] = bytes(data)
            return resp

        net.handlers[cheat.peer_id] = two_faced
        results = await run_all(avgs, [deltas(i) for i in range(3)], [1.0] * 3)
        assert not any(r.complete for r in results), [r.reason for r in results]
        assert any("cross-check" in r.reason for r in results)
    asyncio.run(main())


def test_a_contribution_claiming_more_weight_than_registered_is_refused() -> None:
    async def main() -> None:
        net, _, avgs = await group(2, manifest())
        liar = avgs[1]
        real_call = liar.rpc.call

        async def inflate(peer: str, method: str, request: Any, response_type: type, timeout: float) -> Any:
            request.weight = 1e9  # registered 1, claims a billion
            return await real_call(peer, method, request, response_type, timeout)

        liar.rpc.call = inflate  # type: ignore[method-assign]
        results = await run_all(avgs, [deltas(0), deltas(1)], [1.0, 1.0])
        assert not any(r.complete for r in results)
    asyncio.run(main())


def test_reducer_feedback_keeps_members_identical_and_loses_nothing() -> None:
    """averaging.reducer_feedback with a 1-bit sign codec: over rounds every member applies the same
    bytes, each answer is the members' codec (as small as a contribution), and what the reducers
    dropped is in their residuals: Σ applied means + reducer residuals = Σ means of what members sent."""
    spec = "chunktopk:chunk=512,k=512,bits=1"
    m = small_manifest(averaging={"codec": spec, "error_feedback": True, "reducer_feedback": True,
                                  "robust_min_members": 3}, timeouts={"matchmaking": 0.5, "allreduce": 1.5})

    async def main() -> None:
        _, _, avgs = await group(3, m)
        applied = {n: torch.zeros(s) for n, s in SHAPES.items()}
        sent = {n: torch.zeros(s) for n, s in SHAPES.items()}
        for round_no in range(4):
            for a in avgs:
                a.reducer.clock.current = round_no
            inputs = [deltas(10 * round_no + i) for i in range(3)]
            residuals_before = [a.feedback.state_dict() for a in avgs]
            results = await run_all(avgs, inputs, [1.0, 1.0, 1.0], round_no=round_no)
            assert all(r.complete for r in results), [r.reason for r in results]
            for name in SHAPES:
                assert all(torch.equal(r.mean_delta[name], results[0].mean_delta[name]) for r in results)
                applied[name] += results[0].mean_delta[name]
                # what each member's codec sent this round: its input + old residual − new residual
                contributions = [inputs[i][name] + residuals_before[i].get(name, 0) - avgs[i].feedback.residual(name)
                                 for i in range(3)]
                sent[name] += weighted_mean([(1.0, c) for c in contributions])
        for name in SHAPES:
            left = sum(r for a in avgs if (r := a.reducer.feedback.residual(name)) is not None)
            assert torch.allclose(applied[name] + left, sent[name], atol=1e-4), name
        assert avgs[0].mean_codecs == avgs[0].reducer.allowed_codecs == {"chunktopk", "fp32"}
    asyncio.run(main())


def lose_answer_to(net: LoopbackNetwork, reducer: Averager, victim: Averager) -> None:
    """The reducer serves `victim` in full, but the answer never arrives (a stream reset after the
    reducer wrote it: the victim sees its stream end without a response)."""
    async def lossy(request: pb.AverageRequest, caller: str) -> pb.AverageResponse:
        resp = await reducer.reducer.handle(request, caller)
        if caller == victim.peer_id:
            raise RPCFailed(f"average to {reducer.peer_id}: no answer, the stream ended (request sent, 0 response "
                            "bytes, 0.01s after the stream opened): the peer stopped or the stream was reset")
        return resp

    net.handlers[reducer.peer_id] = lossy


@pytest.mark.parametrize("n", [2, 3])
def test_a_lost_answer_fails_the_round_for_every_member(n: int) -> None:
    """A split outcome was possible: the reducer completed the round and applied it while the member
    whose answer was lost failed it (θ_global diverged until a later re-sync). The outcome vote
    makes every member fail it, at once (a failed vote, not a wait for a missing vote)."""
    async def main() -> None:
        net, swarm, avgs = await group(n, manifest())
        lose_answer_to(net, avgs[0], avgs[1])
        results = await run_all(avgs, [deltas(i) for i in range(n)], [1.0] * n)
        assert not any(r.complete for r in results), [r.reason for r in results]
        assert "stream ended" in results[1].reason
        others = [r for i, r in enumerate(results) if i != 1]
        assert all("voted the round failed" in r.reason for r in others), [r.reason for r in others]
        votes = await swarm.votes(0)
        assert votes[avgs[1].peer_id].endswith(f":{FAILED}")
        # and every member knows nobody applied it: no re-sync waits for a donor that cannot exist
        assert all(nobody_applied(votes, a.peer_id, group_hash(r.group), r.voted_digest) for a, r in zip(avgs, results))
    asyncio.run(main())


def test_a_member_that_voted_its_digest_but_could_not_read_the_votes_looks_for_donors() -> None:
    """The two-generals remainder: a member that voted the mean's digest and then could not read
    every vote fails, while the others (who read all votes) apply. It knows (voted_digest), so its
    re-sync looks for them instead of concluding that nobody applied."""
    async def main() -> None:
        _, swarm, avgs = await group(2, manifest())
        blind = avgs[1]
        view = swarm.views[blind.peer_id]

        async def blind_checks(stage: int, round_no: int) -> dict[str, str]:
            raise TimeoutError("DHT get timed out")

        class BlindView:  # the same DHT, but this member cannot read the votes
            def __getattr__(self, name: str) -> Any:
                return blind_checks if name == "round_checks" else getattr(view, name)

        blind.swarm = BlindView()  # type: ignore[assignment]
        results = await run_all(avgs, [deltas(0), deltas(1)], [1.0, 1.0])
        assert results[0].complete, results[0].reason
        assert not results[1].complete and results[1].voted_digest
        votes = await swarm.votes(0)
        assert not nobody_applied(votes, blind.peer_id, group_hash(results[1].group), results[1].voted_digest)
    asyncio.run(main())
