"""Low-rank compression: ``powersgd`` (Vogels et al. 2019), one power iteration, warm start.

A tensor of shape ``(d0, ..., dk)`` with k >= 1 is viewed as the matrix
``M = x.reshape(-1, dk)`` (m x n: leading dims collapsed, last dim kept). With the previous
``Q`` (n x r) for this slot (random, seeded, the first time):

    P = orthonormalize(M Q)     (m x r, reduced QR)
    Q = M^T P                   (n x r; also stored as the next warm start)
    M ~ P Q^T

This compresses one tensor on its own (a peer sends its P and Q); it is not the
all-reduce-linear variant that averages P across workers before orthonormalising.

Fallback: 1-D and 0-d tensors, and matrices where rank-r factors would not be smaller than
the fallback's dense payload (``4 r (m + n) >= m n * fallback_itemsize``), are encoded by the
fallback codec (``fp16`` by default). The returned Encoded then names the fallback codec
(``enc.codec == "fp16"``), so any receiver decodes it without knowing about PowerSGD.

Wire layout (params ``{"rank": r}``; m, n from the shape): buffers ``(P, Q)``, fp32 LE,
row-major, ``4*m*r`` and ``4*n*r`` bytes. ``nbytes = 4 r (m + n)``.

Untrusted input: as with topk, a low-rank message is legitimately far smaller than its
output (``4 r (m + n)`` bytes for ``m n`` values), so decode's output size is bounded only by
``max_numel``; check ``enc.shape`` against the expected shape first where it is known.

State: the codec object keeps one Q per slot: ``key`` if given to :meth:`encode`, otherwise
``"shape:m x n"``. Use distinct keys for distinct parameters of equal shape (ErrorFeedback
passes its tensor name). :meth:`state_dict` / :meth:`load_state_dict` / :meth:`reset` manage it.
"""

from __future__ import annotations

import math

import torch

from .base import Codec, CodecError, Encoded, ParamValue, check_positive_int, codec_class, dtype_name
from .base import expect_buffers, param_int, prepare, register, tensor_bytes, tensor_from_bytes

__all__ = ["PowerSGDCodec", "FALLBACK_CODECS"]

FALLBACK_CODECS = ("fp32", "fp16", "bf16", "int8", "int4")
_ITEMSIZE = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0 + 4 / 128, "int4": 0.5 + 4 / 128}


@register
class PowerSGDCodec(Codec):
    """Rank-``rank`` approximation with one warm-started power iteration per encode.

    Args:
        rank: r >= 1.
        fallback: dense codec name for tensors where low rank does not pay (see module doc).
        seed: seeds the initial Q of each slot (deterministic given seed, slot and shape).
    """

    name = "powersgd"

    def __init__(self, *, rank: int = 4, fallback: str = "fp16", seed: int = 0) -> None:
        self.rank = check_positive_int("rank", rank, 2**16)
        if fallback not in FALLBACK_CODECS:
            raise CodecError(f"fallback must be one of {FALLBACK_CODECS}, got {fallback!r}")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise CodecError(f"seed must be an int, got {seed!r}")
        self.fallback = fallback
        self.seed = seed
        self._fallback_codec = codec_class(fallback)()
        self._q: dict[str, torch.Tensor] = {}

    def config(self) -> dict[str, ParamValue]:
        return {"rank": self.rank, "fallback": self.fallback, "seed": self.seed}

    def uses_low_rank(self, shape: tuple[int, ...]) -> bool:
        """Whether a tensor of this shape gets P, Q factors (otherwise the fallback)."""
        if len(shape) < 2:
            return False
        m, n = math.prod(shape[:-1]), shape[-1]
        r = self.rank
        return r < min(m, n) and 4 * r * (m + n) < m * n * _ITEMSIZE[self.fallback]

    def encode(self, tensor: torch.Tensor, *, key: str | None = None) -> Encoded:
        if not isinstance(tensor, torch.Tensor):
            raise CodecError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        shape = tuple(tensor.shape)
        if not self.uses_low_rank(shape):
            return self._fallback_codec.encode(tensor)
        x = prepare(tensor)
        if x.dtype != torch.float32:
            x = x.float()
        n = shape[-1]
        M = x.view(-1, n)
        m = M.shape[0]
        slot = key if key is not None else f"shape:{m}x{n}"
        q = self._q.get(slot)
        if q is None or q.shape != (n, self.rank) or not bool(q.any()):  # all-zero: restart
            gen = torch.Generator().manual_seed(self.seed)
            q = torch.randn(n, self.rank, generator=gen)
        # only Q's column space matters for the iteration: unit columns keep M @ q from
        # overflowing (huge values) or losing precision (tiny ones)
        q = q / q.norm(dim=0).clamp_min(1e-30)
        p = torch.linalg.qr(M @ q).Q  # (m, r), orthonormal columns
        q = M.T @ p  # (n, r)
        if not bool(torch.isfinite(q).all()):
            raise CodecError("powersgd: factors overflow fp32 (|x| near fp32 max); use int8 or bf16")
        self._q[slot] = q
        return Encoded(
            self.name, shape, dtype_name(tensor.dtype), {"rank": self.rank},
            (tensor_bytes(p.contiguous()), tensor_bytes(q.contiguous())),
        )

    @classmethod
    def decode_encoded(cls, enc: Encoded, max_numel: int) -> torch.Tensor:
        if len(enc.shape) < 2:
            raise CodecError(f"powersgd: shape {enc.shape} must have at least 2 dims")
        r = param_int(enc, "rank", 1, 2**16)
        if set(enc.params) != {"rank"}:
            raise CodecError(f"powersgd: unexpected params {sorted(set(enc.params) - {'rank'})}")
        m, n = math.prod(enc.shape[:-1]), enc.shape[-1]
        # an encoder only sends factors when they are smaller than the matrix (see uses_low_rank),
        # and a rank of min(m, n) or more is no low-rank approximation: refusing both keeps the
        # product's cost (m n r) within a factor of min(m, n) of the output bounded by max_numel
        if not r < min(m, n) or r * (m + n) >= m * n:
            raise CodecError(f"powersgd: rank {r} is not low rank for a {m}x{n} matrix")
        expect_buffers(enc, (4 * m * r, 4 * n * r))
        p = tensor_from_bytes(enc.buffers[0], torch.float32, m * r).view(m, r)
        q = tensor_from_bytes(enc.buffers[1], torch.float32, n * r).view(n, r)
        if not (bool(torch.isfinite(p).all()) and bool(torch.isfinite(q).all())):
            raise CodecError("powersgd: factors contain NaN or Inf")
        return p @ q.T

    # ------------------------------------------------------------------ warm-start state

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Warm-start Q per slot (copies)."""
        return {k: v.clone() for k, v in self._q.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for k, v in state.items():
            if not isinstance(v, torch.Tensor) or v.ndim != 2 or v.shape[1] != self.rank:
                raise CodecError(f"powersgd state {k!r}: expected a (n, {self.rank}) tensor")
            if not bool(torch.isfinite(v).all()):
                raise CodecError(f"powersgd state {k!r} contains NaN or Inf")
        self._q = {k: v.detach().float().cpu().clone() for k, v in state.items()}

    def reset(self, key: str | None = None) -> None:
        """Forget the warm start of ``key`` (all slots if None)."""
        if key is None:
            self._q.clear()
        else:
            self._q.pop(key, None)
