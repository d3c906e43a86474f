"""int8/int4 buffer reuse: the workspace paths give the reference bytes, never leak between calls,
and ``decode(out=...)`` overwrites every item. Correctness only; speed is in benchmarks/codecs.py."""

from __future__ import annotations

import copy
import hashlib
import pickle
import threading

import numpy as np
import pytest
import torch

from swarmgrad.compression import CodecError, Encoded, decode, get_codec
from swarmgrad.protocol.validation import encoded_from_proto, encoded_to_proto

CHUNK = 2**18  # compression.blockwise._CHUNK: sizes below straddle chunk boundaries


def golden_input() -> torch.Tensor:
    """Seeded (numpy PCG64) with an all-zero block, a tiny block (L / absmax overflows fp32), a
    huge block and a constant run; 2 chunks + 77 values, so the last block is partial."""
    rng = np.random.default_rng(1234)
    x = rng.standard_normal(2 * CHUNK + 77, dtype=np.float32)
    x[:128] = 0.0
    x[128:256] *= np.float32(1e-38)
    x[256:384] *= np.float32(1e30)
    x[1000:1100] = np.float32(-3.5)
    return torch.from_numpy(x)


# sha256 of b"".join(buffers) of golden_input(), computed with the codec before buffer reuse
# (commit cd75ffb): the wire bytes must never change.
GOLDEN = {
    "int8": "03cdbdd0e4613ebb8e6cc5a389faaa63bfa77eec6426fa56b645e025a8f8bb4d",
    "int8:block_size=100": "b53944c243992a5208208f111ef5b89e3eb8631d30240c39a6854e6002618789",
    "int8:block_size=524288": "ed1797e94c8620d54baf3485e5eb138ae5eedfac31c62a1664207416960faf05",
    "int4": "8f775672e1ba489e03448847ca6f48fa5ccadec51d85599be0b75b92876428cb",
    "int4:block_size=100": "7ad3d797382fb1ba512c4a5829f13f9a37b3b1e58cc8e08eac01c4861488a0eb",
}


def joined(enc: Encoded) -> bytes:
    return b"".join(bytes(b) for b in enc.buffers)


def reference_int8(x: torch.Tensor, block: int) -> bytes:
    """int8 wire bytes computed whole-tensor, without chunks or workspace: absmax per block (a
    2-D max over full blocks, then the tail block, as the codec does: an all-zero block's scale
    keeps the sign torch.maximum gives it), codes = round(x * (127 / absmax)) (division for blocks
    whose 127 / absmax overflows), scales = absmax / 127."""
    flat = x.reshape(-1).float()
    nfull, tail = divmod(flat.numel(), block)
    rows = [flat[: nfull * block].view(nfull, block)] + ([flat[nfull * block :].view(1, tail)] if tail else [])
    codes, scales = [], []
    for xb in rows:
        absmax = torch.maximum(xb.amax(1), xb.amin(1).neg())
        inv = torch.reciprocal(absmax).mul_(127).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        t = xb * inv[:, None]
        tiny = (absmax > 0) & (absmax < 2.0**-100)
        t[tiny] = xb[tiny] / absmax[tiny, None] * 127
        codes.append(t.round().to(torch.int8).reshape(-1))
        scales.append(absmax / 127)
    return torch.cat(codes).numpy().tobytes() + torch.cat(scales).numpy().astype("<f4").tobytes()


def address(buf: memoryview) -> int:
    return np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0]


@pytest.mark.parametrize("spec", sorted(GOLDEN))
@pytest.mark.parametrize("borrowed", [False, True])
def test_wire_bytes_unchanged(spec: str, borrowed: bool) -> None:
    codec = get_codec(spec)
    encode = codec.encode_borrowed if borrowed else codec.encode
    for _ in range(2):  # the second call runs on a warm workspace
        enc = encode(golden_input())
        assert hashlib.sha256(joined(enc)).hexdigest() == GOLDEN[spec]


@pytest.mark.parametrize("n,block", [(1, 128), (127, 128), (129, 128), (CHUNK + 5, 128), (1000, 7), (3000, 1000)])
def test_fast_path_matches_whole_tensor_reference(n: int, block: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    if n > 300:
        x[:block] = 0.0
        x[block : 2 * block] *= 1e-38
    ref = reference_int8(x, block)
    codec = get_codec("int8", block_size=block)
    assert joined(codec.encode(x)) == ref
    assert joined(codec.encode_borrowed(x)) == ref
    assert joined(codec.encode_borrowed(x)) == ref  # warm workspace


@pytest.mark.parametrize("n,block", [(2 * CHUNK + 77, 128), (CHUNK + 300, 100), (5000, 1), (3 * 128, 128)])
def test_tiny_blocks_anywhere_match_the_reference(n: int, block: int) -> None:
    """Round to nearest finds the blocks whose 127 / absmax overflows once, on all scales, and
    quantises them again by division: in any chunk, in the partial tail block, and when every
    block is tiny, the bytes are the whole-tensor reference's."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    tiny_blocks = [1, n // block - 1, n // block] if n % block else [1, n // block - 1]
    for b in tiny_blocks:  # includes one in the last full chunk and the tail block
        x[b * block : (b + 1) * block] *= 1e-38
    codec = get_codec("int8", block_size=block)
    assert joined(codec.encode(x)) == reference_int8(x, block)
    # (not x * 1e-36: the blocks above would underflow to signed zeros, whose scale's sign the
    # whole-tensor reference's reduction order may give otherwise than the chunks')
    everything_tiny = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1e-32
    assert joined(codec.encode(everything_tiny)) == reference_int8(everything_tiny, block)
    assert joined(codec.encode_borrowed(everything_tiny)) == reference_int8(everything_tiny, block)


def test_fresh_decode_output_is_an_ordinary_tensor() -> None:
    """decode's fresh output comes from numpy's allocator (huge pages): it must still behave as
    a tensor the caller owns, writable, independent of later decodes and of the codec."""
    codec = get_codec("int8")
    x = torch.randn(3000, generator=torch.Generator().manual_seed(12))
    first = decode(codec.encode(x))
    kept = first.clone()
    second = decode(codec.encode(x * 2))
    assert first.data_ptr() != second.data_ptr() and torch.equal(first, kept)
    first.add_(1.0)  # writable in place
    assert torch.equal(first, kept + 1.0) and first.dtype == torch.float32 and first.is_contiguous()
    del codec
    assert torch.equal(second, decode(get_codec("int8").encode(x * 2)))


def test_borrowed_buffers_are_read_only_views_and_decode_identically() -> None:
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))
    codec = get_codec("int8")
    owned, borrowed = codec.encode(x), codec.encode_borrowed(x)
    assert all(isinstance(b, bytes) for b in owned.buffers)
    assert all(isinstance(b, memoryview) and b.readonly for b in borrowed.buffers)
    assert borrowed.nbytes == owned.nbytes and borrowed.shape == (5, 300)
    assert torch.equal(decode(borrowed), decode(owned))
    copied = borrowed.owned()
    assert all(isinstance(b, bytes) for b in copied.buffers) and joined(copied) == joined(owned)
    assert owned.owned() is owned


def test_borrowed_result_reaches_the_wire_through_one_copy() -> None:
    """A protobuf bytes field takes bytes only: ``owned()`` is the copy on the way out."""
    x = torch.randn(4097, generator=torch.Generator().manual_seed(2))
    enc = get_codec("int8").encode_borrowed(x)
    msg = encoded_to_proto(enc.owned())
    back = encoded_from_proto(msg, max_numel=10**6)
    assert joined(back) == joined(enc)
    assert torch.equal(decode(back), decode(enc))


def test_workspace_is_reused_once_results_are_dropped() -> None:
    codec = get_codec("int8")
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(3))
    first = address(codec.encode_borrowed(x).buffers[0])
    assert address(codec.encode_borrowed(x).buffers[0]) == first  # previous result was dropped


def test_reuse_across_shapes_never_leaks() -> None:
    """Big, small, medium and odd shapes through one codec: each result is exactly a fresh codec's."""
    codec = get_codec("int8")
    gen = torch.Generator().manual_seed(4)
    for shape in [(CHUNK + 300,), (10, 100), (3,), (), (0,), (7, 7, 7), (CHUNK // 2, 3)]:
        x = torch.randn(shape, generator=gen)
        expected = get_codec("int8").encode(x)
        for enc in (codec.encode_borrowed(x), codec.encode(x)):
            assert enc.shape == tuple(shape)
            assert [len(b) for b in enc.buffers] == [len(b) for b in expected.buffers]
            assert joined(enc) == joined(expected)
            assert torch.equal(decode(enc), decode(expected))


def test_held_result_keeps_its_bytes() -> None:
    """While a borrowed result (or a slice of one of its buffers) is alive, later calls write elsewhere."""
    codec = get_codec("int8")
    gen = torch.Generator().manual_seed(5)
    a_in, b_in, c_in = (torch.randn(50_000, generator=gen) for _ in range(3))
    a = codec.encode_borrowed(a_in)
    a_bytes = joined(a)
    b = codec.encode_borrowed(b_in)
    assert joined(a) == a_bytes and address(a.buffers[0]) != address(b.buffers[0])
    part = b.buffers[0][100:200]  # a slice outlives b
    part_bytes = bytes(part)
    b_address = address(b.buffers[0])
    del b
    c = codec.encode_borrowed(c_in)
    assert bytes(part) == part_bytes and address(c.buffers[0]) != b_address
    assert joined(a) == a_bytes
    assert joined(c) == joined(get_codec("int8").encode(c_in))


@pytest.mark.parametrize("spec", ["int8", "int4", "int8:block_size=100", "int8:stochastic=true,seed=3"])
def test_round_trip_error_budget_on_reused_buffers(spec: str) -> None:
    codec = get_codec(spec)
    levels = 7 if spec.startswith("int4") else 127
    block = 100 if "block_size=100" in spec else 128
    factor = 1.0 if "stochastic" in spec else 0.5
    gen = torch.Generator().manual_seed(6)
    out = torch.empty(0)
    for n in [CHUNK + 77, 999, CHUNK + 77, 1]:
        x = torch.randn(n, generator=gen) * 10
        if out.numel() != n:
            out = torch.full((n,), float("nan"))
        y = decode(codec.encode_borrowed(x), out=out)
        assert y is out
        flat = torch.cat([x.abs(), torch.zeros((-n) % block)]).view(-1, block).amax(1)
        bound = flat.repeat_interleave(block)[:n] / levels * factor * (1 + 1e-5) + 1e-36
        assert bool(((y - x).abs() <= bound).all())


def test_stochastic_sequences_match_between_paths() -> None:
    owned, borrowed = get_codec("int8", stochastic=True, seed=11), get_codec("int8", stochastic=True, seed=11)
    x = torch.randn(3000, generator=torch.Generator().manual_seed(7))
    for _ in range(3):
        assert joined(owned.encode(x)) == joined(borrowed.encode_borrowed(x))


@pytest.mark.parametrize("spec", ["int8", "int4", "fp16", "bf16", "fp32", "topk:fraction=0.1,values=int8", "powersgd:rank=2"])
def test_decode_out_overwrites_every_item(spec: str) -> None:
    gen = torch.Generator().manual_seed(8)
    codec = get_codec(spec)
    out = torch.full((33, 65), float("nan"))
    for _ in range(2):  # the second decode must not keep anything of the first
        enc = codec.encode(torch.randn(33, 65, generator=gen))
        expected = decode(enc)
        assert decode(enc, out=out) is out
        assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_decode_out_other_dtypes(dtype: torch.dtype) -> None:
    enc = get_codec("int8").encode(torch.randn(1000, generator=torch.Generator().manual_seed(9)))
    out = torch.empty(1000, dtype=dtype)
    assert torch.equal(decode(enc, dtype, out=out), decode(enc, dtype))


def test_decode_out_refuses_a_wrong_destination() -> None:
    enc = get_codec("int8").encode(torch.randn(4, 8))
    for bad in [torch.empty(32), torch.empty(4, 9), torch.empty(4, 8, dtype=torch.float16), torch.empty(8, 4).t(),
                torch.empty(4, 8, requires_grad=True), "not a tensor"]:
        with pytest.raises(CodecError):
            decode(enc, out=bad)  # type: ignore[arg-type]
    with pytest.raises(CodecError):  # header checks still come first
        decode(Encoded("int8", (4, 8), "float32", {"block_size": 128}, (b"", b"")), out=torch.empty(4, 8))


def test_codec_errors_leave_the_workspace_usable() -> None:
    codec = get_codec("int8")
    with pytest.raises(CodecError):
        codec.encode_borrowed(torch.tensor([1.0, float("nan")] * 200))
    x = torch.randn(400)
    assert joined(codec.encode_borrowed(x)) == joined(get_codec("int8").encode(x))


def test_threads_sharing_one_codec_get_their_own_bytes() -> None:
    codec = get_codec("int8")
    inputs = [torch.randn(20_000 + 31 * i, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    expected = [joined(get_codec("int8").encode(x)) for x in inputs]
    failures: list[int] = []

    def work(offset: int) -> None:
        for rep in range(10):
            i = (offset + rep) % len(inputs)
            enc = codec.encode_borrowed(inputs[i]) if rep % 2 else codec.encode(inputs[i])
            if joined(enc) != expected[i]:
                failures.append(i)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not failures


def test_deep_copies_and_pickles_start_with_an_empty_workspace() -> None:
    codec = get_codec("int8", block_size=64)
    x = torch.randn(1000)
    held = codec.encode_borrowed(x)
    for clone in (copy.deepcopy(codec), pickle.loads(pickle.dumps(codec))):
        assert clone == codec and clone._workspace is not codec._workspace
        assert joined(clone.encode_borrowed(x)) == joined(held)
    shallow = copy.copy(codec)  # shares the workspace: still safe (one lock, one lend record)
    assert joined(shallow.encode_borrowed(x)) == joined(held) == joined(codec.encode_borrowed(x))


def test_encoded_keeps_read_only_views_and_copies_writable_buffers() -> None:
    data = bytearray(b"\x01\x02\x03")
    enc = Encoded("int8", (3,), "float32", {"block_size": 128}, (data, memoryview(data)))
    assert all(isinstance(b, bytes) for b in enc.buffers)
    data[0] = 9
    assert enc.buffers[0] == b"\x01\x02\x03" and enc.buffers[1] == b"\x01\x02\x03"
    view = memoryview(b"\x01\x02\x03")
    assert Encoded("int8", (3,), "float32", {}, (view,)).buffers[0] is view
    floats = memoryview(np.zeros(2, dtype=np.float32)).toreadonly()  # not bytes: copied
    assert isinstance(Encoded("int8", (3,), "float32", {}, (floats,)).buffers[0], bytes)
