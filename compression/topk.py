"""Top-k sparsification: ``topk``.

Keeps the ``k = max(1, ceil(fraction * numel))`` entries of largest magnitude (k = 0 for an
empty tensor); decode puts them back in place and zeros elsewhere. Meant to be used under
:class:`~swarmgrad.compression.ErrorFeedback`, which carries the dropped mass to the next round.

Wire layout. Params: ``k``, ``index_bits`` (w), ``values`` (codec name of the values) and the
values codec's own params prefixed ``"values."`` (e.g. ``"values.block_size": 128``).
Buffers: ``(indices, *value_buffers)``.

- indices: the kept positions sorted ascending, delta-coded (the first as is, then
  ``gap - 1`` for each next one, so positions are strictly increasing by construction), each
  packed into w bits, little-endian bit order (``numpy.packbits(..., bitorder="little")``),
  ``ceil(k * w / 8)`` bytes. w is the bit length of the largest delta (>= 1), so it is at most
  ``bit_length(numel - 1)`` and usually much less (~10 bits at 1% density).
- values: the k kept values in index order, encoded by the values codec as a 1-D tensor.

``nbytes = ceil(k * w / 8) + values.nbytes(k)``; e.g. fraction 0.01, values int8 (block 128)
on 1M floats: ~145x smaller than fp32.

Untrusted input: decode checks every length against the header before allocating, but a
sparse message is *legitimately* much smaller than its output (k values, numel zeros), so the
output size is bounded only by ``max_numel``. A receiver that knows the expected shape should
compare ``enc.shape`` with it (or pass ``max_numel``) before decoding.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .base import Codec, CodecError, Encoded, ParamValue, codec_class, dtype_name, param_int, param_str
from .base import prepare, register

__all__ = ["TopKCodec", "VALUE_CODECS"]

#: codecs allowed for the kept values (dense or blockwise: no nesting of sparse codecs)
VALUE_CODECS = ("fp32", "fp16", "bf16", "int8", "int4")
_PREFIX = "values."


@register
class TopKCodec(Codec):
    """Keep the largest-magnitude fraction of entries.

    Args:
        fraction: share of entries kept, in (0, 1].
        values: codec for the kept values: a name in ``VALUE_CODECS`` or such a Codec object
            (e.g. ``get_codec("int8", block_size=64)``).
    """

    name = "topk"

    def __init__(self, *, fraction: float = 0.01, values: str | Codec = "fp16") -> None:
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
            raise CodecError(f"fraction must be in (0, 1], got {fraction!r}")
        if isinstance(values, str):
            if values not in VALUE_CODECS:
                raise CodecError(f"values must be one of {VALUE_CODECS}, got {values!r}")
            values = codec_class(values)()
        if not isinstance(values, Codec) or values.name not in VALUE_CODECS:
            raise CodecError(f"values must be one of {VALUE_CODECS}, got {values!r}")
        self.fraction = float(fraction)
        self.values = values

    def config(self) -> dict[str, ParamValue]:
        # a values codec with non-default settings is not expressible in a flat spec string;
        # config() then names only its codec
        return {"fraction": self.fraction, "values": self.values.name}

    def k_for(self, numel: int) -> int:
        if numel == 0:
            return 0
        # the 1e-9 guards float fuzz such as 0.07 * 100 = 7.000000000000001
        return min(numel, max(1, math.ceil(self.fraction * numel - 1e-9)))

    def encode(self, tensor: torch.Tensor, *, key: str | None = None) -> Encoded:
        x = prepare(tensor)
        if x.dtype != torch.float32:
            x = x.float()
        n = x.numel()
        k = self.k_for(n)
        idx = _topk_indices(x, k).sort().values
        deltas = idx.clone()
        if k > 1:
            deltas[1:] = idx[1:] - idx[:-1] - 1
        bits = max(1, int(deltas.max()).bit_length()) if k else 1
        venc = self.values.encode(x[idx])
        params: dict[str, ParamValue] = {"k": k, "index_bits": bits, "values": venc.codec}
        params.update({_PREFIX + key_: v for key_, v in venc.params.items()})
        return Encoded(
            self.name, tuple(tensor.shape), dtype_name(tensor.dtype), params,
            (_pack_bits(deltas.numpy(), bits), *venc.buffers),
        )

    @classmethod
    def decode_encoded(cls, enc: Encoded, max_numel: int) -> torch.Tensor:
        n = enc.numel
        k = param_int(enc, "k", 0, n)
        if (k == 0) != (n == 0):
            raise CodecError(f"topk: k={k} invalid for numel {n}")
        bits = param_int(enc, "index_bits", 1, max(1, (n - 1).bit_length()))
        vname = param_str(enc, "values", VALUE_CODECS)
        vparams = {key[len(_PREFIX):]: v for key, v in enc.params.items() if key.startswith(_PREFIX)}
        extra = set(enc.params) - {"k", "index_bits", "values"} - {_PREFIX + p for p in vparams}
        if extra:
            raise CodecError(f"topk: unexpected params {sorted(extra)}")
        if k * 2**bits >= 2**62:  # keeps the cumulative sum below int64 overflow
            raise CodecError(f"topk: k={k} with index_bits={bits} is out of range")
        if not enc.buffers or len(enc.buffers[0]) != (k * bits + 7) // 8:
            raise CodecError(f"topk: index buffer must hold {(k * bits + 7) // 8} bytes for k={k}, bits={bits}")
        # the values sub-message is checked by its own codec (count and lengths) before use
        venc = Encoded(vname, (k,), "float32", vparams, enc.buffers[1:])
        vals = codec_class(vname).decode_encoded(venc, max_numel)
        deltas = torch.from_numpy(_unpack_bits(enc.buffers[0], k, bits))
        if k > 1:
            deltas[1:] += 1
        idx = torch.cumsum(deltas, 0)  # strictly increasing, < k * 2**bits: no overflow
        if k and int(idx[-1]) >= n:
            raise CodecError(f"topk: index {int(idx[-1])} out of range for numel {n}")
        out = torch.zeros(n, dtype=torch.float32)
        out[idx] = vals.reshape(-1)
        return out


def _topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest |x| (exact; ties broken arbitrarily).

    A full ``torch.topk`` over millions of values is slow on CPU (~60 MB/s). Instead, estimate
    a threshold from a strided sample at twice the needed density, keep the candidates above
    it (a few streaming passes), and run topk on those only. The result is exact whenever at
    least k candidates survive, since every non-candidate is below every candidate;
    otherwise (unlucky sample) fall back to the full topk."""
    n = x.numel()
    if k == n:
        return torch.arange(n, dtype=torch.int64)
    a = x.abs()
    if n >= 1 << 16 and 4 * k < n:
        stride = n // (1 << 14)
        sample = a[::stride]
        above = max(1, min(sample.numel() - 1, (2 * k * sample.numel()) // n))
        threshold = torch.kthvalue(sample, sample.numel() - above).values
        candidates = torch.nonzero(a >= threshold).view(-1)
        if candidates.numel() >= k:
            return candidates[torch.topk(a[candidates], k, sorted=False).indices]
    return torch.topk(a, k, sorted=False).indices


def _pack_bits(values: np.ndarray, bits: int) -> bytes:
    """Pack non-negative ints (< 2**bits) into ``bits`` bits each, little-endian bit order."""
    if values.size == 0:
        return b""
    if 8 % bits == 0:  # whole codes per byte: shifts of uint8, no matrix of single bits
        return _pack_aligned(values, bits)
    shifts = np.arange(bits, dtype=np.int64)
    bitmat = ((values.astype(np.int64)[:, None] >> shifts) & 1).astype(np.uint8)
    return np.packbits(bitmat.reshape(-1), bitorder="little").tobytes()


def _pack_aligned(values: np.ndarray, bits: int) -> bytes:
    """_pack_bits for bits in (1, 2, 4, 8), byte for byte the same: value i sits in bits
    i*bits .. of the stream, so byte j holds values j*per .. j*per + per - 1, the first lowest."""
    per = 8 // bits
    codes = values.astype(np.uint8)
    if bits == 8:
        return codes.tobytes()
    if bits == 1:
        return np.packbits(codes, bitorder="little").tobytes()
    pad = -codes.size % per
    if pad:
        codes = np.concatenate([codes, np.zeros(pad, dtype=np.uint8)])
    grid = codes.reshape(-1, per)
    out = grid[:, 0].copy()
    for i in range(1, per):
        out |= grid[:, i] << np.uint8(i * bits)
    return out.tobytes()


def _unpack_aligned(raw: np.ndarray, count: int, bits: int) -> np.ndarray:
    """Inverse of _pack_aligned, as int64 (what _unpack_bits returns)."""
    if bits == 8:
        return raw[:count].astype(np.int64)
    if bits == 1:
        return np.unpackbits(raw, count=count, bitorder="little").astype(np.int64)
    per, mask = 8 // bits, np.uint8((1 << bits) - 1)
    grid = np.empty((raw.size, per), dtype=np.uint8)
    for i in range(per):
        grid[:, i] = (raw >> np.uint8(i * bits)) & mask
    return grid.reshape(-1)[:count].astype(np.int64)


_UNPACK_CHUNK = 1 << 16
"""Values unpacked at a time: the bit matrix of one chunk (64 bytes per bit of width) stays
small, so unpacking allocates the int64 result (8 bytes per value) and O(chunk) besides,
never 64 bytes per bit of the payload."""


def _unpack_bits(buf: bytes, count: int, bits: int) -> np.ndarray:
    """Inverse of :func:`_pack_bits`; caller checked ``len(buf) == ceil(count * bits / 8)``."""
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    raw = np.frombuffer(buf, dtype=np.uint8)
    if 8 % bits == 0:
        return _unpack_aligned(raw, count, bits)
    out = np.zeros(count, dtype=np.int64)
    weights = np.left_shift(np.int64(1), np.arange(bits, dtype=np.int64))
    # chunks start on a byte boundary: chunk * bits is a multiple of 8
    for start in range(0, count, _UNPACK_CHUNK):
        n = min(_UNPACK_CHUNK, count - start)
        first = start * bits // 8
        chunk = raw[first : first + (n * bits + 7) // 8]
        flat = np.unpackbits(chunk, count=n * bits, bitorder="little")
        out[start : start + n] = flat.reshape(n, bits).astype(np.int64) @ weights
    return out
