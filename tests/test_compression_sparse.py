"""chunktopk (per-chunk top-k, low-bit values) and the reducer's sparse path.

Budgets (per chunk, s = the chunk's max |x|; x̂ = decode(encode(x))):
- kept set: the min(k, len) largest |x| of the chunk (every non-zero with k = 0); x̂ = 0 elsewhere;
- kept values: |x - x̂| <= s / 2**bits for bits 2/3/4/8, <= s * 2**-11 for bits 16
  (+ 2**-22 s: fp32 rounding of the decoded value near s).
The reducer: the mean of sparse contributions reaches members with the union of their supports
and values within the reduce codec's budget, never cut back to one member's k.
"""
from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch

from swarmgrad.compression import (ChunkTopKCodec, CodecError, Encoded, ErrorFeedback, SizeAdaptive, decode,
                                   get_codec, parse_codec_spec, reduce_codec)
from swarmgrad.compression.topk import _pack_bits
from swarmgrad.peer.averaging.aggregate import reduce_part
from swarmgrad.protocol.codecs import averaging_codecs
from swarmgrad.protocol.validation import encoded_from_proto
from support.wire import rebuilt


def check_budget(x: torch.Tensor, y: torch.Tensor, chunk: int, k: int, bits: int) -> None:
    flat_x, flat_y = x.reshape(-1).float(), y.reshape(-1)
    unit = 2.0**-11 if bits == 16 else 2.0**-bits
    for start in range(0, flat_x.numel(), chunk):
        cx, cy = flat_x[start:start + chunk], flat_y[start:start + chunk]
        s = float(cx.abs().max())
        kept = cy != 0
        if k:
            assert int(kept.sum()) <= min(k, cx.numel())
            if s > 0 and bool(kept.any()) and not bool(kept.all()):
                assert float(cx[~kept].abs().max()) <= float(cx[kept].abs().min())  # the largest were kept
        else:
            assert torch.equal(kept, cx != 0)  # exactly the non-zeros
        err = (cx - cy).abs()[kept]
        assert bool((err <= s * (unit + 2.0**-22)).all()), (float(err.max()), s * unit)


@pytest.mark.parametrize("bits", [2, 3, 4, 8, 16])
@pytest.mark.parametrize("n", [1, 7, 99, 100, 101, 1000])
def test_round_trip_budget(bits: int, n: int) -> None:
    g = torch.Generator().manual_seed(n * 17 + bits)
    x = torch.randn(n, generator=g) * 10.0 ** float(torch.randint(-20, 20, (1,), generator=g))
    codec = get_codec("chunktopk", chunk=100, k=7, bits=bits)
    enc = codec.encode(x)
    y = decode(rebuilt(enc))
    assert y.shape == x.shape and y.dtype == torch.float32
    check_budget(x, y, 100, 7, bits)
    nc = math.ceil(n / 100)
    assert int((y != 0).sum()) == (nc - 1) * 7 + min(7, n - (nc - 1) * 100)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_shapes_and_dtypes(dtype: torch.dtype) -> None:
    codec = get_codec("chunktopk", chunk=64, k=5, bits=4)
    x = torch.randn(3, 50, 7).to(dtype)
    enc = codec.encode(x.transpose(0, 2))  # non-contiguous
    assert enc.shape == (7, 50, 3) and enc.dtype == str(dtype).removeprefix("torch.")
    y = decode(enc, None)
    assert y.shape == (7, 50, 3) and y.dtype == dtype
    check_budget(x.transpose(0, 2).float(), decode(enc), 64, 5, 4)


def test_empty_and_scalar() -> None:
    for k in (3, 0):
        codec = get_codec("chunktopk", chunk=16, k=k, bits=2)
        enc = codec.encode(torch.zeros(0, 5))
        assert enc.nbytes == 0 and decode(rebuilt(enc)).shape == (0, 5)
        y = decode(codec.encode(torch.tensor(-2.5)))
        assert y.shape == () and float(y) < 0
    assert float(decode(get_codec("chunktopk", chunk=16, k=1, bits=16).encode(torch.tensor(3.0)))) == 3.0


def test_all_zero_chunks_decode_to_zero() -> None:
    x = torch.zeros(300)
    x[250] = 1.0
    y = decode(get_codec("chunktopk", chunk=100, k=4, bits=2).encode(x))
    assert torch.equal(y[:200], torch.zeros(200))


@pytest.mark.parametrize("spec", ["chunktopk:chunk=4096,k=64,bits=2", "chunktopk:chunk=100,k=3,bits=4",
                                  "chunktopk:chunk=128,k=0,bits=8", "chunktopk:chunk=65536,k=1,bits=16"])
def test_nbytes_exact(spec: str) -> None:
    codec = parse_codec_spec(spec)
    assert isinstance(codec, ChunkTopKCodec) and parse_codec_spec(codec.spec()) == codec
    for n in (1, 99, 4096, 4097, 20000):
        x = torch.randn(n)
        x[::3] = 0.0
        enc = codec.encode(x)
        nz = int((x != 0).sum())
        assert enc.nbytes == codec.nbytes_for(n, nz)
        nc, C = math.ceil(n / codec.chunk), codec.chunk
        kept = nz if codec.k == 0 else sum(min(codec.k, min(C, n - i)) for i in range(0, n, C))
        counts = 0 if codec.k else math.ceil(nc * C.bit_length() / 8)
        values = 2 * kept if codec.bits == 16 else math.ceil(kept * codec.bits / 8)
        assert enc.nbytes == 4 * nc + counts + math.ceil(kept * (C - 1).bit_length() / 8) + values


def test_far_below_int8() -> None:
    """The headline size: 4096-chunks, k = 64, 2-bit values are ~140x smaller than fp32."""
    enc = parse_codec_spec("chunktopk:chunk=4096,k=64,bits=2").encode(torch.randn(1 << 20))
    assert 8 * enc.nbytes / (1 << 20) < 0.25  # bits per value; int8 is 8.25


def test_error_feedback_telescopes() -> None:
    """Σ decoded = Σ inputs − the last residual: nothing is lost across rounds."""
    ef = ErrorFeedback(get_codec("chunktopk", chunk=256, k=4, bits=2))
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(1000, generator=g) for _ in range(30)]
    sent = sum(decode(ef.encode("w", x)) for x in inputs)
    residual = ef.residual("w")
    assert residual is not None
    assert torch.allclose(sent + residual, sum(inputs), atol=1e-4)


def _dense_as_before(x: torch.Tensor, chunk: int, bits: int) -> tuple[list[bytes], torch.Tensor]:
    """chunktopk with k = chunk as it was computed before dense chunks had a path of their own
    (every position gathered, scales reduced by position, int64 codes packed through a matrix of
    single bits): its buffers and its decode."""
    n = x.numel()
    nc = -(-n // chunk)
    rows = torch.arange(n) // chunk
    if bits == 1:
        scales = torch.zeros(nc).index_add_(0, rows, x.abs()) / torch.bincount(rows, minlength=nc).clamp(min=1).float()
    else:
        scales = torch.zeros(nc).scatter_reduce_(0, rows, x.abs(), "amax")
    each = scales[rows]
    ratio = (x / torch.where(each > 0, each, torch.ones_like(each))).clamp(-1.0, 1.0)
    if bits == 16:
        half = ratio.to(torch.float16)
        return [scales.numpy().tobytes(), b"", half.numpy().tobytes()], half.float() * each
    levels = 1 << (bits - 1)
    if bits == 1:
        codes, decoded = (x < 0).long(), (1.0 - 2.0 * (x < 0).float()) * each
    else:
        mag = (ratio.abs() * levels).floor().clamp(max=levels - 1).long()
        codes = mag | ((x < 0).long() << (bits - 1))
        decoded = (1.0 - 2.0 * (x < 0).float()) * ((mag.float() + 0.5) / levels) * each
    bitmat = ((codes.numpy()[:, None] >> np.arange(bits)) & 1).astype(np.uint8)
    return [scales.numpy().tobytes(), b"", np.packbits(bitmat.reshape(-1), bitorder="little").tobytes()], decoded


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8, 16])
def test_dense_chunks_on_the_grid_match_the_general_path(bits: int) -> None:
    """k = chunk takes a path of its own (whole chunks as rows of a grid, no gather): the same bytes
    and the same decoded floats as the general path computed, short last chunks, zero chunks and
    -0.0 included."""
    torch.manual_seed(bits)
    for chunk, n in [(2, 1), (3, 7), (8, 8), (256, 1000), (1000, 4097), (256, 875)]:
        codec = get_codec("chunktopk", chunk=chunk, k=chunk, bits=bits)
        x = torch.randn(n) * torch.rand(n).pow(3)
        x[: min(n, chunk // 2)] = 0.0
        x[n // 2] = -0.0
        enc = codec.encode(x)
        buffers, decoded = _dense_as_before(x, chunk, bits)
        assert list(enc.buffers) == buffers, (chunk, n)
        out = ChunkTopKCodec.decode_encoded(enc, 1 << 20)
        assert torch.equal(out, decoded) and out.shape == (n,), (chunk, n)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8, 13])
def test_bit_packing_is_the_bit_stream_whatever_the_width(bits: int) -> None:
    """Widths that divide 8 are packed with whole-byte shifts: the same bytes as the bit matrix."""
    from swarmgrad.compression.topk import _unpack_bits
    rng = np.random.default_rng(bits)
    for n in (1, 3, 8, 9, 17, 1001, 70_000):
        values = rng.integers(0, 1 << bits, n)
        bitmat = ((values[:, None] >> np.arange(bits)) & 1).astype(np.uint8)
        packed = _pack_bits(values, bits)
        assert packed == np.packbits(bitmat.reshape(-1), bitorder="little").tobytes(), n
        assert np.array_equal(_unpack_bits(packed, n, bits), values), n


def test_bad_constructor_args() -> None:
    for kwargs in ({"chunk": 1}, {"chunk": 2**16 + 1}, {"chunk": 64, "k": 65}, {"k": -1}, {"bits": 5}, {"bits": 0},
                   {"bits": True}, {"chunk": 64.0}):
        with pytest.raises(CodecError):
            get_codec("chunktopk", **kwargs)
    with pytest.raises(CodecError):
        get_codec("chunktopk").encode(torch.tensor([1.0, float("nan")]))
    with pytest.raises(CodecError):
        get_codec("chunktopk").encode(torch.arange(4))


@pytest.mark.parametrize("k,layout", [(7, "list"), (14, "list"), (15, "bitmap"), (60, "bitmap"), (100, "all")])
@pytest.mark.parametrize("bits", [1, 2, 16])
def test_index_layouts_round_trip(k: int, layout: str, bits: int) -> None:
    """Positions travel as a list of 7-bit indices (chunk 100) while k * 7 < 100 bits, as a bitmap
    from there on, and not at all when every position is kept; nbytes is exact in each case."""
    codec = get_codec("chunktopk", chunk=100, k=k, bits=bits)
    for n in (1, 99, 100, 250, 1000):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n + k))
        enc = codec.encode(x)
        y = decode(rebuilt(enc))
        nc = math.ceil(n / 100)
        kept = sum(min(k, min(100, n - i)) for i in range(0, n, 100))
        index = {"list": math.ceil(kept * 7 / 8), "bitmap": math.ceil(n / 8), "all": 0}[layout]
        values = 2 * kept if bits == 16 else math.ceil(kept * bits / 8)
        assert enc.nbytes == codec.nbytes_for(n) == 4 * nc + index + values
        assert len(enc.buffers[1]) == index
        assert int((y != 0).sum()) == kept
        if bits == 1:
            check_sign_budget(x, y, 100)
        else:
            check_budget(x, y, 100, k, bits)


def check_sign_budget(x: torch.Tensor, y: torch.Tensor, chunk: int) -> None:
    """bits = 1: each kept value decodes to sign(x) times its chunk's mean kept |x|, so a chunk's
    L1 mass is sent exactly and every error is at most the chunk's max |x|."""
    for start in range(0, x.numel(), chunk):
        cx, cy = x[start:start + chunk], y[start:start + chunk]
        kept = cy != 0
        if not bool(kept.any()):
            continue
        mean = float(cx[kept].abs().mean())
        assert torch.allclose(cy[kept].abs(), torch.full_like(cy[kept], mean), rtol=1e-4)
        assert bool((torch.sign(cy[kept]) == torch.sign(cx[kept])).all() or bool((cx[kept] == 0).any()))
        assert bool(((cx - cy).abs()[kept] <= cx.abs().max() * (1 + 1e-6)).all())


def test_dense_sign_is_one_bit_per_value() -> None:
    """chunk = k, bits = 1: every value's sign and one scale per chunk, ~1 bit per value (int8 is 8.25)."""
    codec = parse_codec_spec("chunktopk:chunk=4096,k=4096,bits=1")
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    enc = codec.encode(x)
    assert 8 * enc.nbytes / (1 << 20) < 1.01
    y = decode(enc)
    assert torch.equal(torch.sign(y), torch.sign(x))
    check_sign_budget(x, y, 4096)


# --------------------------------------------------------------------------- malformed input


def _enc(k: int = 3) -> Encoded:
    x = torch.randn(250)
    x[::2] = 0.0
    return get_codec("chunktopk", chunk=100, k=k, bits=4).encode(x)


def _with(enc: Encoded, *, params: dict | None = None, buffers: tuple | None = None, shape: tuple | None = None
          ) -> Encoded:
    return Encoded(enc.codec, enc.shape if shape is None else shape, enc.dtype,
                   {**enc.params, **(params or {})}, enc.buffers if buffers is None else buffers)


def _cols(values: list[int]) -> bytes:
    return _pack_bits(np.array(values, dtype=np.int64), 7)  # chunk 100: 7 index bits


@pytest.mark.parametrize("k", [3, 0])
def test_malformed_refused(k: int) -> None:
    enc = _enc(k)
    decode(enc)  # the unmodified message is fine
    bad = [
        _with(enc, params={"bits": 3}), _with(enc, params={"chunk": 1}), _with(enc, params={"k": 101}),
        _with(enc, params={"extra": 1}), _with(enc, params={"k": "3"}),
        _with(enc, buffers=enc.buffers[:-1]), _with(enc, buffers=enc.buffers + (b"",)),
        _with(enc, buffers=(enc.buffers[0][:-1],) + enc.buffers[1:]),
        _with(enc, buffers=enc.buffers[:-1] + (enc.buffers[-1] + b"\0",)),
        _with(enc, buffers=(np.array([np.nan, 1, 1], "<f4").tobytes(),) + enc.buffers[1:]),
        _with(enc, buffers=(np.array([-1, 1, 1], "<f4").tobytes(),) + enc.buffers[1:]),
        _with(enc, shape=(301,)),  # one more chunk than the scales pay for
        _with(enc, shape=(2**40,)),  # a huge shape with a tiny payload: refused before allocating
    ]
    if k:
        # 3 per chunk, 3 chunks (the last 50 long): an index past the last chunk, a duplicate, descending
        bad.append(_with(enc, buffers=(enc.buffers[0], _cols([1, 2, 3, 4, 5, 6, 1, 2, 60]), enc.buffers[2])))
        bad.append(_with(enc, buffers=(enc.buffers[0], _cols([1, 2, 2, 4, 5, 6, 1, 2, 3]), enc.buffers[2])))
        bad.append(_with(enc, buffers=(enc.buffers[0], _cols([3, 2, 1, 4, 5, 6, 1, 2, 3]), enc.buffers[2])))
    else:
        over = _pack_bits(np.array([101, 0, 0], dtype=np.int64), 7)
        bad.append(_with(enc, buffers=(enc.buffers[0], over) + enc.buffers[2:]))
        last = _pack_bits(np.array([0, 0, 51], dtype=np.int64), 7)  # the last chunk holds 50
        bad.append(_with(enc, buffers=(enc.buffers[0], last) + enc.buffers[2:]))
    for b in bad:
        with pytest.raises(CodecError):
            decode(b, max_numel=2**41)


def test_malformed_bitmap_refused() -> None:
    """A bitmap must mark exactly each chunk's count: one mark moved to another chunk, one mark
    too many or one too few are refused."""
    codec = get_codec("chunktopk", chunk=100, k=20, bits=1)  # 20 * 7 bits >= 100: bitmap
    x = torch.randn(250)
    enc = codec.encode(x)
    decode(enc)
    marks = np.unpackbits(np.frombuffer(enc.buffers[1], np.uint8), count=250, bitorder="little")
    first_kept = int(np.flatnonzero(marks[:100])[0])
    first_free = int(np.flatnonzero(marks[:100] == 0)[0])
    free_later = 100 + int(np.flatnonzero(marks[100:200] == 0)[0])
    for flips in ([first_kept, free_later], [first_free], [first_kept]):
        bad = marks.copy()
        bad[flips] ^= 1
        buf = np.packbits(bad, bitorder="little").tobytes()
        with pytest.raises(CodecError, match="bitmap"):
            decode(_with(enc, buffers=(enc.buffers[0], buf, enc.buffers[2])))
    with pytest.raises(CodecError):  # an index buffer where the layout has none
        decode(_with(get_codec("chunktopk", chunk=100, k=100, bits=1).encode(x), buffers=(enc.buffers[0], b"\0", b"")))


def test_fp16_values_checked() -> None:
    enc = get_codec("chunktopk", chunk=100, k=2, bits=16).encode(torch.randn(100))
    for v in (np.inf, np.nan, 2.0):
        vals = np.array([v, 0.5], "<f2").tobytes()
        with pytest.raises(CodecError):
            decode(_with(enc, buffers=enc.buffers[:-1] + (vals,)))


def test_allocation_bounded_by_payload() -> None:
    """A message declaring n values must pay 4 bytes per chunk first: a 12-byte payload cannot
    declare more than 3 chunks."""
    enc = get_codec("chunktopk", chunk=4096, k=1, bits=2).encode(torch.randn(4096 * 3))
    assert enc.nbytes < 20
    with pytest.raises(CodecError, match="scales buffer"):
        decode(_with(enc, shape=(4096 * 3 + 1,)))


# --------------------------------------------------------------------------- the reducer's sparse path


def _contributions(spec: str, members: int, rounds: int = 1) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Each member's decoded contributions after `rounds` of error-feedback encodes."""
    codec = SizeAdaptive(64, get_codec("fp32"), parse_codec_spec(spec))
    g = torch.Generator().manual_seed(members)
    weights = [float(w) for w in range(1, members + 1)]
    out = []
    for _ in range(members):
        ef = ErrorFeedback(codec)
        for _ in range(rounds):
            deltas = {"w": torch.randn(40, 200, generator=g), "b": torch.randn(10, generator=g)}
            dec = {n: decode(ef.encode(n, t)) for n, t in deltas.items()}
        out.append(dec)
    return weights, out


@pytest.mark.parametrize("spec", ["chunktopk:chunk=512,k=8,bits=2", "chunktopk:chunk=4096,k=40,bits=4",
                                  "topk:fraction=0.01,values=fp16", "topk:fraction=0.02,values=int8"])
@pytest.mark.parametrize("members", [2, 3])
def test_reduced_mean_keeps_the_union(spec: str, members: int) -> None:
    """The decoded mean of sparse contributions equals the exact weighted mean of their decoded
    values, on the union of their supports, within the reduce codec's value budget."""
    weights, decoded = _contributions(spec, members)
    codec = SizeAdaptive(64, get_codec("fp32"), parse_codec_spec(spec))
    rcodec = reduce_codec(codec)
    mean = reduce_part(list(zip(weights, decoded)), robust_min_members=0, max_weight_ratio=0)
    exact = sum(w * d["w"] for w, d in zip(weights, decoded)) / sum(weights)
    sent = decode(rebuilt(rcodec.encode(mean["w"])))
    union = torch.stack([d["w"] != 0 for d in decoded]).any(0)
    assert torch.equal(sent != 0, exact != 0) and bool((union | (exact == 0)).all())
    bits = rcodec.large.bits
    check_budget(exact, sent, rcodec.large.chunk, 0, bits)
    assert torch.equal(decode(rcodec.encode(mean["b"])), mean["b"])  # small tensors stay fp32
    # what the old path (the members' own codec on the mean) lost: a large share of the mass
    resparsified = decode(codec.encode(mean["w"]))
    lost = float((resparsified - exact).norm() / exact.norm())
    kept = float((sent - exact).norm() / exact.norm())
    assert kept < 0.01 < 0.2 < lost


def test_robust_aggregate_support_within_union() -> None:
    weights, decoded = _contributions("chunktopk:chunk=512,k=8,bits=2", 4)
    mean = reduce_part(list(zip(weights, decoded)), robust_min_members=3, max_weight_ratio=4.0)
    union = torch.stack([d["w"] != 0 for d in decoded]).any(0)
    assert not bool((mean["w"] != 0)[~union].any())
    sent = decode(reduce_codec(get_codec("chunktopk", chunk=512, k=8, bits=2)).encode(mean["w"]))
    assert torch.equal(sent != 0, mean["w"] != 0)


def test_reduce_codec_choice() -> None:
    assert reduce_codec(get_codec("int8")) == get_codec("int8")
    assert reduce_codec(get_codec("fp16")) == get_codec("fp16")
    assert reduce_codec(parse_codec_spec("chunktopk:chunk=1024,k=8,bits=2")).spec() == "chunktopk:chunk=1024,k=0,bits=8"
    assert reduce_codec(parse_codec_spec("topk:values=fp16")).spec() == "chunktopk:chunk=4096,k=0,bits=16"
    assert reduce_codec(parse_codec_spec("adaptive:threshold=10|fp16|topk:values=int8")).spec() == \
        "adaptive:threshold=10|fp16|chunktopk:chunk=4096,k=0,bits=8"


def test_averaging_codecs_accept_the_reduce_codec() -> None:
    spec = "chunktopk:chunk=4096,k=64,bits=2"
    assert averaging_codecs(spec, 4096) == {"chunktopk", "fp32"}
    assert averaging_codecs(spec, 4096, mean=True) == {"chunktopk", "fp32"}
    assert averaging_codecs("topk:fraction=0.01", 0) == {"topk"}
    assert averaging_codecs("topk:fraction=0.01", 0, mean=True) == {"chunktopk"}
    assert averaging_codecs("int8", 65536, mean=True) == averaging_codecs("int8", 65536) == {"fp32", "int8"}


def test_averager_reducer_sends_the_union() -> None:
    """The Averager's own reducer step (`Reducer.maybe_reduce`) on sparse contributions: the bytes it
    answers with pass the members' check of the mean's codecs and decode to the exact weighted
    mean over the union of supports (no network: only the reducer's slot is used)."""
    from conftest import small_manifest

    from swarmgrad.peer.averaging.averager import Averager
    from swarmgrad.peer.averaging.reducer import RoundSlot
    from swarmgrad.peer.averaging.group import Group

    spec = "chunktopk:chunk=512,k=8,bits=2"
    m = small_manifest(averaging={"codec": spec, "error_feedback": True, "small_tensor_threshold": 64})
    weights, decoded = _contributions(spec, 3)
    shapes = {"w": (40, 200), "b": (10,)}
    averager = Averager(m, 0, "p0", shapes, rpc=None, swarm=None, max_numel=2**20, clock=None)  # type: ignore[arg-type]
    members = ("p0", "p1", "p2")

    async def reduce() -> tuple:
        slot = RoundSlot(result=asyncio.get_running_loop().create_future())
        slot.group = Group(members, "digest", 0)
        slot.part_names = shapes
        slot.contributions = {p: (w, d) for p, w, d in zip(members, weights, decoded)}
        averager.reducer.maybe_reduce(slot)
        assert slot.result is not None and slot.result.done()
        return slot.result.result()

    tensors, order, total = asyncio.run(reduce())
    assert list(order) == list(members) and total == sum(weights)
    got = {t.name: decode(encoded_from_proto(t.tensor, 2**20, allowed_codecs=averager.mean_codecs)) for t in tensors}
    assert {t.tensor.codec for t in tensors} == {"chunktopk", "fp32"}
    exact = reduce_part(list(zip(weights, decoded)), m.averaging.robust_min_members, m.averaging.max_weight_ratio)
    assert torch.equal(got["b"], exact["b"])
    assert torch.equal(got["w"] != 0, exact["w"] != 0)
    check_budget(exact["w"], got["w"], 512, 0, 8)
    union = torch.stack([d["w"] != 0 for d in decoded]).any(0)
    assert int((got["w"] != 0).sum()) > int((decoded[0]["w"] != 0).sum())  # more than one member's k
    assert not bool((got["w"] != 0)[~union].any())


def test_top_40_percent_sign_is_the_gather_codec() -> None:
    """chunk 4096, k = 1638, bits = 1 (docs/averaging-codecs.md): a bitmap and one sign per kept
    value, 1.4 bits per value; it keeps each chunk's 40 % largest |x| at their mean magnitude,
    a three-level code (−m, 0, +m) that loses about 22 % of Gaussian values' energy per encode
    (the dense sign: 36 %) for error feedback to carry on."""
    codec = parse_codec_spec("chunktopk:chunk=4096,k=1638,bits=1")
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(1))
    enc = codec.encode(x)
    assert enc.nbytes == codec.nbytes_for(x.numel()) == 4 * 256 + (1 << 17) + math.ceil(256 * 1638 / 8)
    assert 1.39 < 8 * enc.nbytes / x.numel() < 1.41
    y = decode(rebuilt(enc))
    check_sign_budget(x, y, 4096)
    kept = (y != 0).view(256, 4096)
    assert bool((kept.sum(dim=1) == 1638).all())
    smallest_kept = torch.where(kept, x.abs().view(256, 4096), torch.inf).min(dim=1).values
    largest_dropped = torch.where(kept, -torch.inf, x.abs().view(256, 4096)).max(dim=1).values
    assert bool((smallest_kept >= largest_dropped).all())
    lost = float((x - y).pow(2).sum() / x.pow(2).sum())
    assert 0.20 < lost < 0.24, lost
