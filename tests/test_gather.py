"""The gather exchange (averaging.gather_up_to, peer/averaging/gather.py): small groups exchange the members'
own encoded parts and every member aggregates them itself. In one event loop, with the loopback
RPC and fake swarm of test_averaging_inprocess; the response checks without any network; a swarm
of real peers in one event loop (tests/support/swarm.py)."""
from __future__ import annotations

import asyncio
import math

import pytest
import torch

from swarmgrad.compression import get_codec
from swarmgrad.peer.averaging.aggregate import reduce_part, weighted_mean
from swarmgrad.peer.averaging.group import partition
from swarmgrad.peer.averaging.gather import gather_answer, gathers
from swarmgrad.peer.manifest import ManifestError
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.framing import ProtocolError
from swarmgrad.protocol.responses import validate_gather_response
from swarmgrad.protocol.validation import decode_tensor, encoded_to_proto

from conftest import small_manifest
from support.swarm import InProcessSwarm, assert_replicas_agree, complete_rounds, step_manifest
from test_averaging_inprocess import PEERS, SHAPES, deltas, group, run_all

pytestmark = pytest.mark.timeout(60)

SIGN = "chunktopk:chunk=512,k=512,bits=1"


def manifest(codec: str = SIGN, gather_up_to: int = 3, robust: int = 3, reducer_feedback: bool = False):
    return small_manifest(averaging={"codec": codec, "error_feedback": codec != "fp32", "gather_up_to": gather_up_to,
                                     "reducer_feedback": reducer_feedback, "robust_min_members": robust},
                          timeouts={"matchmaking": 0.5, "allreduce": 1.5})


def sent(avg, name: str, before: dict[str, torch.Tensor], delta: torch.Tensor) -> torch.Tensor:
    """What a member's codec delivered this round: input + old residual − new residual."""
    return delta + before.get(name, 0) - avg.feedback.residual(name)


def test_gathers_only_groups_up_to_the_limit() -> None:
    assert [gathers(n, 3) for n in (1, 2, 3, 4)] == [False, True, True, False]
    assert not gathers(2, 0)


def test_two_members_apply_the_exact_mean_of_what_they_sent_bit_identically() -> None:
    """No second encode: the applied mean is the weighted mean of the decoded 1-bit contributions,
    to the last bit, on both members, round after round (the reducer path re-encodes it: guard)."""
    async def main(m) -> list[float]:
        _, _, avgs = await group(2, m)
        errors = []
        for round_no in range(3):
            for a in avgs:
                a.reducer.clock.current = round_no
            inputs, weights = [deltas(10 * round_no + i) for i in range(2)], [3.0, 5.0]
            before = [a.feedback.state_dict() for a in avgs]
            results = await run_all(avgs, inputs, weights, round_no=round_no)
            assert all(r.complete for r in results), [r.reason for r in results]
            # a pair counts both members at the smaller weight (aggregate.bound_weights, issue 43 point 5)
            assert {r.total_weight for r in results} == {6.0}
            for name in SHAPES:
                assert torch.equal(results[0].mean_delta[name], results[1].mean_delta[name])
                ref = weighted_mean([(3.0, sent(a, name, b, d[name])) for a, b, d in zip(avgs, before, inputs)])
                errors.append(float((results[0].mean_delta[name] - ref).abs().max()))
        return errors

    assert max(asyncio.run(main(manifest()))) < 1e-6
    assert max(asyncio.run(main(manifest(gather_up_to=0, reducer_feedback=True)))) > 1e-2, \
        "guard: the reducer's own 1-bit encode of the mean differs from the mean"


def test_three_members_gather_with_the_robust_aggregate() -> None:
    """With 3 members every member runs centered clipping itself: bit-identical results, equal to
    the reducer's code on the same decoded parts, and a member sending ×100 stays bounded."""
    async def main() -> None:
        _, _, avgs = await group(3, manifest(codec="fp32"))
        honest = [deltas(i) for i in range(2)]
        bad = {n: 100 * t for n, t in deltas(2).items()}
        results = await run_all(avgs, [*honest, bad], [1.0, 1.0, 1.0])
        assert all(r.complete for r in results), [r.reason for r in results]
        ordered = sorted(zip((a.peer_id for a in avgs), [*honest, bad]))
        ref = {}
        for p in range(3):  # the robust aggregate runs per part, as a reducer would
            names = [n for n, q in partition(SHAPES, 3).items() if q == p]
            ref.update(reduce_part([(1.0, {n: d[n] for n in names}) for _, d in ordered], 3, 8.0))
        clean = {n: weighted_mean([(1.0, d[n]) for d in honest]) for n in SHAPES}
        for name in SHAPES:
            assert all(torch.equal(r.mean_delta[name], results[0].mean_delta[name]) for r in results)
            assert torch.equal(results[0].mean_delta[name], ref[name])
        shift = sum(float((results[0].mean_delta[n] - clean[n]).pow(2).sum()) for n in SHAPES) ** 0.5
        size = sum(float(clean[n].pow(2).sum()) for n in SHAPES) ** 0.5
        assert shift < 0.6 * size, (shift, size)
    asyncio.run(main())


def test_larger_groups_keep_the_reduced_mean() -> None:
    async def main() -> None:
        net, _, avgs = await group(4, manifest(codec="fp32", gather_up_to=3))
        answers = []
        handler = net.handlers[avgs[0].peer_id]

        async def spy(request, caller):
            resp = await handler(request, caller)
            answers.append(resp)
            return resp

        net.handlers[avgs[0].peer_id] = spy
        results = await run_all(avgs, [deltas(i) for i in range(4)], [1.0] * 4)
        assert all(r.complete for r in results)
        assert answers and all(len(a.tensors) and not len(a.others) for a in answers)
    asyncio.run(main())


@pytest.mark.parametrize("n", [2, 3])
def test_a_reducer_forwarding_a_different_part_to_one_member_is_caught(n: int) -> None:
    """Members compute the mean themselves, so the digest cross-check runs in pairs too."""
    async def main() -> None:
        net, _, avgs = await group(n, manifest(codec="fp32"))
        cheat = avgs[0]
        handler = net.handlers[cheat.peer_id]

        async def two_faced(request, caller):
            resp = await handler(request, caller)
            if caller == avgs[-1].peer_id and resp.status == pb.OK:
                buf = bytearray(resp.others[0].tensors[0].tensor.buffers[0])
                buf[0] ^= 0x01
                resp.others[0].tensors[0].tensor.buffers[0] = bytes(buf)
            return resp

        net.handlers[cheat.peer_id] = two_faced
        results = await run_all(avgs, [deltas(i) for i in range(n)], [1.0] * n)
        assert not any(r.complete for r in results), [r.reason for r in results]
        assert any("cross-check" in r.reason for r in results)
    asyncio.run(main())


# the response's checks, no network ----------------------------------------------------------------
EXPECTED = {"w": (8, 4)}
MEMBERS = sorted(PEERS[:3])
ME = MEMBERS[1]
WEIGHTS = {p: 10.0 for p in MEMBERS}


def part(seed: int) -> list[pb.NamedTensor]:
    t = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed))
    return [pb.NamedTensor(name="w", tensor=encoded_to_proto(get_codec("fp32").encode(t)))]


def answer() -> pb.AverageResponse:
    return gather_answer(MEMBERS, WEIGHTS, {p: part(i) for i, p in enumerate(MEMBERS)}, ME)


def check(resp: pb.AverageResponse, allowed=frozenset({"fp32"})):
    return validate_gather_response(resp, EXPECTED, MEMBERS, ME, WEIGHTS, 1 << 20, allowed)


def test_a_well_formed_answer_holds_every_other_members_part() -> None:
    got = check(answer())
    assert got.ok and [p for p, _, _ in got.others] == [MEMBERS[0], MEMBERS[2]]
    assert got.total_weight == 30.0
    assert torch.equal(got.others[1][2]["w"], decode_tensor(part(2)[0].tensor, 1 << 20))


def _mutations():
    def own_part_too(r):
        r.others.add(member=ME, weight=10.0).tensors.extend(part(9))

    def unsorted(r):
        a, b = r.others[0], r.others[1]
        r.others[0].CopyFrom(b)
        r.others[1].CopyFrom(a)

    def missing(r):
        del r.others[1]

    def heavy(r):
        r.others[0].weight = 10.5

    def nan_weight(r):
        r.others[0].weight = math.nan

    def with_mean(r):
        r.tensors.extend(part(7))

    def wrong_shape(r):
        t = torch.zeros(4, 8)
        r.others[0].tensors[0].tensor.CopyFrom(encoded_to_proto(get_codec("fp32").encode(t)))

    def wrong_contributors(r):
        r.contributors[0] = PEERS[3]

    def bad_total(r):
        r.total_weight = math.inf

    return [own_part_too, unsorted, missing, heavy, nan_weight, with_mean, wrong_shape, wrong_contributors, bad_total]


@pytest.mark.parametrize("mutate", _mutations(), ids=lambda f: f.__name__)
def test_malformed_gather_answers_are_refused(mutate) -> None:
    resp = answer()
    mutate(resp)
    with pytest.raises(ProtocolError):
        check(pb.AverageResponse.FromString(resp.SerializeToString()))


def test_a_codec_the_manifest_does_not_name_is_refused() -> None:
    with pytest.raises(ProtocolError):
        check(answer(), allowed=frozenset({"int8"}))


def test_manifest_refuses_a_gather_limit_of_one() -> None:
    with pytest.raises(ManifestError, match="gather_up_to"):
        manifest(gather_up_to=1)


# a swarm ------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_four_peers_gather_one_bit_parts_and_stay_identical(inprocess) -> None:
    """2 stages × 2 replicas, real peers in one event loop (tests/support/swarm.py), the gathered
    top-40 % sign: every complete round leaves both replicas of a stage with one digest, and
    validation loss drops. Replaces the real-process version (the same assertions; rounds of 8
    inner steps instead of 4 s of wall clock)."""
    m = step_manifest(8, averaging={"codec": "chunktopk:chunk=4096,k=1638,bits=1", "error_feedback": True,
                                    "gather_up_to": 2, "small_tensor_threshold": 0})

    async def scenario() -> None:
        async with InProcessSwarm(m) as swarm:
            await swarm.run_two_by_two(max_rounds=5, timeout=50)
            for stage in (0, 1):
                assert_replicas_agree(swarm.peers, stage)
                full = [r for r, events in complete_rounds(swarm.peers, stage).items()
                        if len(events) == 2 and all(e["group_size"] == 2 for e in events)]
                assert len(full) >= 2, f"stage {stage}: too few gathered rounds: {full}\n" + swarm.history()
            evals = sorted((e for p in swarm.peers if p.stage == 0 for e in p.events("eval") if e["val_loss"] is not None),
                           key=lambda e: e["time"])
            # the loss with 1-bit gathered parts is noisy from one eval to the next (7.08, 6.22, 6.63,
            # 7.75, 6.99 in one run), and which driver evaluates last depends on the load: the best
            # eval shows the drop, and both drivers' last evals stay well below the start
            shown = [(e["peer"][-4:], e.get("round"), round(e["val_loss"], 3)) for e in evals]
            first = evals[0]["val_loss"]
            assert min(e["val_loss"] for e in evals[1:]) < first - 1.0, shown
            last = {e["peer"]: e["val_loss"] for e in evals}
            assert len(last) == 2 and sum(last.values()) / 2 < first - 0.5, shown

    inprocess(scenario)
