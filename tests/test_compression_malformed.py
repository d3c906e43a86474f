"""Bad input is refused with CodecError: invalid params, non-finite values, malformed Encoded."""

from __future__ import annotations

import dataclasses
import struct
import time

import pytest
import torch

from swarmgrad.compression import CODEC_NAMES, CodecError, Encoded, decode, get_codec, parse_codec_spec
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.framing import ProtocolError
from swarmgrad.protocol.validation import encoded_from_proto

SPECS = ["fp32", "fp16", "bf16", "int8", "int4", "topk:fraction=0.1,values=int8",
         "topk:fraction=0.1,values=fp16", "powersgd:rank=2"]


def sample(spec: str) -> Encoded:
    x = torch.randn(40, 30, generator=torch.Generator().manual_seed(0))
    return get_codec(spec).encode(x)


def replace(enc: Encoded, **changes) -> Encoded:
    return dataclasses.replace(enc, **changes)


def refused(enc: Encoded, match: str | None = None, **kw) -> None:
    with pytest.raises(CodecError, match=match):
        decode(enc, **kw)


# ---------------------------------------------------------------- encode side


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_refused(name: str, bad: float) -> None:
    for n in (1, 300, 5000):
        x = torch.randn(n) if n < 5000 else torch.randn(50, 100)
        x.view(-1)[n // 2 if n < 5000 else 2500] = bad
        with pytest.raises(CodecError, match="NaN or Inf"):
            get_codec(name).encode(x)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_non_float_refused(name: str) -> None:
    with pytest.raises(CodecError):
        get_codec(name).encode(torch.arange(10))
    with pytest.raises(CodecError):
        get_codec(name).encode([1.0, 2.0])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "kwargs", "param"),
    [
        ("int8", {"block_size": 0}, "block_size"),
        ("int8", {"block_size": -5}, "block_size"),
        ("int4", {"block_size": 1.5}, "block_size"),
        ("int8", {"stochastic": "yes"}, "stochastic"),
        ("topk", {"fraction": 0.0}, "fraction"),
        ("topk", {"fraction": 1.5}, "fraction"),
        ("topk", {"values": "topk"}, "values"),
        ("powersgd", {"rank": 0}, "rank"),
        ("powersgd", {"fallback": "powersgd"}, "fallback"),
        ("fp16", {"overflow": "wrap"}, "overflow"),
        ("int8", {"blocksize": 64}, "blocksize"),
        ("nope", {}, "nope"),
    ],
)
def test_invalid_params_name_the_param(name: str, kwargs: dict, param: str) -> None:
    with pytest.raises(CodecError, match=param):
        get_codec(name, **kwargs)


@pytest.mark.parametrize("spec", ["", "int8:block_size", "int8:=3", "adaptive:threshold=3|fp16", "zip:level=3"])
def test_bad_spec_strings(spec: str) -> None:
    with pytest.raises(CodecError):
        parse_codec_spec(spec)


def test_codec_error_is_value_error() -> None:
    assert issubclass(CodecError, ValueError)


# ---------------------------------------------------------------- decode side: structure


@pytest.mark.parametrize("spec", SPECS)
def test_wrong_buffer_count_refused(spec: str) -> None:
    enc = sample(spec)
    refused(replace(enc, buffers=enc.buffers[:-1]))
    refused(replace(enc, buffers=enc.buffers + (b"\x00" * 8,)))
    refused(replace(enc, buffers=()))


@pytest.mark.parametrize("spec", SPECS)
def test_truncated_or_padded_buffers_refused(spec: str) -> None:
    enc = sample(spec)
    for i in range(len(enc.buffers)):
        bufs = list(enc.buffers)
        bufs[i] = bufs[i][:-1]
        refused(replace(enc, buffers=tuple(bufs)))
        bufs[i] = enc.buffers[i] + b"\x00"
        refused(replace(enc, buffers=tuple(bufs)))


@pytest.mark.parametrize("spec", SPECS)
def test_huge_declared_shape_refused_quickly(spec: str) -> None:
    enc = sample(spec)
    start = time.perf_counter()
    refused(replace(enc, shape=(2**40,)), match="max_numel")
    refused(replace(enc, shape=(2**16, 2**16)), match="max_numel")
    if enc.codec != "topk":
        # under the limit but disagreeing with the tiny buffers: refused before allocating 8 GiB
        # (a sparse topk message is legitimately tiny for any numel: max_numel is its bound)
        refused(replace(enc, shape=(2**30, 2)))
    refused(replace(enc, shape=(40, 30)), max_numel=100)
    refused(replace(enc, shape=(2**20, 2**10)), max_numel=2**29)
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize("spec", SPECS)
def test_bad_header_fields_refused(spec: str) -> None:
    enc = sample(spec)
    refused(replace(enc, shape=(-40, -30)), match="negative")
    refused(replace(enc, shape=(1,) * 33))
    refused(replace(enc, dtype="int64"))
    refused(replace(enc, codec="zstd"), match="unknown codec")
    refused(replace(enc, params={**enc.params, "bogus": 1}))


def test_bad_field_types_refused_at_construction() -> None:
    with pytest.raises(CodecError):
        Encoded("int8", ("a",), "float32", {}, ())  # type: ignore[arg-type]
    with pytest.raises(CodecError):
        Encoded("int8", (3,), "float32", {"block_size": [1]}, ())  # type: ignore[dict-item]
    with pytest.raises(CodecError):
        Encoded("int8", (3,), "float32", {}, ("text",))  # type: ignore[arg-type]
    for params_json in ("{not json", "[1, 2]"):  # as a receiver reads them: refused at the boundary
        with pytest.raises(ProtocolError) as refused:
            encoded_from_proto(pb.EncodedTensor(codec="int8", shape=[3], dtype="float32", params_json=params_json),
                               1 << 20)
        assert refused.value.status == pb.BAD_REQUEST
    with pytest.raises(CodecError):
        decode("not an Encoded")  # type: ignore[arg-type]


# ---------------------------------------------------------------- decode side: codec specifics


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_blockwise_bad_params_and_scales(name: str) -> None:
    enc = sample(name)
    for params in ({}, {"block_size": 0}, {"block_size": "128"}, {"block_size": 2**40}, {"block_size": True}):
        refused(replace(enc, params=params))
    # block_size that changes the number of scales disagrees with the scales buffer
    refused(replace(enc, params={"block_size": 64}))
    nb = len(enc.buffers[1]) // 4
    for bad in (float("nan"), float("inf"), -1.0):
        scales = struct.pack("<f", bad) + enc.buffers[1][4:]
        assert len(scales) == 4 * nb
        refused(replace(enc, buffers=(enc.buffers[0], scales)), match="scales")


def test_dense_refuses_params() -> None:
    refused(replace(sample("fp16"), params={"block_size": 1}))


def _topk_encoded(n: int, positions: list[int], bits: int) -> Encoded:
    """A hand-built topk Encoded with fp32 values 1.0 at the given delta-coded positions."""
    import numpy as np

    from swarmgrad.compression.topk import _pack_bits

    deltas = np.array(positions, dtype=np.int64)
    k = len(positions)
    return Encoded(
        "topk", (n,), "float32", {"k": k, "index_bits": bits, "values": "fp32"},
        (_pack_bits(deltas, bits), struct.pack(f"<{k}f", *([1.0] * k))),
    )


def test_topk_handbuilt_valid_and_out_of_range() -> None:
    ok = _topk_encoded(10, [2, 0, 3], bits=2)  # positions 2, 3, 7
    assert decode(ok).nonzero().view(-1).tolist() == [2, 3, 7]
    refused(_topk_encoded(10, [2, 3, 3], bits=2), match="out of range")  # 2, 6, 10
    refused(_topk_encoded(10, [9, 0], bits=4), match="out of range")  # 9, 10
    refused(_topk_encoded(4, [1], bits=3), match="index_bits")  # bits > bit_length(n - 1)


def test_topk_bad_params() -> None:
    enc = sample("topk:fraction=0.1,values=int8")
    n = 40 * 30
    for change in ({"k": n + 1}, {"k": 0}, {"k": -1}, {"index_bits": 0}, {"index_bits": 64},
                   {"values": "topk"}, {"values": "powersgd"}, {"values.block_size": 0}):
        refused(replace(enc, params={**enc.params, **change}))
    # a huge k with a tiny buffer: refused by length before any allocation
    start = time.perf_counter()
    refused(replace(enc, shape=(2**30,), params={**enc.params, "k": 2**29}))
    assert time.perf_counter() - start < 0.5


def test_powersgd_bad_factors_and_shapes() -> None:
    enc = sample("powersgd:rank=2")
    p = bytearray(enc.buffers[0])
    p[:4] = struct.pack("<f", float("inf"))
    refused(replace(enc, buffers=(bytes(p), enc.buffers[1])), match="NaN or Inf")
    refused(replace(enc, shape=(1200,)))  # 1-D cannot be low rank
    refused(replace(enc, params={"rank": 3}))
    refused(replace(enc, params={"rank": 0}))


def test_powersgd_rank_must_be_below_both_dims() -> None:
    # factors of rank >= min(m, n) are no low-rank code (an encoder sends the fallback then);
    # refusing them bounds decode's m*n*r product by the bytes of the factors
    for (m, n), r in [((40, 30), 30), ((40, 30), 31), ((5, 200), 5), ((10, 10), 5)]:
        forged = Encoded("powersgd", (m, n), "float32", {"rank": r}, (b"\0" * (4 * m * r), b"\0" * (4 * n * r)))
        refused(forged, match="low rank")
    ok = Encoded("powersgd", (40, 30), "float32", {"rank": 2}, (b"\0" * 320, b"\0" * 240))
    assert torch.equal(decode(ok), torch.zeros(40, 30))


def test_topk_index_unpacking_matches_packing_across_chunks() -> None:
    import numpy as np

    from swarmgrad.compression.topk import _UNPACK_CHUNK, _pack_bits, _unpack_bits

    rng = np.random.default_rng(1)
    for count, bits in [(1, 1), (7, 3), (_UNPACK_CHUNK + 5, 13), (2 * _UNPACK_CHUNK, 1), (3 * _UNPACK_CHUNK - 1, 33)]:
        values = rng.integers(0, 1 << bits, size=count, dtype=np.int64)
        assert np.array_equal(_unpack_bits(_pack_bits(values, bits), count, bits), values), (count, bits)


def test_lowrank_rank_must_be_below_width() -> None:
    # a rank-n "low-rank" code costs more than the fallback, so no encoder sends one; refusing it
    # bounds decode's m*n*r product at n multiply-adds per payload byte
    m, n = 40, 30
    for r in (n, n + 1):
        forged = Encoded("lowrank", (m, n), "float32", {"rank": r}, (b"\0" * (2 * n * r), b"\0" * (4 * r), b"\0" * (m * r)))
        refused(forged, match="out of range")
    r = n - 1
    ok = Encoded("lowrank", (m, n), "float32", {"rank": r}, (b"\0" * (2 * n * r), b"\0" * (4 * r), b"\0" * (m * r)))
    assert torch.equal(decode(ok), torch.zeros(m, n))
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    for rank in (1, 8, 31, 64):  # an encoder asked for any rank still decodes (it caps or falls back)
        enc = get_codec("lowrank", rank=rank).encode(x)
        assert decode(enc).shape == x.shape


def test_hadamard_output_bounded_by_payload() -> None:
    # the largest block and fewest bits a header may name still need every block's codes on the wire
    bits, bs = 2, 2**16
    short = Encoded("hadamard", (1,), "float32", {"bits": bits, "block_size": bs}, (b"\0" * 16, b"\0" * 4))
    refused(short)
    full = Encoded("hadamard", (1,), "float32", {"bits": bits, "block_size": bs}, (b"\0" * (bs * bits // 8), b"\0" * 4))
    assert decode(full).shape == (1,)
    for n in (1000, 5000):
        enc = get_codec("hadamard", bits=2, block_size=128).encode(torch.randn(n))
        assert n <= 4 * sum(len(b) for b in enc.buffers)
