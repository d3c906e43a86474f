"""Subspace projection of activations: ``lowrank``.

Why: the residual stream that crosses a pipeline boundary lives, after the first few hundred
steps, in a subspace of far lower dimension than d_model (on the reference byte-level GPT,
d_model 128: rank 16 holds 99.6% of the energy of a microbatch's activations, rank 32 99.98%).
Protocol Models (Ramasinghe et al. 2025) build that subspace into the model; this codec finds it
per message instead, so it needs no change to the model and no state shared between peers:
each message carries its own basis. It is meant for *activations*. Gradients w.r.t. the
activations are not low rank (rank 32 keeps ~95% of their energy) and its error is biased, so
send those with ``hadamard`` (stochastic rounding) instead.

A tensor of shape ``(d0, ..., dk)`` (k >= 1) is the matrix ``M = x.reshape(-1, n)``, n = dk
(m x n: one row per token). Encode takes the top-r eigenvectors V (n x r) of ``M^T M`` (the
right singular vectors of M), rounds them to fp16 (V̂), and sends ``C = M V̂`` with one int8
absmax scale per column (columns of C scale with the singular values, so per-column scales fit
them; they cost 4r bytes in all). Decode is ``M̂ = Ĉ V̂^T``.

Rank: ``rank`` is the most the codec sends. With ``tol > 0`` it sends the smallest rank whose
truncation keeps the relative L2 error ``sqrt(1 - captured energy)`` at or below ``tol``
(capped by ``rank``), so an early, not yet low-rank stream is sent at a higher rank and a
converged one at a lower. The rank actually sent is on the wire.

Fallback: 0-d and 1-D tensors, and matrices where the low-rank payload would not be smaller
than the fallback codec's dense one, are encoded by the fallback codec (``int8`` by default);
the Encoded then names the fallback codec, so any receiver decodes it.

Wire layout (params ``{"rank": r}``; n = shape[-1], m = numel / n): buffers
``(basis, scales, coeffs)``: basis = V̂, n x r fp16 LE row-major (2nr bytes); scales = r fp32
LE (4r bytes, scale = absmax / 127 of each column of C); coeffs = m x r int8 row-major (mr bytes).
``nbytes = 2nr + 4r + mr``. Error: ``|M - M̂|_F <= |M - M V V^T|_F`` (truncation, the ``tol``
figure) ``+ sqrt(m) |scale|_2 / 2`` (rounding of C, about 0.4% of |M| for Gaussian columns)
``+`` the fp16 rounding of V (about 3e-4 relative).

Untrusted input: as with topk and powersgd a low-rank message is legitimately much smaller
than its output (``mr`` bytes for ``mn`` values), so decode's output size is bounded only by
``max_numel``; check ``enc.shape`` against the expected shape first where it is known (protocol/
does on every path). Decode cost: the rank on the wire must be below n (an encoder never sends
rank >= n: that payload is larger than the fallback's, so it sends the fallback), so the
``m n r`` product of decode is at most n multiply-adds per payload byte (``mr`` of them), the
same order as the stage's own matmuls on the decoded tensor.
"""

from __future__ import annotations

import math

import torch

from .base import Codec, CodecError, Encoded, ParamValue, check_positive_int, codec_class, dtype_name
from .base import expect_buffers, param_int, prepare, register, require_finite, tensor_bytes, tensor_from_bytes

__all__ = ["LowRankCodec", "FALLBACK_CODECS"]

FALLBACK_CODECS = ("fp32", "fp16", "bf16", "int8", "int4")
_LEVELS = 127


@register
class LowRankCodec(Codec):
    """Rank-``rank`` subspace projection with int8 coefficients; the basis travels with the message.

    Args:
        rank: most basis vectors sent, >= 1.
        tol: relative L2 truncation error to aim for, in [0, 1); 0 always sends ``rank``.
        fallback: dense codec for 0-d/1-D tensors and where low rank does not pay.
    """

    name = "lowrank"

    def __init__(self, *, rank: int = 32, tol: float = 0.0, fallback: str = "int8") -> None:
        self.rank = check_positive_int("rank", rank, 2**16)
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0.0 <= tol < 1.0:
            raise CodecError(f"tol must be a number in [0, 1), got {tol!r}")
        if fallback not in FALLBACK_CODECS:
            raise CodecError(f"fallback must be one of {FALLBACK_CODECS}, got {fallback!r}")
        self.tol = float(tol)
        self.fallback = fallback

    def config(self) -> dict[str, ParamValue]:
        cfg: dict[str, ParamValue] = {"rank": self.rank}
        if self.tol:
            cfg["tol"] = self.tol
        if self.fallback != "int8":
            cfg["fallback"] = self.fallback
        return cfg

    @staticmethod
    def payload_nbytes(m: int, n: int, r: int) -> int:
        return 2 * n * r + 4 * r + m * r

    def _pays(self, m: int, n: int) -> bool:
        """Whether rank-``rank`` factors are smaller than the fallback's dense payload."""
        dense = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0 + 4 / 128, "int4": 0.5 + 4 / 128}[self.fallback]
        return self.payload_nbytes(m, n, min(self.rank, n)) < dense * m * n

    def encode(self, tensor: torch.Tensor, *, key: str | None = None) -> Encoded:
        x = prepare(tensor, check_finite=False)
        shape = tuple(tensor.shape)
        if len(shape) < 2 or x.numel() == 0 or not self._pays(x.numel() // shape[-1], shape[-1]):
            return codec_class(self.fallback)().encode(tensor)
        require_finite(x)
        n = shape[-1]
        mat = x.float().view(-1, n)
        basis = _top_basis(mat, self.rank, self.tol).half()
        coeffs = mat @ basis.float()  # project on the basis the receiver will use
        absmax = coeffs.abs().amax(0)
        if not bool(torch.isfinite(absmax).all()):  # |M| ~ 1e38 overflows the projection
            raise CodecError(f"{self.name}: coefficients overflow float32; refusing to encode")
        scales = absmax / _LEVELS
        # a division, not a multiply by 1 / scale, which overflows for columns below ~1e-36
        codes = (coeffs / torch.where(scales > 0, scales, 1.0)).round_().clamp_(-_LEVELS, _LEVELS).to(torch.int8)
        return Encoded(self.name, shape, dtype_name(tensor.dtype), {"rank": basis.shape[1]},
                       (tensor_bytes(basis.contiguous()), tensor_bytes(scales), tensor_bytes(codes.contiguous())))

    @classmethod
    def decode_encoded(cls, enc: Encoded, max_numel: int) -> torch.Tensor:
        if len(enc.shape) < 2:
            raise CodecError(f"{cls.name}: needs a shape of at least 2 dims, got {enc.shape}")
        if set(enc.params) != {"rank"}:
            raise CodecError(f"{cls.name}: params must be exactly ['rank'], got {sorted(enc.params)}")
        n = enc.shape[-1]
        m = enc.numel // n if n else 0
        # r < n: see "Decode cost" above (rank 0 is an all-zero tensor, sent as no payload)
        r = param_int(enc, "rank", 0, max(0, n - 1))
        expect_buffers(enc, (2 * n * r, 4 * r, m * r))
        basis = tensor_from_bytes(enc.buffers[0], torch.float16, n * r).float().view(n, r)
        scales = tensor_from_bytes(enc.buffers[1], torch.float32, r)
        if not (bool(torch.isfinite(basis).all()) and bool(torch.isfinite(scales).all()) and bool((scales >= 0).all())):
            raise CodecError(f"{cls.name}: basis and scales must be finite, scales >= 0")
        coeffs = tensor_from_bytes(enc.buffers[2], torch.int8, m * r).view(m, r).float() * scales
        if r == 0:
            return torch.zeros(m, n)
        out = coeffs @ basis.T
        if out.numel() and not math.isfinite(float(out.abs().amax())):
            raise CodecError(f"{cls.name}: decoded values overflow float32")
        return out


def _top_basis(mat: torch.Tensor, rank: int, tol: float) -> torch.Tensor:
    """Top right singular vectors of ``mat`` (n x k, orthonormal columns, k <= rank).

    From the eigen-decomposition of the n x n Gram matrix in float64: n is the width of the
    residual stream (hundreds to thousands), so this costs one m n^2 product and an n^3 eigh,
    far less than an SVD of the m x n matrix, and float64 keeps the small eigenvalues that
    decide the rank meaningful."""
    n = mat.shape[1]
    gram = mat.double().T @ mat.double()
    evals, evecs = torch.linalg.eigh(gram)  # ascending
    evals, evecs = evals.flip(0).clamp_min(0.0), evecs.flip(1)
    k = min(rank, n)
    total = float(evals.sum())
    if tol > 0 and total > 0:
        residual = (total - evals.cumsum(0)) / total  # relative energy left out after keeping i+1
        within = (residual <= tol * tol).nonzero()
        k = min(k, int(within[0]) + 1 if within.numel() else n)
    elif total == 0:
        k = 0
    return evecs[:, :k].float()
