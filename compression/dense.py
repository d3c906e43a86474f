"""Dense codecs: ``fp32``, ``fp16``, ``bf16``.

Wire layout (all three): one buffer, the values in row-major order, little-endian,
``numel * itemsize`` bytes (4, 2, 2). No params. bf16 rounds to nearest-even.

fp16 overflow policy: values with ``|x| > 65504`` are not representable in fp16. By default
(``overflow="error"``) encode raises :class:`CodecError`; with ``overflow="clamp"`` they are
clamped to ±65504 (under error feedback the clamped part is carried in the residual).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from .base import Codec, CodecError, Encoded, ParamValue, dtype_name, expect_buffers, prepare, register
from .base import require_finite, tensor_bytes, tensor_from_bytes

__all__ = ["DenseCodec", "Float32Codec", "Float16Codec", "BFloat16Codec", "FP16_MAX"]

FP16_MAX = 65504.0


class DenseCodec(Codec):
    """Cast to ``wire_dtype`` and send the raw values."""

    wire_dtype: ClassVar[torch.dtype]

    def encode(self, tensor: torch.Tensor, *, key: str | None = None) -> Encoded:
        x = prepare(tensor, check_finite=False)
        y = self._cast(x, require_finite(x))
        return Encoded(self.name, tuple(tensor.shape), dtype_name(tensor.dtype), {}, (tensor_bytes(y),))

    def _cast(self, x: torch.Tensor, absmax: float) -> torch.Tensor:
        return x.to(self.wire_dtype)

    @classmethod
    def decode_encoded(cls, enc: Encoded, max_numel: int) -> torch.Tensor:
        n = enc.numel
        itemsize = torch.empty((), dtype=cls.wire_dtype).element_size()
        expect_buffers(enc, (n * itemsize,))
        if enc.params:
            raise CodecError(f"{cls.name}: unexpected params {sorted(enc.params)}")
        # .float() copies (also for fp32, where to() would alias the read-only bytes)
        return tensor_from_bytes(enc.buffers[0], cls.wire_dtype, n).to(torch.float32, copy=True)


@register
class Float32Codec(DenseCodec):
    """Lossless for fp32/fp16/bf16 inputs (fp64 inputs are rounded to fp32)."""

    name = "fp32"
    wire_dtype = torch.float32


@register
class BFloat16Codec(DenseCodec):
    """bf16: fp32's range, 8 significant bits (relative error <= 2**-8 per value)."""

    name = "bf16"
    wire_dtype = torch.bfloat16


@register
class Float16Codec(DenseCodec):
    """fp16: relative error <= 2**-11 per value in the normal range; see module doc for overflow.

    Args:
        overflow: ``"error"`` (default) refuses ``|x| > 65504``; ``"clamp"`` clamps to ±65504.
    """

    name = "fp16"
    wire_dtype = torch.float16

    def __init__(self, *, overflow: str = "error") -> None:
        if overflow not in ("error", "clamp"):
            raise CodecError(f"overflow must be 'error' or 'clamp', got {overflow!r}")
        self.overflow = overflow

    def _cast(self, x: torch.Tensor, absmax: float) -> torch.Tensor:
        if x.dtype == torch.float16:
            return x
        if absmax > FP16_MAX:
            if self.overflow == "error":
                raise CodecError(
                    f"fp16: |x| up to {absmax:.4g} exceeds fp16 max {FP16_MAX}; "
                    "use bf16/int8, or fp16 with overflow='clamp'"
                )
            x = x.clamp(-FP16_MAX, FP16_MAX)
        return x.to(torch.float16)

    def config(self) -> dict[str, ParamValue]:
        return {} if self.overflow == "error" else {"overflow": self.overflow}
