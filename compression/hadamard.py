"""Randomised-Hadamard rotation, then blockwise absmax quantisation: ``hadamard``.

Why: an absmax quantiser spends its range on the largest value of each block, so its error
grows with the block's peak-to-RMS ratio. Gradients w.r.t. boundary activations are heavy
tailed (kurtosis ~5 on the reference GPT) and activations have outlier channels; a random
orthogonal rotation of each block spreads every outlier over the whole block and makes the
values nearly Gaussian (the trick of QuaRot / QuIP#), so 4 and even 2 bits per value keep a
useful signal. With ``stochastic=True`` the rounding is unbiased, and since the rotation is
linear so is the decoded tensor (``E[x̂] = x``): the right choice for gradients, whose rounding
errors would otherwise add up over the tokens of a microbatch in one direction.

Transform: the flat tensor is cut into blocks of ``block_size`` B (a power of two; the last
block is zero-padded to B, and the padding travels). Each block is multiplied element-wise by a
fixed ±1 pattern (bits of SHA-256 of ``b"swarmgrad-hadamard" + counter``, the same on every
machine and version), then by the orthonormal Walsh-Hadamard matrix ``H / sqrt(B)``. Decode
applies the same two steps in the reverse order (both are their own inverses).

Quantisation: per block ``scale = absmax / M`` (fp32) with ``M = 2**bits - 1``, and every one
of the ``2**bits`` codes used: code q stands for ``(2q - M) * scale``, an evenly spaced grid
from ``-absmax`` to ``+absmax`` (bits 2: ±scale, ±3 scale). A grid without an exact zero is no
loss here: after the rotation exact zeros are rare, and at 2 bits four levels instead of the
three of a symmetric ``[-L, L]`` code halve the squared error. Codes are stored in ``bits``
bits, ``8 / bits`` codes per byte, code i of a byte in bits ``[i*bits, (i+1)*bits)``.

Wire layout (params ``{"bits": b, "block_size": B}``; n = numel, nb = ceil(n / B)): buffers
``(codes, scales)``: codes = ``nb * B * b / 8`` bytes; scales = 4 nb bytes fp32 LE.
``nbytes = nb * (B * b / 8 + 4)``.

Decode cost: the codes buffer must hold every block's ``B * b / 8`` bytes, so the output is at
most ``8 / b`` (<= 4) values per payload byte and the transform ``log2 B`` (<= 16) butterfly
passes over it: bounded by the payload, whatever header a remote sends.

Error (relative L2, Gaussian data, B = 128, measured): bits 8: 0.5%; bits 4: 10% (round to
nearest), 14% (stochastic); bits 2: 50% (round), 74% (stochastic).
"""

from __future__ import annotations

import functools
import hashlib
import math

import numpy as np
import torch

from .base import Codec, CodecError, Encoded, ParamValue, check_positive_int, dtype_name, expect_buffers
from .base import param_int, prepare, register, tensor_bytes, tensor_from_bytes

__all__ = ["HadamardCodec", "BITS", "MAX_HADAMARD_BLOCK"]

BITS = (2, 4, 8)
MAX_HADAMARD_BLOCK = 2**16


@register
class HadamardCodec(Codec):
    """Rotate each block by a fixed randomised Hadamard transform, then quantise to ``bits``.

    Args:
        bits: 2, 4 or 8 bits per value.
        block_size: values per rotation and per scale, a power of two in [8, 65536].
        stochastic: unbiased stochastic rounding instead of round-to-nearest.
        seed: seeds this codec's own generator for stochastic rounding (reproducible runs);
            ``None`` uses torch's global generator.
    """

    name = "hadamard"

    def __init__(self, *, bits: int = 4, block_size: int = 128, stochastic: bool = False,
                 seed: int | None = None) -> None:
        if bits not in BITS or isinstance(bits, bool):
            raise CodecError(f"bits must be one of {BITS}, got {bits!r}")
        check_positive_int("block_size", block_size, MAX_HADAMARD_BLOCK)
        if block_size < 8 or block_size & (block_size - 1):
            raise CodecError(f"block_size must be a power of two in [8, {MAX_HADAMARD_BLOCK}], got {block_size}")
        if not isinstance(stochastic, bool):
            raise CodecError(f"stochastic must be a bool, got {stochastic!r}")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise CodecError(f"seed must be an int or None, got {seed!r}")
        self.bits, self.block_size, self.stochastic, self.seed = bits, block_size, stochastic, seed
        self._generator = torch.Generator().manual_seed(seed) if seed is not None else None

    def config(self) -> dict[str, ParamValue]:
        cfg: dict[str, ParamValue] = {"bits": self.bits, "block_size": self.block_size}
        if self.stochastic:
            cfg["stochastic"] = True
        if self.seed is not None:
            cfg["seed"] = self.seed
        return cfg

    def encode(self, tensor: torch.Tensor, *, key: str | None = None) -> Encoded:
        x = prepare(tensor, check_finite=False).float()
        n, bs, top = x.numel(), self.block_size, 2**self.bits - 1
        nb = -(-n // bs)
        blocks = torch.zeros(nb * bs)
        blocks[:n] = x
        blocks = _rotate(blocks.view(nb, bs))
        absmax = blocks.abs().amax(1)
        if nb and not math.isfinite(float(absmax.amax())):  # NaN/Inf propagate through the rotation
            raise CodecError(f"{self.name}: input contains NaN or Inf, or overflows float32; refusing to encode")
        scales = absmax / top
        # t = (x / scale + M) / 2 in [0, M]: the code whose level 2q - M is nearest (or, with
        # stochastic rounding, one of the two around it with probabilities that make it unbiased)
        # (a division, not a multiply by 1 / scale, which overflows for blocks below ~1e-36)
        t = blocks.div_(torch.where(scales > 0, scales, 1.0)[:, None]).add_(top).mul_(0.5)
        if self.stochastic:
            t.add_(torch.rand(t.shape, generator=self._generator)).floor_()
        else:
            t.round_()
        codes = t.clamp_(0, top).to(torch.uint8)
        params = {"bits": self.bits, "block_size": bs}
        return Encoded(self.name, tuple(tensor.shape), dtype_name(tensor.dtype), params,
                       (_pack(codes.view(-1), self.bits), tensor_bytes(scales)))

    @classmethod
    def decode_encoded(cls, enc: Encoded, max_numel: int) -> torch.Tensor:
        if set(enc.params) != {"bits", "block_size"}:
            raise CodecError(f"{cls.name}: params must be exactly ['bits', 'block_size'], got {sorted(enc.params)}")
        bits = param_int(enc, "bits", 2, 8)
        bs = param_int(enc, "block_size", 8, MAX_HADAMARD_BLOCK)
        if bits not in BITS or bs & (bs - 1):
            raise CodecError(f"{cls.name}: bits={bits} block_size={bs}: bits must be in {BITS}, block_size a power of 2")
        n, top = enc.numel, 2**bits - 1
        nb = -(-n // bs)
        expect_buffers(enc, (nb * bs * bits // 8, 4 * nb))
        scales = tensor_from_bytes(enc.buffers[1], torch.float32, nb)
        if nb and not (bool(torch.isfinite(scales).all()) and bool((scales >= 0).all())):
            raise CodecError(f"{cls.name}: scales must be finite and >= 0")
        codes = _unpack(enc.buffers[0], bits, nb * bs)  # every code is valid
        blocks = codes.view(nb, bs).float().mul_(2.0).sub_(top).mul_(scales[:, None])
        out = _unrotate(blocks).view(-1)[:n]
        if n and not math.isfinite(float(out.abs().amax())):
            raise CodecError(f"{cls.name}: decoded values overflow float32")
        return out


@functools.lru_cache(maxsize=8)
def _signs(bs: int) -> torch.Tensor:
    """The fixed ±1 pattern of a block: bits of SHA-256 in counter mode (machine independent)."""
    stream = b"".join(hashlib.sha256(b"swarmgrad-hadamard" + i.to_bytes(4, "little")).digest()
                      for i in range(-(-bs // 256)))
    bits = np.unpackbits(np.frombuffer(stream, dtype=np.uint8), bitorder="little")[:bs]
    return torch.from_numpy(1.0 - 2.0 * bits.astype(np.float32))


def _rotate(blocks: torch.Tensor) -> torch.Tensor:
    """``(H / sqrt(B)) diag(signs) x`` for each row ``x`` of ``blocks`` (nb x B); a new tensor."""
    return _fwht(blocks * _signs(blocks.shape[1]))


def _unrotate(blocks: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_rotate`: both factors are symmetric and their own inverses."""
    return _fwht(blocks).mul_(_signs(blocks.shape[1]))


def _fwht(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal fast Walsh-Hadamard transform of each row (log2 B butterfly passes)."""
    nb, bs = x.shape
    h = 1
    while h < bs:
        pairs = x.view(nb, bs // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        x = torch.stack((a + b, a - b), dim=2).view(nb, bs)
        h *= 2
    return x.mul_(1.0 / math.sqrt(bs))


def _pack(codes: torch.Tensor, bits: int) -> bytes:
    if bits == 8:
        return tensor_bytes(codes)
    per = 8 // bits
    lanes = codes.view(-1, per).to(torch.int32)
    packed = torch.zeros(lanes.shape[0], dtype=torch.int32)
    for i in range(per):
        packed |= lanes[:, i] << (i * bits)
    return tensor_bytes(packed.to(torch.uint8))


def _unpack(buf: bytes, bits: int, count: int) -> torch.Tensor:
    packed = tensor_from_bytes(buf, torch.uint8, count * bits // 8)
    if bits == 8:
        return packed
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    return ((packed[:, None] >> shifts) & mask).view(-1)
