"""Chunked top-k with low-bit values: ``chunktopk`` (the DeMo / SparseLoCo family).

The flattened tensor is cut into chunks of ``chunk`` values (the last may be shorter). Each chunk
keeps its ``k`` entries of largest magnitude (``min(k, len)`` in a short last chunk), or, with
``k = 0``, every non-zero entry: that is the reducer's mode (see :mod:`.reduce`), whose message
holds the union of the members' supports without cutting it again. The kept values are quantised
against the chunk's scale ``s = max |kept|`` with ``bits`` bits each:

- bits 2, 3, 4, 8: mid-rise codes, one sign bit and ``bits - 1`` magnitude bits, ``L = 2**(bits-1)``
  levels: ``j = min(L - 1, floor(|x| / s * L))``, decoded as ``±(j + 0.5) / L * s``. Top-k values
  are never small relative to their chunk, so no level is spent on zero.
- bits 16: ``x / s`` as fp16.
- bits 1: the sign alone, decoded as ``±m`` with ``m`` = the chunk's *mean* kept ``|x|`` (the
  scale sent for bits 1), so the chunk's L1 mass is sent exactly (scaled sign with error
  feedback: Karimireddy et al., 2019). With ``k = chunk`` it is dense: ~1 bit per value.

Why chunks (Peng et al., DeMo, 2024; SparseLoCo, 2025): a per-chunk k spreads the budget over
the whole tensor, indices cost ``log2(chunk)`` bits whatever the tensor's size, and a
per-chunk scale keeps low-bit values accurate where magnitudes differ between regions. Under
:class:`~swarmgrad.compression.ErrorFeedback` everything dropped or rounded is carried on.

Error budget, per chunk with scale s (kept set S: the k largest |x|, or the non-zeros if k = 0):
``x̂ = 0`` off S (every dropped |x| <= every kept |x|); on S, ``|x - x̂| <= s / 2**bits`` for
bits 2/3/4/8, ``<= s * 2**-11`` for bits 16, and ``<= max |kept|`` for bits 1 (both ``|x|`` and
``m`` are at most that).

Wire layout. Params ``{"chunk": C, "k": k, "bits": b}``; n = numel, nc = ceil(n / C),
w = bit_length(C - 1) (index bits), c = bit_length(C) (count bits), K = kept entries.
Buffers ``(scales, [counts,] indices, values)``:

- scales: nc fp32 little-endian (4 * nc bytes), each chunk's s (0 for a chunk with nothing kept);
- counts (only when k = 0): each chunk's kept count in c bits, ``ceil(nc * c / 8)`` bytes;
  with k >= 1 the counts follow from the header: ``min(k, len(chunk))``;
- indices, in one of three layouts fixed by the header (``_index_layout``):
  "list" (k = 0, or k * w < C): each kept entry's position inside its chunk, ascending within
  the chunk, chunks in order, w bits each (little-endian bit order, as topk): ``ceil(K * w / 8)``
  bytes; "bitmap" (1 <= k < C and C <= k * w, where one bit per value is smaller): bit i set iff
  value i is kept, ``ceil(n / 8)`` bytes; "all" (k = C: every value kept): empty;
- values: the codes in the same order, b bits each (``ceil(K * b / 8)`` bytes), or fp16 for
  b = 16 (2 * K bytes).

``nbytes = 4 nc + [ceil(nc c / 8)] + index bytes + ceil(K b / 8)``. E.g. C = 4096, k = 64,
b = 2 (1.6 % density): 0.23 bits per value, 140x smaller than fp32; k = C = 4096, b = 1
(every value's sign): 1.008 bits per value, 32x smaller.

Untrusted input: decode checks every length against the header before it allocates. Every
chunk costs 4 payload bytes (its scale), so the output is at most C / 4 values per payload byte
(C <= 65536), besides the ``max_numel`` limit. Indices out of their chunk or not strictly
ascending within it, a bitmap that does not mark each chunk's count, counts above the chunk's
length, and non-finite or negative scales are refused.
"""

from __future__ import annotations

import torch

from .base import Codec, CodecError, Encoded, ParamValue, dtype_name, expect_buffers, param_int, prepare
from .base import register, tensor_bytes, tensor_from_bytes
from .topk import _pack_bits, _unpack_bits

__all__ = ["ChunkTopKCodec", "MAX_CHUNK", "VALUE_BITS"]

MAX_CHUNK = 2**16
#: allowed value widths
VALUE_BITS = (1, 2, 3, 4, 8, 16)


@register
class ChunkTopKCodec(Codec):
    """Per-chunk top-k with a per-chunk scale and low-bit values.

    Args:
        chunk: values per chunk, in [2, 65536] (default 4096).
        k: entries kept per chunk, in [1, chunk]; 0 keeps every non-zero entry (the reducer's
            mode: sparse input stays exactly as sparse as it is).
        bits: bits per kept value: 1 (sign x the chunk's mean kept magnitude), 2, 3, 4, 8 (mid-rise
            codes) or 16 (fp16).
    """

    name = "chunktopk"

    def __init__(self, *, chunk: int = 4096, k: int = 64, bits: int = 4) -> None:
        if not _is_int(chunk) or not 2 <= chunk <= MAX_CHUNK:
            raise CodecError(f"chunk must be an int in [2, {MAX_CHUNK}], got {chunk!r}")
        if not _is_int(k) or not 0 <= k <= chunk:
            raise CodecError(f"k must be an int in [0, chunk={chunk}] (0: every non-zero), got {k!r}")
        if not _is_int(bits) or bits not in VALUE_BITS:
            raise CodecError(f"bits must be one of {VALUE_BITS}, got {bits!r}")
        self.chunk = chunk
        self.k = k
        self.bits = bits

    def config(self) -> dict[str, ParamValue]:
        return {"chunk": self.chunk, "k": self.k, "bits": self.bits}

    def nbytes_for(self, numel: int, kept: int | None = None) -> int:
        """Exact payload bytes of :meth:`encode` on ``numel`` values (``kept``: the number of
        non-zeros, needed only when k = 0)."""
        if numel == 0:
            return 0
        nc = -(-numel // self.chunk)
        if self.k:
            last = numel - (nc - 1) * self.chunk
            kept = (nc - 1) * min(self.k, self.chunk) + min(self.k, last)
            counts = 0
        else:
            if kept is None:
                raise CodecError("nbytes_for: k = 0 needs the number of non-zeros")
            counts = (nc * self.chunk.bit_length() + 7) // 8
        return 4 * nc + counts + _index_bytes(self.chunk, self.k, numel, kept) + _value_bytes(kept, self.bits)

    def encode(self, tensor: torch.Tensor, *, key: str | None = None) -> Encoded:
        x = prepare(tensor)
        if x.dtype != torch.float32:
            x = x.float()
        n, C = x.numel(), self.chunk
        params: dict[str, ParamValue] = {"chunk": C, "k": self.k, "bits": self.bits}
        shape, dtype = tuple(tensor.shape), dtype_name(tensor.dtype)
        if n == 0:
            return Encoded(self.name, shape, dtype, params, (b"",) * (3 if self.k else 4))
        nc = -(-n // C)
        if self.k >= C:  # every position kept, in order: no selection, no index bytes, no gather
            rows = torch.arange(nc).repeat_interleave(C)[:n]
            values = x
        else:
            a = torch.full((nc * C,), -1.0)  # padding ranks below every real |x|
            a[:n] = x.abs()
            a = a.view(nc, C)
            if self.k:
                cols = torch.topk(a, self.k, dim=1, sorted=False).indices.sort(dim=1).values
                rows = torch.arange(nc).unsqueeze(1).expand_as(cols)
                keep = rows * C + cols < n  # drops padding picked in a short last chunk
                rows, cols = rows[keep], cols[keep]
            else:
                rows, cols = torch.nonzero(a > 0, as_tuple=True)  # row-major: ascending within a chunk
            pos = rows * C + cols
            values = x[pos]
        if self.bits == 1:  # the kept entries' mean magnitude: the chunk's L1 mass is sent exactly
            sums = torch.zeros(nc).index_add_(0, rows, values.abs())
            scales = sums / torch.bincount(rows, minlength=nc).clamp(min=1).float()
        elif self.k >= C:  # whole chunks as the rows of a grid (the padding's zeros exceed no |x|)
            scales = torch.nn.functional.pad(x.abs(), (0, nc * C - n)).view(nc, C).amax(dim=1)
        else:
            scales = torch.zeros(nc).scatter_reduce_(0, rows, values.abs(), "amax")
        buffers = [tensor_bytes(scales)]
        if not self.k:
            counts = torch.bincount(rows, minlength=nc)
            buffers.append(_pack_bits(counts.numpy(), C.bit_length()))
        layout = _index_layout(C, self.k)
        if layout == "list":
            buffers.append(_pack_bits(cols.numpy(), _index_bits(C)))
        elif layout == "bitmap":
            bitmap = torch.zeros(n, dtype=torch.int64)
            bitmap[pos] = 1
            buffers.append(_pack_bits(bitmap.numpy(), 1))
        else:
            buffers.append(b"")
        buffers.append(_quantise(values, scales[rows], self.bits))
        return Encoded(self.name, shape, dtype, params, tuple(buffers))

    @classmethod
    def decode_encoded(cls, enc: Encoded, max_numel: int) -> torch.Tensor:
        n = enc.numel
        C = param_int(enc, "chunk", 2, MAX_CHUNK)
        k = param_int(enc, "k", 0, C)
        bits = param_int(enc, "bits", 1, 16)
        if bits not in VALUE_BITS:
            raise CodecError(f"chunktopk: bits={bits} not one of {VALUE_BITS}")
        extra = set(enc.params) - {"chunk", "k", "bits"}
        if extra:
            raise CodecError(f"chunktopk: unexpected params {sorted(extra)}")
        n_buffers = 3 if k else 4
        if len(enc.buffers) != n_buffers:
            raise CodecError(f"chunktopk: expected {n_buffers} buffers, got {len(enc.buffers)}")
        if n == 0:
            expect_buffers(enc, (0,) * n_buffers)
            return torch.zeros(0)
        nc = -(-n // C)
        # the scales buffer pays for every chunk: checked before anything of size n or nc exists
        if len(enc.buffers[0]) != 4 * nc:
            raise CodecError(f"chunktopk: scales buffer has {len(enc.buffers[0])} bytes; header implies {4 * nc}")
        last = n - (nc - 1) * C
        if k:
            kept = (nc - 1) * min(k, C) + min(k, last)
            counts = None
            lengths = (4 * nc, _index_bytes(C, k, n, kept), _value_bytes(kept, bits))
        else:
            cbits = C.bit_length()
            if len(enc.buffers[1]) != (nc * cbits + 7) // 8:
                raise CodecError(f"chunktopk: counts buffer must hold {(nc * cbits + 7) // 8} bytes")
            counts = torch.from_numpy(_unpack_bits(enc.buffers[1], nc, cbits))
            sizes = torch.full((nc,), C, dtype=torch.int64)
            sizes[-1] = last
            if bool((counts > sizes).any()):
                raise CodecError("chunktopk: a chunk's count exceeds its length")
            kept = int(counts.sum())
            lengths = (4 * nc, len(enc.buffers[1]), (kept * _index_bits(C) + 7) // 8, _value_bytes(kept, bits))
        expect_buffers(enc, lengths)
        scales = tensor_from_bytes(enc.buffers[0], torch.float32, nc)
        if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
            raise CodecError("chunktopk: scales must be finite and >= 0")
        if counts is None:
            counts = torch.full((nc,), min(k, C), dtype=torch.int64)
            counts[-1] = min(k, last)
        layout = _index_layout(C, k)
        if layout == "all":  # every position, in order: the values are the tensor
            return _dequantise(enc.buffers[-1], kept, bits, scales.repeat_interleave(C)[:n])
        if layout == "bitmap":
            pos = torch.from_numpy(_unpack_bits(enc.buffers[-2], n, 1)).nonzero().squeeze(1)
            rows = pos // C
            if pos.numel() != kept or not bool((torch.bincount(rows, minlength=nc) == counts).all()):
                raise CodecError("chunktopk: the bitmap does not mark each chunk's count of entries")
        else:
            rows = torch.repeat_interleave(torch.arange(nc), counts)
            cols = torch.from_numpy(_unpack_bits(enc.buffers[-2], kept, _index_bits(C)))
            _check_positions(rows, cols, C, last, nc)
            pos = rows * C + cols
        values = _dequantise(enc.buffers[-1], kept, bits, scales[rows])
        out = torch.zeros(n, dtype=torch.float32)
        out[pos] = values
        return out


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _index_bits(chunk: int) -> int:
    return max(1, (chunk - 1).bit_length())


def _index_layout(chunk: int, k: int) -> str:
    """How kept positions travel (fixed by the header): "all" when every position is kept (k >=
    chunk: no index bytes), "bitmap" (one bit per value) when that is smaller than k indices of
    ``_index_bits`` each, else "list". The reducer's k = 0 mode always lists."""
    if k >= chunk:
        return "all"
    if k and chunk <= k * _index_bits(chunk):
        return "bitmap"
    return "list"


def _index_bytes(chunk: int, k: int, numel: int, kept: int) -> int:
    layout = _index_layout(chunk, k)
    if layout == "all":
        return 0
    if layout == "bitmap":
        return (numel + 7) // 8
    return (kept * _index_bits(chunk) + 7) // 8


def _value_bytes(kept: int, bits: int) -> int:
    return 2 * kept if bits == 16 else (kept * bits + 7) // 8


def _quantise(values: torch.Tensor, scales: torch.Tensor, bits: int) -> bytes:
    """Codes of ``values`` against their chunks' ``scales`` (see the module docstring)."""
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    ratio = (values / safe).clamp(-1.0, 1.0)
    if bits == 16:
        return tensor_bytes(ratio.to(torch.float16))
    if bits == 1:
        return _pack_bits((values < 0).to(torch.int64).numpy(), 1)
    levels = 1 << (bits - 1)
    mag = (ratio.abs() * levels).floor().clamp(max=levels - 1).to(torch.uint8)  # codes fit in 8 bits
    codes = mag | ((values < 0).to(torch.uint8) << (bits - 1))
    return _pack_bits(codes.numpy(), bits)


def _dequantise(buf: bytes, kept: int, bits: int, scales: torch.Tensor) -> torch.Tensor:
    if bits == 16:
        ratio = tensor_from_bytes(buf, torch.float16, kept).float()
        if not bool(torch.isfinite(ratio).all()) or bool((ratio.abs() > 1).any()):
            raise CodecError("chunktopk: fp16 values must be finite and within [-1, 1]")
        return ratio * scales
    codes = torch.from_numpy(_unpack_bits(buf, kept, bits))
    if bits == 1:
        return (1.0 - 2.0 * codes.float()) * scales
    levels = 1 << (bits - 1)
    mag = ((codes & (levels - 1)).float() + 0.5) / levels
    sign = 1.0 - 2.0 * ((codes >> (bits - 1)) & 1).float()
    return sign * mag * scales


def _check_positions(rows: torch.Tensor, cols: torch.Tensor, chunk: int, last: int, nc: int) -> None:
    """Every index inside its chunk and strictly ascending within it (so no position twice)."""
    if cols.numel() == 0:
        return
    limit = torch.where(rows == nc - 1, last, chunk)
    if bool((cols >= limit).any()):
        raise CodecError("chunktopk: an index lies outside its chunk")
    same = rows[1:] == rows[:-1]
    if bool((same & (cols[1:] <= cols[:-1])).any()):
        raise CodecError("chunktopk: indices must ascend strictly within a chunk")
