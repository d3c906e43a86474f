"""The int8 codec's encode/decode as of commit 0aea204 (before the speed work of issue 45), kept
as the baseline that ``benchmarks/codecs.py --speed-only`` measures in the same run as today's.

Same wire bytes as :class:`swarmgrad.compression.blockwise.Int8Codec` (the benchmark checks it):
only the work per chunk differs. Not registered; benchmark use only.
"""

from __future__ import annotations

import math

import torch

from swarmgrad.compression import CodecError, Encoded, decode
from swarmgrad.compression.base import tensor_from_bytes
from swarmgrad.compression.blockwise import Int8Codec
from swarmgrad.compression.workspace import Workspace, scratch

__all__ = ["LegacyInt8", "legacy_decode"]

_CHUNK = 2**18
_TINY_ABSMAX = 2.0**-100


class LegacyInt8(Int8Codec):
    """Int8Codec with the old chunk loop: amax, amin, a tiny-block mask per chunk, and fresh
    outputs from ``torch.empty``."""

    def _quantize(self, x: torch.Tensor, ws: Workspace | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        n, bs, L = x.numel(), self.block_size, self.levels
        nfull, tail = divmod(n, bs)
        scales = scratch(ws, "scales", torch.float32, nfull + (tail > 0))
        codes = scratch(ws, "codes", torch.int8, n)
        cb = max(1, _CHUNK // bs)
        tmp = scratch(ws, "tmp", torch.float32, min(nfull, cb) * bs)
        aux = scratch(ws, "aux", torch.float32, min(nfull, cb))
        inv = scratch(ws, "inv", torch.float32, min(nfull, cb))
        xv, qv = x[: nfull * bs].view(nfull, bs), codes[: nfull * bs].view(nfull, bs)
        for b0 in range(0, nfull, cb):
            m = min(cb, nfull - b0)
            self._rows(xv[b0 : b0 + m], scales[b0 : b0 + m], qv[b0 : b0 + m],
                       tmp[: m * bs].view(m, bs), aux[:m], inv[:m])
        if tail:
            self._rows(x[nfull * bs :].view(1, tail), scales[nfull:], codes[nfull * bs :].view(1, tail),
                       torch.empty(1, tail), torch.empty(1), torch.empty(1))
        if scales.numel() and not math.isfinite(float(scales.amax())):
            raise CodecError(f"{self.name}: input contains NaN or Inf; refusing to encode")
        scales.div_(L)
        return codes, scales

    def _rows(self, xc, s, qc, t, aux, inv) -> None:
        L = self.levels
        torch.amax(xc, 1, out=s)
        torch.amin(xc, 1, out=aux)
        torch.maximum(s, aux.neg_(), out=s)
        torch.reciprocal(s, out=inv).mul_(L).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        torch.mul(xc, inv[:, None], out=t)
        tiny = (s > 0) & (s < _TINY_ABSMAX)
        if bool(tiny.any()):
            t[tiny] = xc[tiny] / s[tiny, None] * L
        if self.stochastic:
            t.add_(torch.rand(t.shape, generator=self._generator)).floor_().clamp_(-L, L)
        else:
            t.round_()
        qc.copy_(t)


def legacy_decode(enc: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
    """The old decode: a fresh ``torch.empty`` output (unless ``out``), then per chunk a copy of
    the codes and a multiply by the scales."""
    if enc.codec != "int8":
        return decode(enc, out=out)
    n, bs, scales = Int8Codec._check(enc)
    result = torch.empty(n, dtype=torch.float32) if out is None else out.view(-1)
    codes = tensor_from_bytes(enc.buffers[0], torch.int8, n)
    nfull = n // bs
    cb = max(1, _CHUNK // bs)
    ov, cv = result[: nfull * bs].view(nfull, bs), codes[: nfull * bs].view(nfull, bs)
    full_scales = scales[:nfull]
    for b0 in range(0, nfull, cb):
        o = ov[b0 : b0 + cb]
        o.copy_(cv[b0 : b0 + cb])
        o.mul_(full_scales[b0 : b0 + cb, None])
    if n % bs:
        result[nfull * bs :].copy_(codes[nfull * bs :]).mul_(scales[nfull])
    return result.view(enc.shape) if out is None else out
