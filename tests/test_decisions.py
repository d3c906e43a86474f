"""Pure decisions over a snapshot: routing, bans, deadlines, partitions, group choice, stage choice,
and the DHT record that feeds them. No network."""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import msgpack
import pytest
import torch

from swarmgrad.peer.averaging.aggregate import weighted_mean
from swarmgrad.peer.averaging.group import Group, choose_group, partition
from swarmgrad.peer.pipeline.routing import BanList, Candidate, DeadlineEstimator, choose_replica
from swarmgrad.peer.compute.rate import RateMeter
from swarmgrad.peer.records import JOINING, PeerRecord

# --------------------------------------------------------------------------- choose_replica

DRAWS = 20000


def frequencies(candidates: list[Candidate], in_flight: dict[str, int], banned: set[str],
                seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    counts = Counter(choose_replica(candidates, in_flight, banned, rng) for _ in range(DRAWS))
    return {k: v / DRAWS for k, v in counts.items()}


def assert_frequencies(freq: dict[str, float], weights: dict[str, float], tol: float = 0.015) -> None:
    total = sum(weights.values())
    assert set(freq) == {k for k, w in weights.items() if w > 0}
    for k, w in weights.items():
        assert freq.get(k, 0.0) == pytest.approx(w / total, abs=tol), (k, freq)


def test_choose_replica_weights_by_throughput_over_queue() -> None:
    cands = [Candidate("a", 1.0), Candidate("b", 3.0), Candidate("c", 2.0), Candidate("d", 6.0)]
    in_flight = {"c": 1, "d": 2, "zzz": 5}
    # weights: a 1/1, b 3/1, c 2/2, d 6/3
    assert_frequencies(frequencies(cands, in_flight, set()), {"a": 1, "b": 3, "c": 1, "d": 2})


def test_choose_replica_without_queue_is_proportional_to_throughput() -> None:
    cands = [Candidate("a", 1.0), Candidate("b", 4.0)]
    assert_frequencies(frequencies(cands, {}, set()), {"a": 1, "b": 4})


def test_choose_replica_respects_bans() -> None:
    cands = [Candidate("a", 100.0), Candidate("b", 100.0), Candidate("c", 0.1)]
    freq = frequencies(cands, {}, {"a", "b"})
    assert freq == {"c": 1.0}
    assert_frequencies(frequencies(cands, {}, {"a"}), {"b": 100, "c": 0.1}, tol=0.005)


def test_choose_replica_none_when_all_banned_or_empty() -> None:
    rng = random.Random(0)
    cands = [Candidate("a", 1.0), Candidate("b", 2.0)]
    assert choose_replica(cands, {}, {"a", "b"}, rng) is None
    assert choose_replica([], {}, set(), rng) is None
    assert choose_replica(cands, {}, {"a", "b", "x"}, rng) is None


def test_newcomer_gets_median_weight_of_usable_replicas() -> None:
    # measured (usable) throughputs 1, 3, 5 -> median 3; the banned 100 must not count
    cands = [Candidate("a", 1.0), Candidate("b", 3.0), Candidate("e", 5.0), Candidate("c", 100.0),
             Candidate("new", 0.0)]
    assert_frequencies(frequencies(cands, {}, {"c"}), {"a": 1, "b": 3, "e": 5, "new": 3})


def test_newcomer_weight_is_also_divided_by_its_queue() -> None:
    cands = [Candidate("a", 2.0), Candidate("new", 0.0)]
    assert_frequencies(frequencies(cands, {"new": 3}, set()), {"a": 2, "new": 0.5})


def test_only_newcomers_are_chosen_uniformly() -> None:
    cands = [Candidate("x", 0.0), Candidate("y", 0.0), Candidate("z", 0.0)]
    assert_frequencies(frequencies(cands, {}, set()), {"x": 1, "y": 1, "z": 1})


def test_choose_replica_is_deterministic_for_a_seed() -> None:
    cands = [Candidate(f"p{i}", float(i + 1)) for i in range(5)]
    seq1 = [choose_replica(cands, {}, set(), r) for r in [random.Random(42)] for _ in range(200)]
    seq2 = [choose_replica(cands, {}, set(), r) for r in [random.Random(42)] for _ in range(200)]
    assert seq1 == seq2
    assert len(set(seq1)) == 5


# --------------------------------------------------------------------------- BanList


def test_ban_backoff_doubles_and_caps() -> None:
    bans = BanList(base_seconds=5.0, max_seconds=60.0)
    durations = [bans.ban("p", now=100.0) for _ in range(7)]
    assert durations == [5.0, 10.0, 20.0, 40.0, 60.0, 60.0, 60.0]


def test_banned_until_expiry() -> None:
    bans = BanList(base_seconds=5.0, max_seconds=60.0)
    assert bans.banned(0.0) == set()
    bans.ban("p", now=100.0)
    bans.ban("q", now=100.0)
    bans.ban("q", now=101.0)  # second failure: 10 s from 101
    assert bans.banned(100.0) == {"p", "q"}
    assert bans.banned(104.9) == {"p", "q"}
    assert bans.banned(105.0) == {"q"}  # expiry is exclusive
    assert bans.banned(110.9) == {"q"}
    assert bans.banned(111.0) == set()


def test_success_resets_backoff_per_peer() -> None:
    bans = BanList(base_seconds=2.0, max_seconds=100.0)
    for _ in range(3):
        bans.ban("p", now=0.0)
        bans.ban("q", now=0.0)
    bans.succeeded("p")
    assert bans.ban("p", now=50.0) == 2.0
    assert bans.ban("q", now=50.0) == 16.0
    bans.succeeded("never-banned")  # no error, no effect
    assert bans.ban("never-banned", now=0.0) == 2.0


# --------------------------------------------------------------------------- DeadlineEstimator


def test_deadline_is_maximum_before_four_samples() -> None:
    est = DeadlineEstimator(minimum=1.0, maximum=30.0)
    assert est.deadline() == 30.0
    for _ in range(3):
        est.observe(0.5)
        assert est.deadline() == 30.0
    est.observe(0.5)
    assert est.deadline() == 2.0  # 4 x p90


def test_deadline_clamps() -> None:
    low = DeadlineEstimator(minimum=1.0, maximum=30.0)
    high = DeadlineEstimator(minimum=1.0, maximum=30.0)
    for _ in range(8):
        low.observe(0.01)
        high.observe(100.0)
    assert low.deadline() == 1.0
    assert high.deadline() == 30.0


def test_deadline_scales_with_p90() -> None:
    a = DeadlineEstimator(minimum=0.001, maximum=1000.0, factor=3.0)
    b = DeadlineEstimator(minimum=0.001, maximum=1000.0, factor=3.0)
    rng = random.Random(1)
    samples = [rng.uniform(0.1, 2.0) for _ in range(50)]
    for s in samples:
        a.observe(s)
        b.observe(2 * s)
    assert b.deadline() == pytest.approx(2 * a.deadline())
    ordered = sorted(samples)
    assert ordered[44] * 3 <= a.deadline() <= ordered[46] * 3  # p90 of 50 samples, give or take a rank


def test_deadline_ignores_the_slowest_tenth() -> None:
    est = DeadlineEstimator(minimum=0.1, maximum=100.0, factor=4.0, window=64)
    for _ in range(60):
        est.observe(1.0)
    for _ in range(4):
        est.observe(50.0)  # 4/64 < 10%: outliers
    assert est.deadline() == 4.0
    for _ in range(4):
        est.observe(50.0)  # now 8/64 > 10% of the window are slow
    assert est.deadline() == 100.0


def test_deadline_window_forgets_old_samples() -> None:
    est = DeadlineEstimator(minimum=0.1, maximum=100.0, factor=2.0, window=10)
    for _ in range(10):
        est.observe(20.0)
    assert est.deadline() == 40.0
    for _ in range(10):
        est.observe(1.0)
    assert est.deadline() == 2.0


# --------------------------------------------------------------------------- RateMeter


def test_rate_meter_ema() -> None:
    meter = RateMeter(alpha=0.25)
    assert meter.rate == 0.0
    assert meter.update(10, 2.0) == 5.0  # first sample taken as is
    assert meter.update(3, 1.0) == pytest.approx(0.75 * 5.0 + 0.25 * 3.0)
    assert meter.rate == pytest.approx(4.5)


def test_rate_meter_ignores_empty_updates() -> None:
    meter = RateMeter()
    assert meter.update(0, 1.0) == 0.0
    assert meter.update(5, 0.0) == 0.0
    meter.update(4, 2.0)
    assert meter.update(0, 5.0) == 2.0
    assert meter.update(3, -1.0) == 2.0


# --------------------------------------------------------------------------- partition


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


GPTISH = {
    "tok.weight": (256, 64), "blocks.0.attn.w": (64, 192), "blocks.0.attn.proj": (64, 64),
    "blocks.0.mlp.up": (64, 256), "blocks.0.mlp.down": (256, 64), "blocks.0.ln1.weight": (64,),
    "blocks.0.ln1.bias": (64,), "blocks.0.ln2.weight": (64,), "blocks.0.ln2.bias": (64,),
    "head.bias": (256,), "scale": (),
}


@pytest.mark.parametrize("n_parts", [1, 2, 3, 4, 7])
def test_partition_assigns_every_name_and_balances(n_parts: int) -> None:
    parts = partition(GPTISH, n_parts)
    assert set(parts) == set(GPTISH)
    assert set(parts.values()) <= set(range(n_parts))
    loads = [0] * n_parts
    for name, part in parts.items():
        loads[part] += numel(GPTISH[name])
    assert sum(loads) == sum(numel(s) for s in GPTISH.values())
    assert max(loads) - min(loads) <= max(numel(s) for s in GPTISH.values())
    if n_parts <= len(GPTISH):
        assert set(parts.values()) == set(range(n_parts))  # no idle reducer


def test_partition_lpt_example() -> None:
    shapes = {"d": (4,), "b": (2, 3), "a": (10,), "c": (5, 1)}
    # largest first onto the lightest part: a->0 (10,0), b->1 (10,6), c->1 (10,11), d->0 (14,11)
    assert partition(shapes, 2) == {"a": 0, "b": 1, "c": 1, "d": 0}


def test_partition_is_deterministic_across_insertion_order() -> None:
    shuffled = dict(sorted(GPTISH.items(), key=lambda kv: hash(kv[0]) % 97))
    reversed_ = dict(reversed(list(GPTISH.items())))
    for n in (2, 3, 5):
        assert partition(GPTISH, n) == partition(shuffled, n) == partition(reversed_, n)


def test_partition_ties_broken_by_name() -> None:
    shapes = {"y": (3,), "x": (3,), "z": (3,)}
    assert partition(shapes, 3) == {"x": 0, "y": 1, "z": 2}


def test_partition_more_parts_than_tensors() -> None:
    shapes = {"w": (8, 8), "b": (8,), "s": ()}
    parts = partition(shapes, 10)
    assert parts == {"w": 0, "b": 1, "s": 2}


def test_partition_of_nothing() -> None:
    assert partition({}, 3) == {}


# --------------------------------------------------------------------------- choose_group / Group


def reg(digest: str, applied: int) -> dict[str, Any]:
    return {"digest": digest, "applied_rounds": applied, "weight": 1.0}


def test_choose_group_empty() -> None:
    assert choose_group({}) is None


def test_a_claim_of_more_rounds_does_not_beat_the_majority() -> None:
    # issue 43, point 1: the newest claim won before, so one id claiming a round more was the group
    g = choose_group({"p1": reg("d1", 5), "p2": reg("d2", 4), "p3": reg("d2", 4)})
    assert g == Group(("p2", "p3"), "d2", 4)
    # between as many registrants, the newer state still leads (a member that applied a round we failed)
    assert choose_group({"p1": reg("d1", 5), "p2": reg("d2", 4)}) == Group(("p1",), "d1", 5)


def test_majority_digest_among_newest() -> None:
    g = choose_group({"p3": reg("dB", 5), "p1": reg("dA", 5), "p2": reg("dB", 5)})
    assert g == Group(("p2", "p3"), "dB", 5)


def test_digest_tie_goes_to_smallest() -> None:
    g = choose_group({"p1": reg("bbb", 2), "p2": reg("aaa", 2), "p3": reg("ccc", 2)})
    assert g == Group(("p2",), "aaa", 2)
    g = choose_group({"p1": reg("bbb", 2), "p2": reg("aaa", 2), "p3": reg("bbb", 2), "p4": reg("aaa", 2)})
    assert g == Group(("p2", "p4"), "aaa", 2)


def test_stale_peer_excluded_even_with_matching_digest() -> None:
    # p3 reports the reference digest but an older round count: it is not the reference state
    g = choose_group({"p1": reg("d", 7), "p2": reg("d", 7), "p3": reg("d", 6), "p4": reg("old", 6)})
    assert g is not None
    assert g.members == ("p1", "p2") and g.digest == "d" and g.applied_rounds == 7


def test_members_sorted_and_view_order_irrelevant() -> None:
    regs = {p: reg("d", 1) for p in ["zeta", "alpha", "mu", "Beta"]}
    g1 = choose_group(regs)
    g2 = choose_group(dict(reversed(list(regs.items()))))
    assert g1 is not None and g2 is not None
    assert g1.members == ("Beta", "alpha", "mu", "zeta")
    assert g1 == g2 and g1.hash == g2.hash


def test_group_hash() -> None:
    ab = Group(("a", "b"), "d", 1)
    assert len(ab.hash) == 16 and all(c in "0123456789abcdef" for c in ab.hash)
    assert ab.hash == Group(("a", "b"), "other-digest", 9).hash  # members only
    assert ab.hash != Group(("b", "a"), "d", 1).hash
    assert ab.hash != Group(("a",), "d", 1).hash
    assert ab.hash != Group(("a", "b", "c"), "d", 1).hash
    assert Group(("a",), "d", 1).hash == Group(("a",), "d", 1).hash


# --------------------------------------------------------------------------- weighted_mean


def test_weighted_mean_by_hand() -> None:
    out = weighted_mean([(1.0, torch.tensor([1.0, 2.0])), (3.0, torch.tensor([5.0, 6.0]))])
    assert torch.equal(out, torch.tensor([4.0, 5.0]))
    out = weighted_mean([(2.0, torch.tensor([[1.0, -1.0]])), (0.0, torch.tensor([[100.0, 100.0]])),
                         (2.0, torch.tensor([[3.0, 1.0]]))])
    assert torch.equal(out, torch.tensor([[2.0, 0.0]]))


def test_weighted_mean_matches_float64_reference() -> None:
    g = torch.Generator().manual_seed(0)
    contribs = [(float(w), torch.randn(33, 7, generator=g)) for w in (3, 1, 0.5, 7)]
    ref = sum(w * t.double() for w, t in contribs) / sum(w for w, _ in contribs)
    out = weighted_mean(contribs)
    assert out.dtype == torch.float32 and out.shape == (33, 7)
    assert float((out.double() - ref).abs().max()) <= 1e-6


def test_weighted_mean_zero_weights_give_zeros() -> None:
    contribs = [(0.0, torch.ones(3, 2)), (0.0, torch.full((3, 2), 5.0))]
    out = weighted_mean(contribs)
    assert torch.equal(out, torch.zeros(3, 2))


def test_weighted_mean_leaves_inputs_alone() -> None:
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    weighted_mean([(1.0, a), (1.0, b)])
    assert torch.equal(a, torch.tensor([1.0, 2.0])) and torch.equal(b, torch.tensor([3.0, 4.0]))


def test_weighted_mean_sums_in_the_given_order() -> None:
    # cancellation makes fp32 addition order visible: the reducer must pass a fixed (sorted) order,
    # and weighted_mean must use exactly that order, identically on every call
    big, neg, one = torch.tensor([1e8]), torch.tensor([-1e8]), torch.tensor([1.0])
    orders = [[big, neg, one], [big, one, neg]]
    results = []
    for order in orders:
        contribs = [(1.0, t) for t in order]
        expected = torch.zeros(1)
        for _, t in contribs:
            expected.add_(t, alpha=1.0 / 3.0)
        out = weighted_mean(contribs)
        assert torch.equal(out, expected)
        assert torch.equal(weighted_mean(contribs), out)
        results.append(out)
    assert not torch.equal(results[0], results[1])


# --------------------------------------------------------------------------- PeerRecord


def full_record() -> PeerRecord:
    return PeerRecord(peer_id="QmPeer", stage=2, state=JOINING, throughput=3.25, round=11, applied_rounds=9,
                      digest="abc123", manifest_hash="f" * 32, driver=False,
                      maddrs=("/ip4/127.0.0.1/tcp/1234", "/ip4/10.0.0.1/udp/5/quic"))


def test_peer_record_round_trip() -> None:
    r = full_record()
    value = r.to_value()
    assert "peer_id" not in value and value["maddrs"] == list(r.maddrs)
    assert PeerRecord.from_value("QmPeer", value) == r
    # as it travels through the DHT (msgpack)
    assert PeerRecord.from_value("QmPeer", msgpack.unpackb(msgpack.packb(value))) == r
    assert PeerRecord.from_value("other", value) == PeerRecord(**{**r.__dict__, "peer_id": "other"})


def test_peer_record_defaults_and_limits() -> None:
    value = full_record().to_value()
    del value["maddrs"]
    assert PeerRecord.from_value("p", value).maddrs == ()
    value["maddrs"] = [f"/ip4/10.0.0.{i}/tcp/1" for i in range(8)]
    assert len(PeerRecord.from_value("p", value).maddrs) == 8
    value["maddrs"] = [f"/ip4/10.0.0.{i}/tcp/1" for i in range(20)]
    assert PeerRecord.from_value("p", value) is None, "an oversized record is refused, not trimmed"
    value["maddrs"] = []
    value["throughput"] = 0
    assert PeerRecord.from_value("p", value).throughput == 0.0


REQUIRED = ["stage", "state", "throughput", "round", "applied_rounds", "digest", "manifest_hash", "driver"]


@pytest.mark.parametrize("key", REQUIRED)
def test_peer_record_missing_key(key: str) -> None:
    value = full_record().to_value()
    del value[key]
    assert PeerRecord.from_value("p", value) is None


@pytest.mark.parametrize("change", [
    {"state": "busy"}, {"state": "ONLINE"}, {"state": None},
    {"throughput": -0.5}, {"throughput": math.nan}, {"throughput": math.inf}, {"throughput": "fast"},
    {"throughput": None}, {"stage": "two"}, {"stage": None}, {"stage": [2]}, {"round": "x"},
    {"applied_rounds": None}, {"round": math.nan}, {"maddrs": 5}, {"maddrs": None},
    {"throughput": 1e308}, {"round": 2**64 - 1}, {"stage": -1}, {"driver": "yes"}, {"digest": "x" * 10_000},
], ids=repr)
def test_peer_record_malformed_values(change: dict[str, Any]) -> None:
    value = {**full_record().to_value(), **change}
    assert PeerRecord.from_value("p", value) is None


@pytest.mark.parametrize("value", [None, [], "online", 3, b"\x00", [("stage", 1)]], ids=repr)
def test_peer_record_not_a_dict(value: Any) -> None:
    assert PeerRecord.from_value("p", value) is None


@pytest.mark.parametrize("key", ["round", "stage", "applied_rounds"])
def test_peer_record_infinite_int_field(key: str) -> None:
    value = {**full_record().to_value(), key: math.inf}
    assert PeerRecord.from_value("p", value) is None
