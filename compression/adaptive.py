"""Size-adaptive codec choice: small tensors dense, large ones compressed.

Small tensors (biases, norms) are a negligible share of bytes but suffer most from lossy
codecs (a 1-value block, a top-k of 1); sending them dense costs little.
"""

from __future__ import annotations

import math

import torch

from .base import Codec, CodecError, Encoded, ParamValue

__all__ = ["SizeAdaptive"]


class SizeAdaptive(Codec):
    """Encode with ``small`` when ``numel < threshold``, else with ``large``.

    The Encoded names the inner codec that produced it, so decoding needs nothing from here.

    Args:
        threshold: numel at and above which ``large`` is used (>= 0).
        small: codec for small tensors (cheap dense, e.g. fp16 or fp32).
        large: codec for the rest (int8, topk, powersgd, ...).
    """

    name = "adaptive"  # not a wire name: never appears in an Encoded

    def __init__(self, threshold: int, small: Codec, large: Codec) -> None:
        if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0:
            raise CodecError(f"threshold must be an int >= 0, got {threshold!r}")
        for label, c in (("small", small), ("large", large)):
            if not isinstance(c, Codec):
                raise CodecError(f"{label} must be a Codec, got {type(c).__name__}")
        self.threshold = threshold
        self.small = small
        self.large = large

    def pick(self, shape: tuple[int, ...]) -> Codec:
        return self.small if math.prod(shape) < self.threshold else self.large

    def encode(self, tensor: torch.Tensor, *, key: str | None = None) -> Encoded:
        if not isinstance(tensor, torch.Tensor):
            raise CodecError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        return self.pick(tuple(tensor.shape)).encode(tensor, key=key)

    def config(self) -> dict[str, ParamValue]:
        return {"threshold": self.threshold, "small": self.small.spec(), "large": self.large.spec()}

    def spec(self) -> str:
        # nested specs contain ':' and ',', so the adaptive spec uses '|' between parts
        return f"adaptive:threshold={self.threshold}|{self.small.spec()}|{self.large.spec()}"
