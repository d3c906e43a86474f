"""A stranger's bytes cannot break a peer: responses, records and streams from a hostile remote.

Pure checks first (unknown statuses, hostile codec params, codecs outside the manifest, bounds
on every number in a response or DHT record, decode cost of sparse and low-rank payloads),
then hypothesis-fuzzed bytes into every validate_* function (only ProtocolError may come out),
then two real P2P instances on 127.0.0.1 where one side attacks the other's streams.
"""
from __future__ import annotations

import asyncio
import json
import math
import struct
import time
import tracemalloc
from typing import Any, Awaitable, Callable

import numpy as np
import psutil
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarmgrad.compression import CODEC_NAMES, CodecError, Encoded, decode, get_codec
from swarmgrad.compression.topk import _pack_bits, _unpack_bits
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.codecs import FP32_ONLY, averaging_codecs, wire_codec_names
from swarmgrad.protocol.framing import (HEADER_BYTES, MAX_FRAME_BYTES, ProtocolError, encode_stream, parse_bytes,
                                        read_stream_message, status_name)
from swarmgrad.protocol.records import MAX_THROUGHPUT, bounded_record_fields, validate_registration
from swarmgrad.protocol.responses import (validate_average_response, validate_forward_response,
                                          validate_gather_response, validate_state_response)
from swarmgrad.protocol.validation import (MAX_ROUND, RunIdentity, StageContract, decode_named, decode_tensor,
                                           encoded_to_proto, envelope, raw_from_tensor, validate_average,
                                           validate_forward)

from support.until import until

IDENTITY = RunIdentity(run_id="run-a", manifest_hash="0123456789abcdef0123456789abcdef")
SEQ, D, VOCAB = 4, 3, 16
MAX_NUMEL = 1 << 16
PEERS = ("QmPeerAAAA", "QmPeerBBBB")
PART = {"w": (4, 3), "b": (3,)}
CONTRACT = StageContract(stage=1, n_stages=2, max_batch=4, input_spec=lambda b: ((b, SEQ, D), torch.float32),
                         targets_spec=lambda b: ((b, SEQ), torch.int64), vocab_size=VOCAB)


def enc(t: torch.Tensor, spec: str = "fp32") -> pb.EncodedTensor:
    return encoded_to_proto(get_codec(spec).encode(t))


def named(tensors: dict[str, torch.Tensor], spec: str = "fp32") -> list[pb.NamedTensor]:
    return [pb.NamedTensor(name=n, tensor=enc(t, spec)) for n, t in tensors.items()]


def part(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in PART.items()}


def digest(params: dict, momentum: dict, trained_samples: int = 0) -> str:
    return f"d{sum(float(t.sum()) for t in params.values()):.6f}:{len(momentum)}:{trained_samples}"


def refused(fn: Callable, *args: Any, **kwargs: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        fn(*args, **kwargs)
    return info.value


def forward_request(**fields: Any) -> pb.ForwardRequest:
    req = pb.ForwardRequest(envelope=envelope(IDENTITY, 1), microbatch_id=1, driver="QmDriver",
                            activations=enc(torch.randn(2, SEQ, D)), targets=raw_from_tensor(torch.zeros(2, SEQ).long()),
                            deadline=10.0)
    for k, v in fields.items():
        getattr(req, k).CopyFrom(v) if isinstance(v, pb.EncodedTensor) else setattr(req, k, v)
    return req


def average_request(spec: str = "fp32") -> pb.AverageRequest:
    return pb.AverageRequest(envelope=envelope(IDENTITY, 1), round=3, group_hash="g" * 16, state_digest="s" * 24,
                             weight=8.0, part=0, tensors=named(part(), spec))


def parts(p: int) -> dict[str, tuple[int, ...]] | None:
    return PART if p == 0 else None


def ok_forward_response(**fields: Any) -> pb.ForwardResponse:
    resp = pb.ForwardResponse(status=pb.OK, grad_input=enc(torch.randn(2, SEQ, D)), loss=2.5, n_targets=8,
                              route="QmNext1,QmNext2")
    for k, v in fields.items():
        getattr(resp, k).CopyFrom(v) if isinstance(v, pb.EncodedTensor) else setattr(resp, k, v)
    return resp


def ok_average_response() -> pb.AverageResponse:
    return pb.AverageResponse(status=pb.OK, tensors=named(part()), contributors=list(PEERS), total_weight=16.0)


def ok_state_response() -> pb.StateResponse:
    params, momentum = part(1), part(2)
    return pb.StateResponse(status=pb.OK, round=7, applied_rounds=6, trained_samples=99,
                            state_digest=digest(params, momentum, 99), params=named(params), momentum=named(momentum))


def check_forward(resp: pb.ForwardResponse, eval_only: bool = False):
    return validate_forward_response(resp, (2, SEQ, D), eval_only, MAX_NUMEL, frozenset({"fp32"}))


def check_average(resp: pb.AverageResponse, **kw: Any):
    return validate_average_response(resp, PART, PEERS, MAX_NUMEL, FP32_ONLY, max_total_weight=1e6, **kw)


def check_state(resp: pb.StateResponse):
    return validate_state_response(resp, PART, MAX_NUMEL, digest_fn=digest, allowed_codecs=FP32_ONLY)


# --------------------------------------------------------------------------- unknown statuses


def test_status_name_of_unknown_values() -> None:
    assert status_name(pb.TOO_LARGE) == "TOO_LARGE" and status_name(pb.BUSY) == "BUSY"
    assert status_name(99) == "UNKNOWN_STATUS_99" and status_name(-3) == "UNKNOWN_STATUS_-3"
    assert str(ProtocolError(99, "odd")) == "UNKNOWN_STATUS_99: odd"


@pytest.mark.parametrize("kind", ["forward", "average", "state"])
def test_unknown_status_in_each_response_is_refused(kind: str) -> None:
    resp = {"forward": ok_forward_response, "average": ok_average_response, "state": ok_state_response}[kind]()
    resp.status = 99
    resp = type(resp).FromString(resp.SerializeToString())  # proto3 keeps the unknown number
    assert resp.status == 99
    check = {"forward": check_forward, "average": check_average, "state": check_state}[kind]
    err = refused(check, resp)
    assert err.status == pb.BAD_REQUEST and "unknown status 99" in err.reason


@pytest.mark.parametrize("kind", ["forward", "average", "state"])
def test_refusals_come_back_typed_with_a_bounded_reason(kind: str) -> None:
    resp = {"forward": pb.ForwardResponse, "average": pb.AverageResponse, "state": pb.StateResponse}[kind](
        status=pb.NOT_READY, reason="r" * 100_000)
    check = {"forward": check_forward, "average": check_average, "state": check_state}[kind]
    out = check(resp)
    assert not out.ok and out.status == pb.NOT_READY and len(out.reason) <= 1000


# --------------------------------------------------------------------------- hostile codec params

DEEP = "[" * 3000 + "]" * 3000  # json's C scanner raises RecursionError, not JSONDecodeError


@pytest.mark.parametrize("params_json, needle", [
    ('{"a": ' * 1000 + "1" + "}" * 1000, "params"),
    (DEEP[:4000], "params"),
    ('{"block_size": null}', "params"),                       # CodecError from Encoded's field check
    ('{"block_size": [1, 2]}', "params"),
    ('{"block_size": 1e400}', "block_size"),                 # inf: refused by the codec
    ('{"block_size": NaN}', "block_size"),
    ('{"block_size": 0}', "block_size"),                     # CodecError from decode
    ('{"block_size": ' + "9" * 3000 + "}", "block_size"),
])
def test_hostile_params_json_is_a_bad_request(params_json: str, needle: str) -> None:
    proto = enc(torch.randn(2, SEQ, D), "int8")
    proto.params_json = params_json
    err = refused(decode_tensor, proto, MAX_NUMEL, "activations")
    assert err.status == pb.BAD_REQUEST and "activations" in err.reason and needle in err.reason, err.reason
    err = refused(validate_forward, forward_request(activations=proto), IDENTITY, CONTRACT, MAX_NUMEL)
    assert err.status == pb.BAD_REQUEST


def test_recursion_error_in_params_is_caught() -> None:
    with pytest.raises(RecursionError):
        json.loads(DEEP)  # the premise: this really raises RecursionError
    proto = enc(torch.randn(3), "fp32")
    proto.params_json = DEEP[:4000]
    assert "not usable JSON (RecursionError)" in refused(decode_tensor, proto, MAX_NUMEL).reason


# --------------------------------------------------------------------------- allowed codecs


def test_wire_codec_names_from_specs() -> None:
    assert wire_codec_names("int8") == {"int8"}
    assert wire_codec_names("int8:block_size=64") == {"int8"}
    assert wire_codec_names("topk:fraction=0.01,values=int8") == {"topk"}
    assert wire_codec_names("powersgd:rank=4,fallback=bf16") == {"powersgd", "bf16"}
    if "lowrank" in CODEC_NAMES:
        assert wire_codec_names("lowrank") == {"lowrank", "int8"}
    assert wire_codec_names("adaptive:threshold=100|fp16|topk:values=int8") == {"fp16", "topk"}
    assert averaging_codecs("int8", 65536) == {"fp32", "int8"}
    assert averaging_codecs("powersgd:rank=2", 0) == {"powersgd", "fp16"}
    with pytest.raises(CodecError):
        wire_codec_names("zstd")


def test_codec_outside_the_manifest_is_refused_on_every_path() -> None:
    int8_only = frozenset({"int8"})
    x = enc(torch.randn(2, SEQ, D), "fp32")
    err = refused(decode_tensor, x, MAX_NUMEL, "activations", allowed_codecs=int8_only)
    assert err.status == pb.BAD_REQUEST and "codec 'fp32' is not accepted" in err.reason and "int8" in err.reason
    err = refused(validate_forward, forward_request(activations=x), IDENTITY, CONTRACT, MAX_NUMEL,
                  allowed_codecs=int8_only)
    assert "'fp32'" in err.reason
    assert validate_forward(forward_request(activations=enc(torch.randn(2, SEQ, D), "int8")), IDENTITY, CONTRACT,
                            MAX_NUMEL, allowed_codecs=int8_only).activations.shape == (2, SEQ, D)
    err = refused(validate_average, average_request("fp16"), IDENTITY, 1, parts, MAX_NUMEL,
                  allowed_codecs=averaging_codecs("int8", 100))
    assert "codec 'fp16' is not accepted" in err.reason
    assert validate_average(average_request("fp32"), IDENTITY, 1, parts, MAX_NUMEL,
                            allowed_codecs=averaging_codecs("int8", 100)).weight == 8.0
    err = refused(decode_named, named(part(), "bf16"), PART, MAX_NUMEL, "mean", allowed_codecs=FP32_ONLY)
    assert "codec 'bf16'" in err.reason
    resp = ok_forward_response(grad_input=enc(torch.randn(2, SEQ, D), "int4"))
    assert "codec 'int4'" in refused(check_forward, resp).reason
    state = ok_state_response()
    state.params[0].tensor.CopyFrom(enc(part(1)[state.params[0].name], "fp16"))
    assert "codec 'fp16'" in refused(check_state, state).reason


# --------------------------------------------------------------------------- responses: bounds


def test_valid_responses_are_decoded() -> None:
    out = check_forward(ok_forward_response())
    assert out.ok and out.grad.shape == (2, SEQ, D) and out.loss == 2.5 and out.route == ("QmNext1", "QmNext2")
    timed = check_forward(ok_forward_response(request_s=0.25, serve_s=1.5))
    assert (timed.request_s, timed.serve_s) == (0.25, 1.5) and (out.request_s, out.serve_s) == (0.0, 0.0)
    assert check_forward(ok_forward_response(), eval_only=True).grad is None
    avg = check_average(ok_average_response())
    assert avg.ok and avg.contributors == PEERS and set(avg.tensors) == set(PART)
    state = check_state(ok_state_response())
    assert state.ok and (state.round, state.applied_rounds, state.trained_samples) == (7, 6, 99)
    empty_momentum = ok_state_response()
    del empty_momentum.momentum[:]
    empty_momentum.state_digest = digest(part(1), {}, 99)
    assert check_state(empty_momentum).momentum == {}


@pytest.mark.parametrize("fields, needle", [
    (dict(loss=math.nan), "loss"), (dict(loss=math.inf), "loss"), (dict(loss=-1.0), "loss"),
    (dict(loss=1e300), "loss"), (dict(n_targets=2**63), "targets"), (dict(failed_peer="not a peer id!"), "peer id"),
    (dict(route=",".join(["QmX"] * 65)), "route"), (dict(route="QmA,,QmB"), "route"),
    (dict(request_s=math.nan), "request_s"), (dict(request_s=-0.1), "request_s"), (dict(serve_s=math.inf), "serve_s"),
    (dict(serve_s=1e9), "serve_s"),
])
def test_forward_response_bounds(fields: dict, needle: str) -> None:
    assert needle in refused(check_forward, ok_forward_response(**fields)).reason


def test_forward_response_gradient_checks() -> None:
    resp = ok_forward_response()
    resp.ClearField("grad_input")
    assert "no grad_input" in refused(check_forward, resp).reason
    assert "expected [2, 4, 3]" in refused(check_forward, ok_forward_response(grad_input=enc(torch.randn(2, SEQ, 4)))).reason
    nan = pb.EncodedTensor(codec="fp32", shape=[2, SEQ, D], dtype="float32",
                           buffers=[struct.pack("<f", math.nan) * (2 * SEQ * D)])
    assert "NaN" in refused(check_forward, ok_forward_response(grad_input=nan)).reason


@pytest.mark.parametrize("change, needle", [
    (lambda r: r.contributors.append("QmPeerCCCC"), "contributors"),
    (lambda r: r.contributors.pop(), "contributors"),
    (lambda r: (r.contributors.pop(), r.contributors.append(PEERS[0])), "contributors"),  # a duplicate
    (lambda r: setattr(r, "total_weight", math.nan), "total_weight"),
    (lambda r: setattr(r, "total_weight", -1.0), "total_weight"),
    (lambda r: setattr(r, "total_weight", 2e6), "total_weight"),
    (lambda r: r.tensors.pop(), "missing"),
])
def test_average_response_bounds(change: Callable, needle: str) -> None:
    resp = ok_average_response()
    change(resp)
    assert needle in refused(check_average, resp).reason


@pytest.mark.parametrize("change, needle", [
    (lambda r: setattr(r, "round", MAX_ROUND + 1), "round"),
    (lambda r: setattr(r, "applied_rounds", 2**64 - 1), "applied_rounds"),
    (lambda r: setattr(r, "trained_samples", 2**63), "trained_samples"),
    (lambda r: setattr(r, "state_digest", "x" * 129), "digest"),
    (lambda r: setattr(r, "state_digest", "wrong"), "declared digest"),
    (lambda r: r.params.pop(), "missing"),
    (lambda r: r.momentum.pop(), "missing"),
])
def test_state_response_bounds(change: Callable, needle: str) -> None:
    resp = ok_state_response()
    change(resp)
    assert needle in refused(check_state, resp).reason


# --------------------------------------------------------------------------- DHT records


def test_registrations() -> None:
    reg = validate_registration({"digest": "abc", "applied_rounds": 3, "weight": 12.0})
    assert reg.to_value() == {"digest": "abc", "applied_rounds": 3, "weight": 12.0}
    assert validate_registration({"digest": "abc", "applied_rounds": 0}).weight == 0.0
    for bad in (None, [], "x", {"digest": 5, "applied_rounds": 1}, {"digest": "x" * 200, "applied_rounds": 1},
                {"digest": "a", "applied_rounds": True}, {"digest": "a", "applied_rounds": 1.0},
                {"digest": "a", "applied_rounds": -1}, {"digest": "a", "applied_rounds": 2**40 + 1},
                {"digest": "a", "applied_rounds": 1, "weight": math.nan},
                {"digest": "a", "applied_rounds": 1, "weight": -1.0},
                {"digest": "a", "applied_rounds": 1, "weight": 1e30},
                {"digest": "a", "applied_rounds": 1, "weight": 10**400},
                {"digest": "a", "applied_rounds": 1, "weight": "1"}):
        assert refused(validate_registration, bad).status == pb.BAD_REQUEST, bad


RECORD = dict(stage=1, state="online", throughput=3.5, round=4, applied_rounds=3, digest="d" * 24,
              manifest_hash="h" * 32, driver=False, maddrs=["/ip4/127.0.0.1/tcp/1/p2p/QmX"])


def test_record_fields() -> None:
    assert bounded_record_fields(RECORD) == {**RECORD, "memory": 0, "moving": False, "pinned": False, "stats": None,
                                             "backups": (), "voucher": b""}  # defaults
    stats = bounded_record_fields({**RECORD, "stats": {"train_loss": 2.5, "samples": 10, "from_the_future": 1}})
    assert stats["stats"]["train_loss"] == 2.5 and "from_the_future" not in stats["stats"]
    for bad in ({"train_loss": math.nan}, {"samples": -1}, {"bytes_sent": 1e300}, "lots", {str(i): 0 for i in range(40)}):
        assert "stats" in refused(bounded_record_fields, {**RECORD, "stats": bad}).reason
    assert bounded_record_fields({**RECORD, "memory": 8 << 30, "moving": True})["memory"] == 8 << 30
    assert bounded_record_fields({**RECORD, "maddrs": ()})["maddrs"] == []
    for change, needle in [({"throughput": math.inf}, "throughput"), ({"throughput": -0.1}, "throughput"),
                           ({"throughput": MAX_THROUGHPUT * 2}, "throughput"), ({"throughput": "fast"}, "throughput"),
                           ({"round": 2**41}, "round"), ({"round": -1}, "round"), ({"stage": "1"}, "stage"),
                           ({"applied_rounds": None}, "applied_rounds"), ({"maddrs": ["x"] * 9}, "maddrs"),
                           ({"maddrs": ["x" * 300]}, "maddr"), ({"maddrs": "abc"}, "maddrs"),
                           ({"digest": "d" * 500}, "digest"), ({"driver": 1}, "driver"), ({"state": ""}, "state"),
                           ({"memory": -1}, "memory"), ({"memory": 2**60}, "memory"), ({"moving": "no"}, "moving"),
                           ({"pinned": 1}, "pinned"), ({"voucher": "text"}, "voucher"),
                           ({"voucher": b"v" * 513}, "voucher")]:
        assert needle in refused(bounded_record_fields, {**RECORD, **change}).reason, change
    assert refused(bounded_record_fields, ["not", "a", "dict"]).status == pb.BAD_REQUEST


def test_record_backups() -> None:
    from swarmgrad.protocol.records import MAX_BACKUPS
    assert bounded_record_fields({**RECORD, "backups": [[3, 7], [0, 2]]})["backups"] == ((0, 2), (3, 7))
    for bad, needle in [("many", "backups"), ([[1, 2]] * 2, "twice"), ([[1, 2, 3]], "pair"), ([7], "pair"),
                        ([[-1, 2]], "stage"), ([[1, 2**41]], "applied_rounds"), ([["1", 2]], "stage"),
                        ([[1, 2.5]], "applied_rounds"), ([[i, 0] for i in range(MAX_BACKUPS + 1)], "at most")]:
        assert needle in refused(bounded_record_fields, {**RECORD, "backups": bad}).reason, bad
    from swarmgrad.peer.net.dht_view import PeerRecord  # what a peer announces reads back the same
    rec = PeerRecord(peer_id="p", **{**RECORD, "maddrs": tuple(RECORD["maddrs"])}, backups=((2, 5),))
    assert PeerRecord.from_value("p", rec.to_value()) == rec


# --------------------------------------------------------------------------- decode cost


def test_powersgd_rank_must_be_low_rank() -> None:
    good = get_codec("powersgd:rank=2").encode(torch.randn(40, 30))
    assert good.codec == "powersgd" and decode(good).shape == (40, 30)
    for shape, r in [((3, 40), 3), ((40, 3), 4), ((8, 8), 4), ((0, 5), 1)]:
        m, n = shape
        forged = Encoded("powersgd", shape, "float32", {"rank": r}, (b"\0" * (4 * m * r), b"\0" * (4 * n * r)))
        with pytest.raises(CodecError, match="low rank"):
            decode(forged)
    proto = encoded_to_proto(Encoded("powersgd", (4, 3), "float32", {"rank": 3}, (b"\0" * 48, b"\0" * 36)))
    assert "low rank" in refused(decode_tensor, proto, MAX_NUMEL).reason


def test_topk_index_unpacking_allocates_a_small_multiple_of_the_payload() -> None:
    k, bits = 1 << 19, 20
    rng = np.random.default_rng(0)
    values = rng.integers(0, 1 << bits, size=k, dtype=np.int64)
    packed = _pack_bits(values, bits)  # 1.25 MiB of payload
    tracemalloc.start()
    try:
        out = _unpack_bits(packed, k, bits)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.array_equal(out, values)
    # the result is 8 bytes per index (4 MiB); unpacking whole would take 64 bytes per bit (80 MiB)
    assert peak < 8 * k + 16 * len(packed), peak


def test_topk_counts_must_be_backed_by_bytes() -> None:
    enc_ = get_codec("topk:fraction=0.1,values=int8").encode(torch.randn(100))
    start = time.perf_counter()
    forged = Encoded("topk", (2**30,), "float32", {**enc_.params, "k": 2**29, "index_bits": 30}, enc_.buffers)
    with pytest.raises(CodecError):
        decode(forged, max_numel=2**31)
    assert time.perf_counter() - start < 0.5


# --------------------------------------------------------------------------- fuzzing: only ProtocolError

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def mutations(seed: bytes) -> st.SearchStrategy[bytes]:
    def mutate(data: Any) -> bytes:
        buf = bytearray(seed)
        for op, pos, val in data:
            if not buf:
                buf.extend(bytes([val]))
                continue
            pos %= len(buf)
            if op == 0:
                buf[pos] = val
            elif op == 1:
                del buf[pos:]
            else:
                buf[pos:pos] = bytes([val]) * (1 + val % 5)
        return bytes(buf)
    ops = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=6)
    return st.one_of(st.binary(max_size=400), ops.map(mutate))


def fuzz_parse(data: bytes, message_type: type) -> Any:
    try:
        return parse_bytes(data, message_type)
    except ProtocolError:
        return None


def only_protocol_errors(fn: Callable, *args: Any, **kwargs: Any) -> None:
    try:
        fn(*args, **kwargs)
    except ProtocolError as e:
        assert isinstance(e.status, int) and e.reason


SMALL = torch.randn(2, SEQ, D)
FORWARD_SEEDS = [forward_request(activations=enc(SMALL, s)).SerializeToString()
                 for s in ("fp32", "int8", "int4", "topk:fraction=0.3,values=int8", "powersgd:rank=1,fallback=fp32")]


@FUZZ
@given(st.sampled_from(FORWARD_SEEDS).flatmap(mutations))
def test_fuzz_validate_forward(data: bytes) -> None:
    req = fuzz_parse(data, pb.ForwardRequest)
    if req is not None:
        only_protocol_errors(validate_forward, req, IDENTITY, CONTRACT, MAX_NUMEL)


@FUZZ
@given(mutations(average_request("int8").SerializeToString()))
def test_fuzz_validate_average(data: bytes) -> None:
    req = fuzz_parse(data, pb.AverageRequest)
    if req is not None:
        only_protocol_errors(validate_average, req, IDENTITY, 1, parts, MAX_NUMEL)


@FUZZ
@given(mutations(ok_forward_response().SerializeToString()), st.booleans())
def test_fuzz_validate_forward_response(data: bytes, eval_only: bool) -> None:
    resp = fuzz_parse(data, pb.ForwardResponse)
    if resp is not None:
        only_protocol_errors(validate_forward_response, resp, (2, SEQ, D), eval_only, MAX_NUMEL, None)


@FUZZ
@given(mutations(ok_average_response().SerializeToString()))
def test_fuzz_validate_average_response(data: bytes) -> None:
    resp = fuzz_parse(data, pb.AverageResponse)
    if resp is not None:
        only_protocol_errors(validate_average_response, resp, PART, PEERS, MAX_NUMEL)


def ok_gather_response() -> pb.AverageResponse:
    others = [pb.Contribution(member=PEERS[1], weight=8.0, tensors=named(part(3)))]
    return pb.AverageResponse(status=pb.OK, contributors=list(PEERS), others=others, total_weight=16.0)


def test_the_gather_fuzz_seed_is_valid() -> None:
    assert validate_gather_response(ok_gather_response(), PART, PEERS, PEERS[0], {PEERS[1]: 8.0}, MAX_NUMEL).ok


@FUZZ
@given(mutations(ok_gather_response().SerializeToString()))
def test_fuzz_validate_gather_response(data: bytes) -> None:
    resp = fuzz_parse(data, pb.AverageResponse)
    if resp is not None:
        only_protocol_errors(validate_gather_response, resp, PART, PEERS, PEERS[0], {PEERS[1]: 8.0}, MAX_NUMEL)


@FUZZ
@given(mutations(ok_state_response().SerializeToString()))
def test_fuzz_validate_state_response(data: bytes) -> None:
    resp = fuzz_parse(data, pb.StateResponse)
    if resp is not None:
        only_protocol_errors(validate_state_response, resp, PART, MAX_NUMEL, digest_fn=digest)


PARAM_KEYS = ["block_size", "k", "index_bits", "values", "rank", "values.block_size", "overflow", "x"]
PARAM_VALUES = st.one_of(st.integers(-3, 70), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                         st.sampled_from(["fp32", "int8", "topk", "int4", ""]), st.booleans(), st.none(),
                         st.lists(st.integers(0, 3), max_size=2))


@FUZZ
@given(codec=st.sampled_from(list(CODEC_NAMES) + ["zstd"]),
       shape=st.lists(st.integers(-1, 40), max_size=4),
       dtype=st.sampled_from(["float32", "float16", "bfloat16", "int8"]),
       params=st.one_of(st.dictionaries(st.sampled_from(PARAM_KEYS), PARAM_VALUES, max_size=4).map(json.dumps),
                        st.text(max_size=40)),
       buffers=st.lists(st.binary(max_size=300), max_size=4))
def test_fuzz_decode_tensor_headers(codec: str, shape: list[int], dtype: str, params: str,
                                    buffers: list[bytes]) -> None:
    proto = pb.EncodedTensor(codec=codec, shape=shape, dtype=dtype, params_json=params, buffers=buffers)
    only_protocol_errors(decode_tensor, proto, MAX_NUMEL)


def test_fuzz_registrations_and_records() -> None:
    @FUZZ
    @given(st.dictionaries(st.sampled_from(list(RECORD) + ["weight", "extra", "backups"]),
                           st.one_of(PARAM_VALUES, st.text(max_size=300)), max_size=10))
    def run(value: dict) -> None:
        only_protocol_errors(validate_registration, value)
        only_protocol_errors(bounded_record_fields, value)
    run()


# --------------------------------------------------------------------------- raw stream reader, no network


def reader_with(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


def read_now(data: bytes, max_bytes: int = 1 << 20, eof: bool = True) -> tuple[Any, asyncio.StreamReader]:
    async def main() -> Any:
        reader = reader_with(data, eof)
        try:
            return await read_stream_message(reader, pb.StateRequest, max_bytes), reader
        except ProtocolError as e:
            return e, reader
    return asyncio.run(main())


def test_stream_reader_refuses_a_huge_prefix_unread() -> None:
    out, reader = read_now((2**40).to_bytes(HEADER_BYTES, "big") + b"\0" * 1000)
    assert isinstance(out, ProtocolError) and out.status == pb.TOO_LARGE and str(2**40) in out.reason
    assert len(reader._buffer) == 1000  # nothing past the prefix was read  # noqa: SLF001
    out, _ = read_now((MAX_FRAME_BYTES + 1).to_bytes(HEADER_BYTES, "big"))
    assert isinstance(out, ProtocolError) and out.status == pb.TOO_LARGE


def test_stream_reader_bounds_frames_and_bytes() -> None:
    out, reader = read_now(b"\0" * HEADER_BYTES * 100_000)
    assert isinstance(out, ProtocolError) and out.status == pb.TOO_LARGE and "frames" in out.reason
    assert len(reader._buffer) > HEADER_BYTES * 99_000  # stopped after a handful  # noqa: SLF001
    chunks, _ = encode_stream(pb.StateRequest(envelope=pb.Envelope(run_id="x" * 5000)), frame_bytes=1000)
    out, _ = read_now(b"".join(chunks), max_bytes=3000)
    assert isinstance(out, ProtocolError) and out.status == pb.TOO_LARGE and "3000 bytes" in out.reason
    out, _ = read_now(b"".join(chunks[:-1]))
    assert isinstance(out, ProtocolError) and out.status == pb.BAD_REQUEST and "last frame" in out.reason
    out, _ = read_now((3).to_bytes(HEADER_BYTES, "big") + b"\xff\xff\xff")
    assert isinstance(out, ProtocolError) and out.status == pb.BAD_REQUEST and "unparsable Frame" in out.reason
    msg = pb.StateRequest(envelope=pb.Envelope(run_id="ok"))
    chunks, size = encode_stream(msg)
    (back, got), _ = read_now(b"".join(chunks))
    assert back == msg and got == size


# --------------------------------------------------------------------------- live: two P2P instances

NS = "hostile-test"
MAX_MSG = 1 << 20
READ_TIMEOUT = 1.0
Body = Callable[[Any, Any, Any, Any], Awaitable[Any]]


def echo_refusal(status: int, reason: str) -> pb.StateResponse:
    return pb.StateResponse(status=status, reason=reason)


async def echo(req: pb.StateRequest, peer: Any) -> pb.StateResponse:
    return pb.StateResponse(status=pb.OK, state_digest=f"echo:{req.envelope.run_id}")


def with_pair(body: Body, **server_kw: Any) -> Any:
    """Run `body(server_p2p, client_p2p, server_rpc, client_rpc)` on two fresh P2P daemons."""
    from hivemind.p2p import P2P

    from swarmgrad.peer.net.rpc import FramedRPC, Traffic

    async def main() -> Any:
        a = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        b = None
        try:
            b = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await a.get_visible_maddrs())
            server = FramedRPC(a, NS, Traffic(), MAX_MSG, read_timeout=READ_TIMEOUT, **server_kw)
            await server.add_handler("echo", pb.StateRequest, echo, echo_refusal)
            client = FramedRPC(b, NS, Traffic(), MAX_MSG)
            return await asyncio.wait_for(body(a, b, server, client), 60)
        finally:
            if b is not None:
                await b.shutdown()
            await a.shutdown()

    return asyncio.run(main())


async def valid_call(client: Any, a: Any, tag: str) -> None:
    resp = await client.call(a.peer_id, "echo", pb.StateRequest(envelope=pb.Envelope(run_id=tag)),
                             pb.StateResponse, timeout=10)
    assert resp.status == pb.OK and resp.state_digest == f"echo:{tag}", resp


async def raw_stream(b: Any, a: Any, method: str = "echo") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    _, reader, writer = await b.call_binary_stream_handler(a.peer_id, f"{NS}::{method}")
    return reader, writer


async def flood(writer: asyncio.StreamWriter, total: int, chunk: bytes = b"\0" * (1 << 16)) -> int:
    """Write up to `total` bytes until the other side stops taking them; returns bytes written."""
    sent = 0
    try:
        while sent < total:
            writer.write(chunk)
            await writer.drain()
            sent += len(chunk)
    except (ConnectionError, OSError):
        pass
    return sent


async def refusal_of(reader: asyncio.StreamReader, timeout: float = 10.0) -> pb.StateResponse:
    resp, _ = await asyncio.wait_for(read_stream_message(reader, pb.StateResponse, MAX_MSG), timeout)
    return resp


def rss() -> int:
    return psutil.Process().memory_info().rss


@pytest.mark.timeout(120)
def test_server_survives_stream_attacks(p2p_daemons: None) -> None:
    """Each attack is refused with its status; memory stays flat; a valid call works after each."""
    outcomes: dict[str, tuple[int, str, float]] = {}

    async def body(a: Any, b: Any, server: Any, client: Any) -> None:
        await valid_call(client, a, "before")
        before = rss()

        # 1. a frame whose length prefix claims 2**40 bytes, followed by a flood of up to 512 MiB
        # (hivemind's own reader would buffer all of it); the server stops reading at once
        reader, writer = await raw_stream(b, a)
        start = time.perf_counter()
        writer.write((2**40).to_bytes(HEADER_BYTES, "big"))
        flooding = asyncio.create_task(flood(writer, 512 << 20))
        resp = await refusal_of(reader)
        outcomes["2**40 prefix"] = (resp.status, resp.reason, time.perf_counter() - start)
        outcomes["flood MB taken"] = (0, "", await asyncio.wait_for(flooding, 20) / 2**20)
        writer.close()
        await valid_call(client, a, "after huge prefix")

        # 2. 10**5 empty frames
        reader, writer = await raw_stream(b, a)
        start = time.perf_counter()
        flooding = asyncio.create_task(flood(writer, 10**5 * HEADER_BYTES, b"\0" * HEADER_BYTES * 1000))
        resp = await refusal_of(reader)
        outcomes["1e5 empty frames"] = (resp.status, resp.reason, time.perf_counter() - start)
        await flooding
        writer.close()
        await valid_call(client, a, "after empty frames")

        # 3. a request that never finishes: one frame without `last`, then silence
        reader, writer = await raw_stream(b, a)
        start = time.perf_counter()
        body_ = pb.Frame(data=b"\x0a\x02", last=False).SerializeToString()
        writer.write(len(body_).to_bytes(HEADER_BYTES, "big") + body_)
        resp = await refusal_of(reader)
        outcomes["never finishes"] = (resp.status, resp.reason, time.perf_counter() - start)
        writer.close()
        await valid_call(client, a, "after slow stream")

        # 4. more concurrent streams than allowed: 3 held open (silent), a 4th and a real call refused
        held = [await raw_stream(b, a) for _ in range(3)]
        await until(lambda: server.open_streams == 3, "the server admitted the 3 held streams")
        reader, writer = await raw_stream(b, a)
        start = time.perf_counter()
        resp = await refusal_of(reader)
        outcomes["4th concurrent stream"] = (resp.status, resp.reason, time.perf_counter() - start)
        writer.close()
        busy = await client.call(a.peer_id, "echo", pb.StateRequest(), pb.StateResponse, timeout=10)
        outcomes["call while 3 held"] = (busy.status, busy.reason, 0.0)
        for r, _ in held:  # the held streams are refused once the read deadline passes
            assert (await refusal_of(r)).status == pb.DEADLINE_EXCEEDED
        for _, w in held:
            w.close()
        await valid_call(client, a, "after concurrent streams")

        # 5. request bytes held across streams: a 100 kB frame held open uses most of the budget
        reader, writer = await raw_stream(b, a)
        frame = pb.Frame(data=b"\1" * 100_000, last=False).SerializeToString()
        writer.write(len(frame).to_bytes(HEADER_BYTES, "big") + frame)
        await writer.drain()
        await until(lambda: server.buffered_bytes >= 100_000, "the server holds the 100 kB frame")
        big = pb.StateRequest(envelope=pb.Envelope(run_id="x" * 100_000))
        over = await client.call(a.peer_id, "echo", big, pb.StateResponse, timeout=10)
        outcomes["bytes over budget"] = (over.status, over.reason, 0.0)
        assert (await refusal_of(reader)).status == pb.DEADLINE_EXCEEDED
        writer.close()
        # the refusal is written before the server lets go of the held frame's bytes: wait for that,
        # or a loaded machine's next call can still find the budget taken
        await until(lambda: server.buffered_bytes == 0, "the server let go of the held frame's bytes")
        await valid_call(client, a, "x" * 100_000)
        await until(lambda: server.open_streams == 0 and server.buffered_bytes == 0,
                    "the server let go of every stream and byte")
        outcomes["rss growth MB"] = (0, "", (rss() - before) / 2**20)

    with_pair(body, max_streams_per_peer=3, max_buffered_bytes=150_000)
    print({k: (status_name(s), r[:60], round(t, 2)) for k, (s, r, t) in outcomes.items()})
    assert outcomes["2**40 prefix"][:2] == (pb.TOO_LARGE, f"frame of {2**40} bytes exceeds {MAX_FRAME_BYTES}")
    assert outcomes["1e5 empty frames"][0] == pb.TOO_LARGE and "frames" in outcomes["1e5 empty frames"][1]
    status, reason, took = outcomes["never finishes"]
    assert status == pb.DEADLINE_EXCEEDED and READ_TIMEOUT * 0.9 <= took < READ_TIMEOUT + 3, (reason, took)
    assert outcomes["4th concurrent stream"][0] == pb.BUSY
    assert outcomes["call while 3 held"][0] == pb.BUSY
    assert outcomes["bytes over budget"][0] == pb.BUSY and "bytes in flight" in outcomes["bytes over budget"][1]
    assert outcomes["rss growth MB"][2] < 100
    assert outcomes["flood MB taken"][2] < 256  # the stream was cut long before the flood's end


@pytest.mark.timeout(120)
def test_client_survives_hostile_servers(p2p_daemons: None) -> None:
    """A server that answers with a huge prefix, endless frames, silence, garbage or an unknown
    status: every call ends in RPCFailed (or a response the validators refuse), quickly."""
    from swarmgrad.peer.net.rpc import RPCFailed

    async def huge(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write((2**40).to_bytes(HEADER_BYTES, "big"))
        await flood(writer, 8 << 20)
        writer.close()

    async def empty_frames(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await flood(writer, 10**5 * HEADER_BYTES, b"\0" * HEADER_BYTES * 1000)
        writer.close()

    async def silent(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)
        writer.close()

    async def read_request(reader: asyncio.StreamReader) -> None:
        """Take the client's request first: closing a stream with unread input resets it, and the
        client would then see a reset instead of the hostile answer under test."""
        while True:
            size = int.from_bytes(await reader.readexactly(HEADER_BYTES), "big")
            frame = pb.Frame()
            frame.ParseFromString(await reader.readexactly(size))
            if frame.last:
                return

    async def garbage(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        frame = pb.Frame(data=b"\xff\xff\xff\xff", last=True).SerializeToString()
        writer.write(len(frame).to_bytes(HEADER_BYTES, "big") + frame)
        await writer.drain()
        writer.close()

    async def unknown_status(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        chunks, _ = encode_stream(pb.StateResponse(status=99, reason="?"))
        writer.write(b"".join(chunks))
        await writer.drain()
        writer.close()

    handlers = {"huge": huge, "empty": empty_frames, "silent": silent, "garbage": garbage, "status99": unknown_status}
    outcomes: dict[str, tuple[str, float]] = {}

    async def body(a: Any, b: Any, server: Any, client: Any) -> None:
        for name, handler in handlers.items():
            await a.add_binary_stream_handler(f"{NS}::{name}", handler)
        before = rss()
        for name in handlers:
            start = time.perf_counter()
            try:
                resp = await client.call(a.peer_id, name, pb.StateRequest(), pb.StateResponse, timeout=1.5)
                validate_state_response(resp, PART, MAX_NUMEL, digest_fn=digest)
                outcome = "accepted"
            except RPCFailed as e:
                outcome = f"RPCFailed: {e}"
            except ProtocolError as e:
                outcome = f"ProtocolError: {e}"
            outcomes[name] = (outcome, time.perf_counter() - start)
        await valid_call(client, a, "after hostile servers")
        outcomes["rss growth MB"] = ("", (rss() - before) / 2**20)

    with_pair(body)
    print({k: (o[:80], round(t, 2)) for k, (o, t) in outcomes.items()})
    assert outcomes["huge"][0].startswith("RPCFailed") and "TOO_LARGE" in outcomes["huge"][0]
    assert outcomes["empty"][0].startswith("RPCFailed") and "frames" in outcomes["empty"][0]
    assert outcomes["silent"][0].startswith("RPCFailed") and "timed out" in outcomes["silent"][0]
    assert outcomes["garbage"][0].startswith("RPCFailed") and "unparsable" in outcomes["garbage"][0], outcomes["garbage"]
    assert outcomes["status99"][0].startswith("ProtocolError") and "unknown status 99" in outcomes["status99"][0]
    for name in ("huge", "empty", "garbage", "status99"):
        assert outcomes[name][1] < 1.5, (name, outcomes[name])
    assert outcomes["rss growth MB"][1] < 100


@pytest.mark.timeout(60)
def test_server_keeps_its_side_open_until_the_caller_has_the_answer(p2p_daemons: None) -> None:
    """A handler that closed its stream right after writing the answer lost answers under load: the
    p2p daemon resets a stream whose handler side closed while the caller's side is open, and the
    reset drops what the caller's daemon had not yet handed over ("stream ended before the last
    frame" from a live peer). So the server closes only once the caller closed (or drain_timeout)."""
    from swarmgrad.protocol.framing import encode_stream

    async def body(a: Any, b: Any, server: Any, client: Any) -> None:
        reader, writer = await raw_stream(b, a)
        chunks, _ = encode_stream(pb.StateRequest(envelope=pb.Envelope(run_id="x")))
        for chunk in chunks:
            writer.write(chunk)
        await writer.drain()
        resp = await refusal_of(reader)
        assert resp.status == pb.OK and resp.state_digest == "echo:x"
        with pytest.raises(asyncio.TimeoutError):  # no end of stream: the server waits for us
            await asyncio.wait_for(reader.read(1), 1.0)
        assert server.open_streams == 1
        writer.close()
        await until(lambda: server.open_streams == 0, "the server let go of the stream once we closed")
        await valid_call(client, a, "after")

    with_pair(body, drain_timeout=30.0)
