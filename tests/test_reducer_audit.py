"""A hostile reducer cannot choose the mean (averaging.verify; docs/trust.md, "Reducers").

Member j of a round's group reduces part j and answers every member with the same bytes, so the
members' outcome votes agree and the round is applied whatever those bytes are: without a check,
one member of a group writes any finite values into its part of every replica's state. With
averaging.verify every member signs its parts, the reducer forwards them with its answer, and
every member recomputes the mean from them. In-process: real Averagers over a loopback RPC and an
in-memory DHT (tests/support)."""
from __future__ import annotations

import asyncio

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarmgrad.compression import get_codec
from swarmgrad.peer.averaging.averager import Averager, RoundResult
from swarmgrad.peer.averaging.reducer import Reducer, RoundSlot
from swarmgrad.peer.averaging.signed_parts import part_refusal, sign_part
from swarmgrad.peer.clock import RoundClock
from swarmgrad.peer.manifest import Manifest, ManifestError
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.validation import encoded_to_proto

from conftest import small_manifest
from support.dht import MemoryDHT, announce, swarm_view
from support.rpc import LoopbackNetwork
from support.swarm import InProcessSwarm, assert_replicas_agree, complete_rounds, peer_keys, step_manifest
from swarmgrad.peer.net.identity import peer_id_of

pytestmark = [pytest.mark.timeout(60), pytest.mark.inprocess]

KEYS = sorted(peer_keys(4, "reducer-audit"), key=peer_id_of)
"""Members in the order of the parts they reduce."""
SHAPES = {"w": (64, 64), "v": (4096 + 8,), "b": (16,)}
STAGE = 1
CHOSEN = 1000.0
"""What the hostile reducer writes into its part of every replica's mean."""


def manifest(verify: bool, codec: str = "int8", gather_up_to: int = 0) -> Manifest:
    return small_manifest(averaging={"codec": codec, "error_feedback": False, "verify": verify,
                                     "gather_up_to": gather_up_to},
                          timeouts={"matchmaking": 1.0, "allreduce": 10.0})  # generous: 2 loaded cores


class HostileReducer(Reducer):
    """Answers every member with a mean of its choosing: the same bytes to everyone, so the
    members' votes agree. `alter`: instead, it flips a byte of another member's forwarded part."""
    alter = False

    def answer(self, slot: RoundSlot, tensors: list[pb.NamedTensor] | None, contributors: list[str], total: float,
               caller: str) -> pb.AverageResponse:
        answer = super().answer(slot, tensors, contributors, total, caller)
        if self.alter:
            for c in answer.others:
                if c.tensors:
                    buf = bytearray(c.tensors[0].tensor.buffers[-1])
                    buf[0] ^= 1
                    c.tensors[0].tensor.buffers[-1] = bytes(buf)
                    break
            return answer
        if tensors is not None:
            del answer.tensors[:]
            answer.tensors.extend(pb.NamedTensor(name=n, tensor=encoded_to_proto(self.reduce_codec.encode(
                torch.full(slot.part_names[n], CHOSEN)))) for n in sorted(slot.part_names))
        return answer


async def group(m: Manifest, n: int = 3, hostile: int | None = None, alter: bool = False
                ) -> tuple[LoopbackNetwork, list[Averager]]:
    """`n` averagers of one stage, all ONLINE; member `hostile` (by part) runs a HostileReducer."""
    net, dht = LoopbackNetwork(), MemoryDHT()
    averagers = []
    for i, key in enumerate(KEYS[:n]):
        peer = peer_id_of(key)
        view = swarm_view(dht, peer, m)
        clock = RoundClock(m.rounds, counts_steps=False, max_rounds=0, epoch=None)
        avg = Averager(m, STAGE, peer, SHAPES, net.rpc(peer), view, 1 << 24, clock, key=key)  # type: ignore[arg-type]
        if i == hostile:
            avg.reducer = HostileReducer(m, STAGE, avg.identity, avg.codec, 1 << 24, clock)
            avg.reducer.alter = alter
        net.handlers[peer] = avg.reducer.handle
        averagers.append(avg)
        await announce(view, STAGE)
    return net, averagers


def deltas(seed: int) -> dict[str, torch.Tensor]:
    g, common = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(999)
    return {n: torch.randn(s, generator=common) + 0.3 * torch.randn(s, generator=g) for n, s in SHAPES.items()}


async def run_all(averagers: list[Averager], round_no: int = 0) -> list[RoundResult]:
    return list(await asyncio.gather(*(a.run_round(round_no, deltas(i), 10.0, "digest", 0)
                                       for i, a in enumerate(averagers))))


def chosen(result: RoundResult) -> bool:
    """The hostile reducer's values are in this member's mean."""
    return result.mean_delta is not None and any(bool((t == CHOSEN).all()) for t in result.mean_delta.values())


def test_without_verify_a_hostile_reducer_chooses_the_mean() -> None:
    """The residual averaging.verify closes: every member, honest ones too, applies the chosen values."""
    async def main() -> None:
        _, avgs = await group(manifest(verify=False), hostile=1)
        results = await run_all(avgs)
        assert all(r.complete for r in results), [r.reason for r in results]
        assert all(chosen(r) for r in results)
    asyncio.run(main())


@pytest.mark.parametrize("n", [2, 3])
def test_a_hostile_reducer_cannot_choose_the_mean_is_blamed_and_the_others_train_on(n: int) -> None:
    async def main() -> None:
        _, avgs = await group(manifest(verify=True), n=n, hostile=1)
        honest = [a for i, a in enumerate(avgs) if i != 1]
        results = await run_all(avgs)
        for a, r in zip(avgs, results):
            if a in honest:
                assert not r.complete and r.mean_delta is None, "an honest member applied a forged mean"
                assert "not the aggregate of the members' signed parts" in r.reason, r.reason
                assert r.blamed == (avgs[1].peer_id,), r.blamed
        # the hostile reducer sits out the next round, and the honest members complete it without it
        # (a pair's last member averages alone: a group of one)
        results = await run_all(avgs, round_no=1)
        for a, r in zip(avgs, results):
            if a in honest:
                assert r.complete, r.reason
                assert avgs[1].peer_id not in r.group and not chosen(r)
        means = [r.mean_delta for a, r in zip(avgs, results) if a in honest]
        for mean in means[1:]:
            assert all(torch.equal(mean[k], means[0][k]) for k in SHAPES), "replicas must stay bit-identical"
    asyncio.run(main())


@pytest.mark.parametrize("gather_up_to", [0, 4])
def test_a_reducer_that_alters_a_members_part_is_refused_and_blamed(gather_up_to: int) -> None:
    async def main() -> None:
        _, avgs = await group(manifest(verify=True, gather_up_to=gather_up_to), n=3, hostile=1, alter=True)
        results = await run_all(avgs)
        for i, r in enumerate(results):
            if i != 1:
                assert not r.complete and "signature that is not its own" in r.reason, r.reason
                assert r.blamed == (avgs[1].peer_id,), r.blamed
    asyncio.run(main())


def test_a_part_not_signed_by_its_member_is_refused_by_the_reducer() -> None:
    async def main() -> None:
        _, avgs = await group(manifest(verify=True), n=3)
        avgs[2].key = Ed25519PrivateKey.generate()  # it signs with a key that is not its id's
        results = await run_all(avgs)
        assert not any(r.complete for r in results), "a part its member did not sign was counted"
        assert "UNAUTHORIZED" in results[2].reason and "signature that is not its own" in results[2].reason, \
            results[2].reason
    asyncio.run(main())


@pytest.mark.parametrize("gather_up_to", [0, 4])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_honest_rounds_apply_bit_identical_and_equal_to_the_unverified_mean(n: int, gather_up_to: int) -> None:
    async def main() -> None:
        means = []
        for verify in (False, True):
            _, avgs = await group(manifest(verify=verify, gather_up_to=gather_up_to), n=n)
            results = await run_all(avgs)
            assert all(r.complete for r in results), [r.reason for r in results]
            for r in results[1:]:
                assert all(torch.equal(r.mean_delta[k], results[0].mean_delta[k]) for k in SHAPES)
            means.append(results[0].mean_delta)
        assert all(torch.equal(means[0][k], means[1][k]) for k in SHAPES), "verify must not change the mean"
    asyncio.run(main())


def test_a_signature_binds_round_group_part_weight_and_bytes() -> None:
    key = KEYS[0]
    peer = peer_id_of(key)
    tensors = [pb.NamedTensor(name="w", tensor=encoded_to_proto(get_codec("fp32").encode(torch.ones(4))))]
    args = ("run", "hash", 1, 7, "g", 2, 3.0)
    signature = sign_part(key, *args, tensors)
    assert part_refusal(peer, signature, *args, tensors) is None
    for i, other in enumerate([("run2",), ("run", "hash2"), ("run", "hash", 2), ("run", "hash", 1, 8),
                               ("run", "hash", 1, 7, "h"), ("run", "hash", 1, 7, "g", 3),
                               ("run", "hash", 1, 7, "g", 2, 4.0)]):
        changed = other + args[len(other):]
        assert part_refusal(peer, signature, *changed, tensors) is not None, i
    altered = [pb.NamedTensor(name="w", tensor=tensors[0].tensor)]
    altered[0].tensor.shape[:] = [2, 2]
    assert part_refusal(peer, signature, *args, altered) is not None
    assert part_refusal(peer_id_of(KEYS[1]), signature, *args, tensors) is not None
    assert part_refusal(peer, b"", *args, tensors) is not None


def test_verify_needs_a_mean_others_can_recompute() -> None:
    with pytest.raises(ManifestError, match="averaging.verify"):
        small_manifest(averaging={"verify": True, "reducer_feedback": True})
    with pytest.raises(ManifestError, match="averaging.verify"):
        small_manifest(averaging={"verify": True, "codec": "int8:stochastic=true"})
    assert small_manifest(averaging={"verify": True}).averaging.verify


# a swarm ------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_real_peers_train_on_past_a_hostile_reducer(inprocess, monkeypatch) -> None:
    """Real peers (tests/support/swarm.py): one driver, three replicas of stage 1, one of which
    reduces a chosen mean. The honest replicas never apply it, blame it, and complete rounds
    without it, with one digest."""
    m = step_manifest(4, averaging={"codec": "int8", "verify": True}, timeouts={"matchmaking": 2.0})
    hostile: list[str] = []
    answer = Reducer.answer

    def forging(self: Reducer, slot: RoundSlot, tensors, contributors, total, caller):  # type: ignore[no-untyped-def]
        if tensors is not None and slot.group is not None and slot.group.members[slot.my_part] in hostile:
            tensors = [pb.NamedTensor(name=n, tensor=encoded_to_proto(self.reduce_codec.encode(
                torch.full(slot.part_names[n], CHOSEN)))) for n in sorted(slot.part_names)]
        return answer(self, slot, tensors, contributors, total, caller)
    monkeypatch.setattr(Reducer, "answer", forging)

    async def scenario() -> None:
        async with InProcessSwarm(m) as swarm:
            driver = swarm.start(0, max_rounds=4)
            await swarm.wait_for(driver, lambda e: e["event"] == "online", 30, "the driver online")
            replicas = [swarm.start(1, max_rounds=4) for _ in range(3)]
            hostile.append(replicas[0].peer_id)
            await swarm.wait_exit(90)
            honest = replicas[1:]
            refused = [e for p in honest for e in p.events("round") if not e["complete"]
                       and "not the aggregate of the members' signed parts" in (e["reason"] or "")]
            assert refused, "no honest replica saw the forged mean\n" + swarm.history()
            for p in honest:
                for e in p.events("round"):
                    if e["complete"]:
                        assert hostile[0] not in (e["group"] or ()), f"{p.name} applied a round with the forger: {e}"
            assert_replicas_agree(honest, 1)
            together = [r for r, events in complete_rounds(honest, 1).items() if len(events) == 2]
            assert together, "the honest replicas did not train on together\n" + swarm.history()

    inprocess(scenario, timeout=110)


def test_a_signature_of_the_wrong_length_is_refused_at_the_boundary() -> None:
    from swarmgrad.protocol.framing import ProtocolError
    from swarmgrad.protocol.validation import RunIdentity, envelope, validate_average
    identity = RunIdentity("run", "hash")
    req = pb.AverageRequest(envelope=envelope(identity, STAGE), round=1, group_hash="g", state_digest="d",
                            weight=1.0, part=0, signature=b"x" * 65)
    with pytest.raises(ProtocolError, match="signature"):
        validate_average(req, identity, STAGE, lambda part: {}, 1 << 20)


def test_the_owner_of_a_public_run_is_warned_when_verify_is_off() -> None:
    from swarmgrad.peer.cli.public import public_run_warnings
    [warning] = public_run_warnings(manifest(verify=False), "run.toml")
    assert "averaging.verify off" in warning and "run.toml" in warning
    assert public_run_warnings(manifest(verify=True), "run.toml") == []
