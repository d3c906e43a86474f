"""The wire boundary: validation of forward/average requests, framing, and the generated code.

Every refusal is checked for its wire Status and for a reason that names the problem.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from typing import Iterable

import pytest
import torch

from swarmgrad.compression import get_codec
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.framing import (FRAME_BYTES, HEADER_BYTES, PARSE_OFF_LOOP_BYTES, ProtocolError,
                                        max_frames_for, read_stream_message, to_frames)
from swarmgrad.protocol.validation import (
    MAX_PARAMS_JSON,
    RunIdentity,
    StageContract,
    decode_named,
    decode_tensor,
    encoded_from_proto,
    encoded_to_proto,
    envelope,
    narrow_integers,
    raw_from_tensor,
    raw_to_tensor,
    validate_average,
    validate_forward,
)

SEQ, D, VOCAB, MAX_BATCH = 16, 8, 256, 4
MAX_NUMEL = 1 << 24
IDENTITY = RunIdentity(run_id="run-a", manifest_hash="0123456789abcdef0123456789abcdef")


def input_spec(b: int) -> tuple[tuple[int, ...], torch.dtype]:
    return (b, SEQ, D), torch.float32


def targets_spec(b: int) -> tuple[tuple[int, ...], torch.dtype]:
    return (b, SEQ), torch.int64


CONTRACT = StageContract(stage=1, n_stages=2, max_batch=MAX_BATCH, input_spec=input_spec,
                         targets_spec=targets_spec, vocab_size=VOCAB)


def activations(b: int = 2, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, SEQ, D, generator=g)


def targets(b: int = 2, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, VOCAB, (b, SEQ), generator=g)


def fp16_proto(t: torch.Tensor) -> pb.EncodedTensor:
    return encoded_to_proto(get_codec("fp16").encode(t))


def fp32_proto_by_hand(t: torch.Tensor) -> pb.EncodedTensor:
    """An fp32 EncodedTensor built without the codec (which refuses to encode NaN/Inf)."""
    return pb.EncodedTensor(codec="fp32", shape=list(t.shape), dtype="float32", params_json="",
                            buffers=[t.contiguous().numpy().astype("<f4").tobytes()])


def forward_request(b: int = 2, **overrides) -> pb.ForwardRequest:
    req = pb.ForwardRequest(envelope=envelope(IDENTITY, 1), microbatch_id=7, attempt=1, driver="driver-peer",
                            activations=fp16_proto(activations(b)), targets=raw_from_tensor(targets(b)),
                            deadline=1234.5, eval_only=False)
    for name, value in overrides.items():
        if value is None:
            req.ClearField(name)
        elif isinstance(value, pb.Envelope | pb.EncodedTensor | pb.RawTensor):
            getattr(req, name).CopyFrom(value)
        else:
            setattr(req, name, value)
    return req


def refused(fn, *args, **kwargs) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        fn(*args, **kwargs)
    err = info.value
    assert str(err).startswith(pb.Status.Name(err.status)), str(err)
    return err


# --------------------------------------------------------------------------- validate_forward: accepted


@pytest.mark.parametrize("b", [1, 2, MAX_BATCH])
def test_valid_forward_round_trips_values(b: int) -> None:
    req = forward_request(b)
    out = validate_forward(req, IDENTITY, CONTRACT, MAX_NUMEL)
    assert torch.equal(out.activations, activations(b).half().float())
    assert out.activations.dtype == torch.float32
    assert torch.equal(out.targets, targets(b)) and out.targets.dtype == torch.int64
    assert (out.microbatch_id, out.attempt, out.driver, out.deadline, out.eval_only) == (7, 1, "driver-peer", 1234.5, False)


def test_valid_forward_survives_serialisation() -> None:
    req = pb.ForwardRequest.FromString(forward_request(3, eval_only=True).SerializeToString())
    out = validate_forward(req, IDENTITY, CONTRACT, MAX_NUMEL)
    assert out.eval_only is True
    assert torch.equal(out.activations, activations(3).half().float())


def test_targets_at_vocab_edges_are_accepted() -> None:
    t = targets(2)
    t[0, 0], t[1, -1] = 0, VOCAB - 1
    out = validate_forward(forward_request(targets=raw_from_tensor(t)), IDENTITY, CONTRACT, MAX_NUMEL)
    assert int(out.targets.min()) == 0 and int(out.targets.max()) == VOCAB - 1


# --------------------------------------------------------------------------- validate_forward: refused


def bad_shape_proto(shape: list[int], buffer: bytes = b"\x00" * 16) -> pb.EncodedTensor:
    return pb.EncodedTensor(codec="fp16", shape=shape, dtype="float32", buffers=[buffer])


def with_activation_field(**fields) -> pb.EncodedTensor:
    proto = fp16_proto(activations(2))
    for name, value in fields.items():
        if name in ("shape", "buffers"):
            del getattr(proto, name)[:]
            getattr(proto, name).extend(value)
        else:
            setattr(proto, name, value)
    return proto


def nonfinite(value: float) -> torch.Tensor:
    t = activations(2)
    t[1, 3, 5] = value
    return t


def raw(dtype: str, shape: list[int], data: bytes) -> pb.RawTensor:
    return pb.RawTensor(dtype=dtype, shape=shape, data=data)


FORWARD_REFUSALS = [
    ("wrong run id", dict(envelope=pb.Envelope(run_id="run-b", manifest_hash=IDENTITY.manifest_hash, stage=1)),
     pb.WRONG_RUN, "run_id"),
    ("wrong manifest hash", dict(envelope=pb.Envelope(run_id="run-a", manifest_hash="f" * 32, stage=1)),
     pb.WRONG_RUN, "manifest hash"),
    ("wrong stage", dict(envelope=envelope(IDENTITY, 2)), pb.WRONG_STAGE, "stage 2"),
    ("missing envelope", dict(envelope=None), pb.WRONG_RUN, "run_id"),
    ("wrong activation shape", dict(activations=fp16_proto(torch.zeros(2, SEQ, D + 1))), pb.BAD_REQUEST,
     "expected [2, 16, 8]"),
    ("activations rank 2", dict(activations=fp16_proto(torch.zeros(2, SEQ))), pb.BAD_REQUEST, "expected [2, 16, 8]"),
    ("batch 0", dict(activations=fp16_proto(torch.zeros(0, SEQ, D)), targets=raw_from_tensor(targets(0))),
     pb.BAD_REQUEST, "batch of 0"),
    ("scalar activations", dict(activations=fp16_proto(torch.zeros(()))), pb.BAD_REQUEST, "batch of 0"),
    ("batch over max", dict(activations=fp16_proto(activations(MAX_BATCH + 1)),
                            targets=raw_from_tensor(targets(MAX_BATCH + 1))), pb.BAD_REQUEST, "batch of 5"),
    ("targets float32", dict(targets=raw_from_tensor(targets(2).float())), pb.BAD_REQUEST, "torch.float32"),
    ("targets wrong shape", dict(targets=raw_from_tensor(targets(2)[:, :-1])), pb.BAD_REQUEST, "targets: [2, 15]"),
    ("targets too many rows", dict(targets=raw_from_tensor(targets(3))), pb.BAD_REQUEST, "targets: [3, 16]"),
    ("target = vocab", dict(targets=raw_from_tensor(targets(2).clamp(max=0) + VOCAB)), pb.BAD_REQUEST,
     "outside [0, 256)"),
    ("target negative", dict(targets=raw_from_tensor(targets(2).clamp(max=0) - 1)), pb.BAD_REQUEST, "outside [0, 256)"),
    ("NaN activations", dict(activations=fp32_proto_by_hand(nonfinite(math.nan))), pb.BAD_REQUEST, "NaN or Inf"),
    ("Inf activations", dict(activations=fp32_proto_by_hand(nonfinite(math.inf))), pb.BAD_REQUEST, "NaN or Inf"),
    ("-Inf activations", dict(activations=fp32_proto_by_hand(nonfinite(-math.inf))), pb.BAD_REQUEST, "NaN or Inf"),
    ("unknown codec", dict(activations=with_activation_field(codec="zstd")), pb.BAD_REQUEST, "unknown codec 'zstd'"),
    ("dtype float64", dict(activations=with_activation_field(dtype="float64")), pb.BAD_REQUEST, "dtype 'float64'"),
    ("dtype int8", dict(activations=with_activation_field(dtype="int8")), pb.BAD_REQUEST, "dtype 'int8'"),
    ("negative dim", dict(activations=bad_shape_proto([2, -16, 8])), pb.BAD_REQUEST, "negative dimension"),
    ("negative batch", dict(activations=bad_shape_proto([-2, 16, 8])), pb.BAD_REQUEST, "batch of -2"),
    ("numel over max", dict(activations=bad_shape_proto([2, 2**40, 8])), pb.TOO_LARGE, "exceeds"),
    ("params not JSON", dict(activations=with_activation_field(params_json="{not json")), pb.BAD_REQUEST, "not JSON"),
    ("params not object", dict(activations=with_activation_field(params_json="[1, 2]")), pb.BAD_REQUEST,
     "JSON object"),
    ("params too long", dict(activations=with_activation_field(
        params_json=json.dumps({"pad": "x" * MAX_PARAMS_JSON}))), pb.BAD_REQUEST, "longer than 4096"),
    ("payload too short", dict(activations=with_activation_field(buffers=[b"\x00" * 10])), pb.BAD_REQUEST,
     "activations"),
    ("unexpected codec params", dict(activations=with_activation_field(params_json='{"block_size": 4}')),
     pb.BAD_REQUEST, "params"),
    ("raw bytes short", dict(targets=raw("int64", [2, SEQ], b"\x00" * (2 * SEQ * 8 - 1))), pb.BAD_REQUEST,
     "255 bytes"),
    ("raw bytes long", dict(targets=raw("int64", [2, SEQ], b"\x00" * (2 * SEQ * 8 + 8))), pb.BAD_REQUEST,
     "264 bytes"),
    ("raw dtype float64", dict(targets=raw("float64", [2, SEQ], b"\x00" * (2 * SEQ * 8))), pb.BAD_REQUEST,
     "dtype 'float64'"),
    ("raw negative dim", dict(targets=raw("int64", [2, -SEQ], b"")), pb.BAD_REQUEST, "negative dimension"),
    ("raw numel over max", dict(targets=raw("int64", [2**40], b"\x00" * 8)), pb.TOO_LARGE, "exceeds"),
    ("raw too many dims", dict(targets=raw("int64", [1] * 9, b"\x00" * 8)), pb.BAD_REQUEST, "9 dimensions"),
    ("no driver", dict(driver=""), pb.BAD_REQUEST, "driver"),
    ("NaN deadline", dict(deadline=math.nan), pb.BAD_REQUEST, "deadline"),
    ("Inf deadline", dict(deadline=math.inf), pb.BAD_REQUEST, "deadline"),
]


@pytest.mark.parametrize("overrides, status, needle", [pytest.param(o, s, n, id=i) for i, o, s, n in FORWARD_REFUSALS])
def test_forward_refusals(overrides: dict, status: int, needle: str) -> None:
    req = forward_request(**overrides)
    err = refused(validate_forward, req, IDENTITY, CONTRACT, MAX_NUMEL)
    assert pb.Status.Name(err.status) == pb.Status.Name(status), err
    assert needle in err.reason, err.reason


@pytest.mark.parametrize("field", ["activations", "targets"])
def test_forward_missing_tensor(field: str) -> None:
    req = forward_request(**{field: None})
    err = refused(validate_forward, req, IDENTITY, CONTRACT, MAX_NUMEL)
    assert err.status == pb.BAD_REQUEST
    assert "needs activations and targets" in err.reason


def test_stage_zero_takes_no_forward_requests() -> None:
    contract = StageContract(stage=0, n_stages=2, max_batch=4, input_spec=input_spec, targets_spec=targets_spec)
    req = forward_request(envelope=envelope(IDENTITY, 0))
    err = refused(validate_forward, req, IDENTITY, contract, MAX_NUMEL)
    assert err.status == pb.WRONG_STAGE and "stage 0" in err.reason


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32])
def test_narrowed_targets_are_widened_to_the_spec(dtype: torch.dtype) -> None:
    t = targets(2)
    out = validate_forward(forward_request(targets=raw_from_tensor(t.to(dtype))), IDENTITY, CONTRACT, MAX_NUMEL)
    assert out.targets.dtype == torch.int64 and torch.equal(out.targets, t)


def test_narrowed_targets_are_still_range_checked() -> None:
    contract = StageContract(stage=1, n_stages=2, max_batch=4, input_spec=input_spec, targets_spec=targets_spec,
                             vocab_size=100)
    t = targets(2).clamp(max=99).to(torch.uint8)
    t[0, 0] = 200
    err = refused(validate_forward, forward_request(targets=raw_from_tensor(t)), IDENTITY, contract, MAX_NUMEL)
    assert err.status == pb.BAD_REQUEST and "outside [0, 100)" in err.reason


def test_integer_targets_are_not_narrowed_into_a_float_spec() -> None:
    float_spec = lambda b: ((b, SEQ), torch.float32)  # noqa: E731
    contract = StageContract(stage=1, n_stages=2, max_batch=4, input_spec=input_spec, targets_spec=float_spec)
    err = refused(validate_forward, forward_request(targets=raw_from_tensor(targets(2).to(torch.uint8))),
                  IDENTITY, contract, MAX_NUMEL)
    assert err.status == pb.BAD_REQUEST and "torch.float32" in err.reason


@pytest.mark.parametrize("values, dtype", [
    ([0, 255], torch.uint8), ([-1, 5], torch.int32), ([0, 256], torch.int32),
    ([-2**31, 2**31 - 1], torch.int32), ([0, 2**31], torch.int64), ([-2**31 - 1, 0], torch.int64),
])
def test_narrow_integers_picks_the_narrowest_dtype_that_holds_the_values(values: list[int], dtype: torch.dtype) -> None:
    t = torch.tensor(values, dtype=torch.int64)
    narrow = narrow_integers(t)
    assert narrow.dtype == dtype and torch.equal(narrow.long(), t)


def test_narrow_integers_leaves_floats_and_empty_tensors() -> None:
    for t in (torch.tensor([1.5, 2.0]), torch.zeros(0, dtype=torch.int64), torch.tensor([1, 2], dtype=torch.uint8)):
        assert narrow_integers(t) is t


def test_byte_targets_cost_one_byte_each_on_the_wire() -> None:
    t = targets(4)
    assert len(raw_from_tensor(narrow_integers(t)).data) == t.numel()


def test_vocab_unset_skips_range_check() -> None:
    contract = StageContract(stage=1, n_stages=2, max_batch=4, input_spec=input_spec, targets_spec=targets_spec)
    t = targets(2) + 1000
    out = validate_forward(forward_request(targets=raw_from_tensor(t)), IDENTITY, contract, MAX_NUMEL)
    assert torch.equal(out.targets, t)


def test_huge_shapes_refused_without_allocating() -> None:
    # 2**40 float32 values would be 4 TiB: the refusal must come from the header alone
    tiny = pb.EncodedTensor(codec="fp32", shape=[2**40], dtype="float32", buffers=[b"\x00" * 4])
    for fn in (encoded_from_proto, decode_tensor):
        err = refused(fn, tiny, MAX_NUMEL, "big")
        assert err.status == pb.TOO_LARGE and "big" in err.reason and str(MAX_NUMEL) in err.reason
    err = refused(raw_to_tensor, raw("uint8", [2**20, 2**20], b"\x00"), MAX_NUMEL)
    assert err.status == pb.TOO_LARGE


def test_max_numel_boundary() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    proto = encoded_to_proto(get_codec("fp32").encode(t))
    assert torch.equal(decode_tensor(proto, 12), t)
    assert refused(decode_tensor, proto, 11).status == pb.TOO_LARGE
    r = raw_from_tensor(torch.arange(12).reshape(3, 4))
    assert torch.equal(raw_to_tensor(r, 12), torch.arange(12).reshape(3, 4))
    assert refused(raw_to_tensor, r, 11).status == pb.TOO_LARGE


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.float32])
def test_raw_round_trip(dtype: torch.dtype) -> None:
    t = (torch.arange(24) % 200).to(dtype).reshape(2, 3, 4)
    back = raw_to_tensor(raw_from_tensor(t.transpose(0, 2)), MAX_NUMEL)
    assert back.dtype == dtype and torch.equal(back, t.transpose(0, 2))


def test_raw_from_tensor_refuses_other_dtypes() -> None:
    with pytest.raises(ValueError, match="float64"):
        raw_from_tensor(torch.zeros(2, dtype=torch.float64))


def test_raw_float_nan_refused() -> None:
    err = refused(raw_to_tensor, raw_from_tensor(torch.tensor([1.0, math.nan])), MAX_NUMEL)
    assert err.status == pb.BAD_REQUEST and "NaN or Inf" in err.reason


# --------------------------------------------------------------------------- decode_named, validate_average

PART_SHAPES = {"w": (4, 3), "b": (3,)}


def named(name: str, t: torch.Tensor) -> pb.NamedTensor:
    return pb.NamedTensor(name=name, tensor=encoded_to_proto(get_codec("fp32").encode(t)))


def part_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in PART_SHAPES.items()}


def test_decode_named_round_trip() -> None:
    ts = part_tensors()
    out = decode_named([named(n, t) for n, t in ts.items()], PART_SHAPES, MAX_NUMEL, "part 0")
    assert out.keys() == ts.keys()
    for n in ts:
        assert torch.equal(out[n], ts[n])


@pytest.mark.parametrize("names, needle", [
    (["w", "b", "b"], "duplicate"),
    (["w"], "missing ['b']"),
    (["w", "b", "extra"], "unexpected ['extra']"),
    (["w", "c"], "missing ['b'], unexpected ['c']"),
    ([], "missing ['b', 'w']"),
])
def test_decode_named_refuses_name_mismatch(names: list[str], needle: str) -> None:
    tensors = [named(n, torch.zeros(PART_SHAPES.get(n, (3,)))) for n in names]
    err = refused(decode_named, tensors, PART_SHAPES, MAX_NUMEL, "part 0")
    assert err.status == pb.BAD_REQUEST and needle in err.reason and "part 0" in err.reason


def test_decode_named_refuses_wrong_shape() -> None:
    tensors = [named("w", torch.zeros(3, 4)), named("b", torch.zeros(3))]
    err = refused(decode_named, tensors, PART_SHAPES, MAX_NUMEL, "part 0")
    assert err.status == pb.BAD_REQUEST and "part 0 w" in err.reason and "expected [4, 3]" in err.reason


def part_shapes(part: int) -> dict[str, tuple[int, ...]] | None:
    return PART_SHAPES if part == 2 else None


def average_request(**overrides) -> pb.AverageRequest:
    req = pb.AverageRequest(envelope=envelope(IDENTITY, 1), round=5, group_hash="g" * 16, state_digest="d" * 24,
                            weight=32.0, part=2, tensors=[named(n, t) for n, t in part_tensors().items()])
    for name, value in overrides.items():
        if isinstance(value, pb.Envelope):
            req.envelope.CopyFrom(value)
        elif name == "tensors":
            del req.tensors[:]
            req.tensors.extend(value)
        else:
            setattr(req, name, value)
    return req


def test_valid_average() -> None:
    out = validate_average(average_request(), IDENTITY, 1, part_shapes, MAX_NUMEL)
    assert (out.round, out.group_hash, out.state_digest, out.weight, out.part) == (5, "g" * 16, "d" * 24, 32.0, 2)
    ts = part_tensors()
    assert out.tensors.keys() == ts.keys()
    for n in ts:
        assert torch.equal(out.tensors[n], ts[n])


def test_average_zero_weight_is_accepted() -> None:
    assert validate_average(average_request(weight=0.0), IDENTITY, 1, part_shapes, MAX_NUMEL).weight == 0.0


AVERAGE_REFUSALS = [
    ("wrong run", dict(envelope=pb.Envelope(run_id="x", manifest_hash=IDENTITY.manifest_hash, stage=1)),
     pb.WRONG_RUN, "run_id"),
    ("wrong hash", dict(envelope=pb.Envelope(run_id="run-a", manifest_hash="e" * 32, stage=1)), pb.WRONG_RUN,
     "manifest hash"),
    ("wrong stage", dict(envelope=envelope(IDENTITY, 0)), pb.WRONG_STAGE, "stage 0"),
    ("negative weight", dict(weight=-1.0), pb.BAD_REQUEST, "weight"),
    ("NaN weight", dict(weight=math.nan), pb.BAD_REQUEST, "weight"),
    ("Inf weight", dict(weight=math.inf), pb.BAD_REQUEST, "weight"),
    ("no group hash", dict(group_hash=""), pb.BAD_REQUEST, "group_hash"),
    ("no state digest", dict(state_digest=""), pb.BAD_REQUEST, "state_digest"),
    ("part not ours", dict(part=3), pb.GROUP_MISMATCH, "part 3"),
    ("names mismatch", dict(tensors=[named("w", torch.zeros(4, 3)), named("c", torch.zeros(3))]), pb.BAD_REQUEST,
     "unexpected ['c']"),
    ("NaN tensor", dict(tensors=[named("w", torch.zeros(4, 3)),
                                 pb.NamedTensor(name="b", tensor=fp32_proto_by_hand(torch.tensor([0.0, math.nan, 1.0])))]),
     pb.BAD_REQUEST, "part 2 b: contains NaN"),
]


@pytest.mark.parametrize("overrides, status, needle", [pytest.param(o, s, n, id=i) for i, o, s, n in AVERAGE_REFUSALS])
def test_average_refusals(overrides: dict, status: int, needle: str) -> None:
    err = refused(validate_average, average_request(**overrides), IDENTITY, 1, part_shapes, MAX_NUMEL)
    assert pb.Status.Name(err.status) == pb.Status.Name(status), err
    assert needle in err.reason, err.reason


# --------------------------------------------------------------------------- framing
# What a reader of framed messages must guarantee, proved on the one the RPC layer runs
# (read_stream_message over a raw stream; tests/test_hostile_wire.py has the hostile cases).


def wire(frames: Iterable[pb.Frame]) -> tuple[bytes, list[int]]:
    """`frames` as they travel (an 8-byte length, then the frame) and where each one starts."""
    data, starts = bytearray(), []
    for frame in frames:
        body = frame.SerializeToString()
        starts.append(len(data))
        data += len(body).to_bytes(HEADER_BYTES, "big") + body
    return bytes(data), starts


def read(frames: Iterable[pb.Frame], message_type=pb.ForwardRequest, max_bytes: int = 64 << 20,
         pulled: list[int] | None = None, max_frames: int | None = None):
    """read_stream_message on a stream that carries `frames` and ends; `pulled` gets one entry per
    frame the reader began to read, whether it returned or raised."""
    data, starts = wire(frames)
    out = []

    async def main() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        try:
            # keep the result out of the task: Python 3.11's asyncio.run reprs the main task (and so a
            # multi-MiB message) when it restores the SIGINT handler
            out.append(await read_stream_message(reader, message_type, max_bytes, max_frames=max_frames))
        finally:
            consumed = len(data) - len(reader._buffer)  # noqa: SLF001
            if pulled is not None:
                pulled.extend(1 for start in starts if start < consumed)
            out.append(consumed)

    asyncio.run(main())
    return out[0]


def big_request() -> pb.ForwardRequest:
    g = torch.Generator().manual_seed(3)
    t = torch.randn(4, 512, 512, generator=g)  # 4 MiB of fp32 payload
    return pb.ForwardRequest(envelope=envelope(IDENTITY, 1), microbatch_id=1, driver="d",
                             activations=encoded_to_proto(get_codec("fp32").encode(t)),
                             targets=raw_from_tensor(torch.zeros(4, 512, dtype=torch.int64)))


def test_frames_round_trip_big_message() -> None:
    msg = big_request()
    size = msg.ByteSize()
    assert size > 3 * FRAME_BYTES
    frames = list(to_frames(msg))
    assert len(frames) == math.ceil(size / FRAME_BYTES) >= 4
    assert [f.last for f in frames] == [False] * (len(frames) - 1) + [True]
    assert all(len(f.data) == FRAME_BYTES for f in frames[:-1])
    back, total = read(frames)
    assert total == size
    assert back == msg


def test_frames_round_trip_small_sizes() -> None:
    msg = pb.AverageResponse(status=pb.OK, contributors=["a", "b"], total_weight=3.0)
    frames = list(to_frames(msg, frame_bytes=5))
    assert len(frames) == math.ceil(msg.ByteSize() / 5)
    back, total = read(frames, pb.AverageResponse)
    assert back == msg and total == msg.ByteSize()
    empty_frames = list(to_frames(pb.StateRequest()))
    assert len(empty_frames) == 1 and empty_frames[0].last and empty_frames[0].data == b""
    back, total = read(empty_frames, pb.StateRequest)
    assert back == pb.StateRequest() and total == 0


def test_exact_frame_multiple_ends_with_last_frame() -> None:
    msg = pb.Frame(data=b"x" * 8)  # serialises to 10 bytes
    frames = list(to_frames(msg, frame_bytes=5))
    assert len(frames) == 2 and frames[-1].last and not frames[0].last
    assert read(frames, pb.Frame)[0] == msg


def test_too_large_refused_while_arriving() -> None:
    msg = big_request()
    frames = list(to_frames(msg))
    pulled: list[int] = []
    with pytest.raises(ProtocolError) as info:
        read(frames, max_bytes=FRAME_BYTES + FRAME_BYTES // 2, pulled=pulled)
    assert info.value.status == pb.TOO_LARGE
    assert str(FRAME_BYTES + FRAME_BYTES // 2) in info.value.reason
    assert len(pulled) == 2 < len(frames)  # refused on the frame that crossed the limit, not at the end


def test_max_bytes_is_inclusive() -> None:
    msg = big_request()
    back, total = read(to_frames(msg), max_bytes=msg.ByteSize())
    assert back == msg
    with pytest.raises(ProtocolError) as info:
        read(to_frames(msg), max_bytes=msg.ByteSize() - 1)
    assert info.value.status == pb.TOO_LARGE


def test_stream_without_last_frame() -> None:
    frames = list(to_frames(big_request()))[:-1]
    with pytest.raises(ProtocolError) as info:
        read(frames)
    assert info.value.status == pb.BAD_REQUEST and "last frame" in info.value.reason
    with pytest.raises(ProtocolError) as info:
        read([])
    assert info.value.status == pb.BAD_REQUEST


@pytest.mark.parametrize("data", [b"\xff\xff\xff", b"garbage bytes!!", b"\x0a\x05ab"])
def test_garbage_is_bad_request(data: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        read([pb.Frame(data=data[:2], last=False), pb.Frame(data=data[2:], last=True)])
    assert info.value.status == pb.BAD_REQUEST
    assert "unparsable ForwardRequest" in info.value.reason


def test_the_reader_stops_at_the_last_frame() -> None:
    # what follows the last frame is not part of the message and is left unread: the server
    # drains it after answering (FramedRPC._drain), so the sender's end-of-stream write succeeds
    msg = pb.AverageResponse(reason="hello")
    frames = list(to_frames(msg)) + [pb.Frame(data=b"\xff\xff", last=True)]
    pulled: list[int] = []
    back, total = read(frames, pb.AverageResponse, pulled=pulled)
    assert back == msg and total == msg.ByteSize()
    assert len(pulled) == len(frames) - 1


def test_protocol_error_carries_status_and_reason() -> None:
    err = ProtocolError(pb.TOO_LARGE, "too big")
    assert err.status == pb.TOO_LARGE and err.reason == "too big"
    assert str(err) == "TOO_LARGE: too big"
    # a status number from the network that this build does not know must not raise
    err = ProtocolError(99, "from a newer peer")
    assert err.status == 99 and str(err) == "UNKNOWN_STATUS_99: from a newer peer"


def test_endless_empty_frames_are_refused_after_a_bound() -> None:
    pulled: list[int] = []
    with pytest.raises(ProtocolError) as info:
        read((pb.Frame(data=b"", last=False) for _ in range(10**5)), max_bytes=1 << 20, pulled=pulled)
    assert info.value.status == pb.TOO_LARGE and "frames" in info.value.reason
    assert len(pulled) == max_frames_for(1 << 20) < 10  # refused before the next frame is read
    with pytest.raises(ProtocolError) as info:
        read([pb.Frame(data=b"", last=False)] * 4, pb.StateRequest, 1 << 20, max_frames=3)
    assert "more than 3 frames" in info.value.reason


def test_large_messages_parse_off_the_event_loop() -> None:
    msg = big_request()
    assert msg.ByteSize() >= PARSE_OFF_LOOP_BYTES
    back, _ = read(to_frames(msg))
    assert back == msg


@pytest.mark.parametrize("params_json", ['{"block_size": null}', "[" * 2000 + "]" * 2000, '{"block_size": 0}'])
def test_codec_params_that_break_decoding_are_bad_requests(params_json: str) -> None:
    proto = encoded_to_proto(get_codec("int8").encode(activations(2)))
    proto.params_json = params_json
    err = refused(validate_forward, forward_request(activations=proto), IDENTITY, CONTRACT, MAX_NUMEL)
    assert err.status == pb.BAD_REQUEST and err.reason.startswith("activations")


def test_codec_outside_the_allowed_set_is_refused() -> None:
    err = refused(validate_forward, forward_request(), IDENTITY, CONTRACT, MAX_NUMEL, allowed_codecs=frozenset({"int8"}))
    assert err.status == pb.BAD_REQUEST and "codec 'fp16' is not accepted" in err.reason
    assert validate_forward(forward_request(), IDENTITY, CONTRACT, MAX_NUMEL,
                            allowed_codecs=frozenset({"fp16"})).activations.shape == (2, SEQ, D)


# --------------------------------------------------------------------------- generated code


def test_generated_code_is_current() -> None:
    pytest.importorskip("grpc_tools")
    result = subprocess.run([sys.executable, "-m", "swarmgrad.protocol.generate", "--check"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_our_libp2p_key_messages_are_hivemind_s_on_the_wire() -> None:
    """protocol/libp2p_key.proto copies libp2p's crypto.proto so that key files need no hivemind
    import: the bytes must be the same both ways, and the CLI's key commands must not import it."""
    from hivemind.proto import crypto_pb2 as theirs

    from swarmgrad.protocol import libp2p_key_pb2 as ours

    data = bytes(range(64))
    for kind in (ours.RSA, ours.Ed25519, ours.Secp256k1, ours.ECDSA):
        for name in ("PublicKey", "PrivateKey"):
            mine = getattr(ours, name)(key_type=kind, data=data).SerializeToString()
            hivemind_s = getattr(theirs, name)(key_type=kind, data=data).SerializeToString()
            assert mine == hivemind_s
            parsed = getattr(ours, name).FromString(hivemind_s)
            assert (parsed.key_type, parsed.data) == (kind, data)
    probe = "import sys, swarmgrad.peer.net.identity, swarmgrad.peer.private.credentials; print('hivemind' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_status_codes_are_stable() -> None:
    # the numbers travel on the wire; renumbering breaks mixed-version swarms
    assert [(pb.Status.Name(i), i) for i in range(14)] == [
        ("OK", 0), ("BAD_REQUEST", 1), ("WRONG_RUN", 2), ("WRONG_STAGE", 3), ("TOO_LARGE", 4),
        ("DEADLINE_EXCEEDED", 5), ("DOWNSTREAM_FAILED", 6), ("NOT_READY", 7), ("STALE_STATE", 8),
        ("GROUP_MISMATCH", 9), ("WRONG_ROUND", 10), ("INTERNAL", 11), ("UNAUTHORIZED", 12), ("BUSY", 13)]
    assert len(pb.Status.values()) == 14
