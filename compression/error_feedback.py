"""Error feedback: carry what a lossy codec dropped into the next encode of the same tensor.

For each name, ``encode`` sends ``C(x + e)`` and keeps ``e' = (x + e) - D(C(x + e))``. Summed
over steps, ``sum(decoded) = sum(inputs) - e_final``: the error never accumulates beyond one
residual, which is what makes top-k, int4 and PowerSGD converge like the uncompressed run
(Seide et al. 2014; Karimireddy et al. 2019).

With ``decay`` β < 1 the residual is scaled by β before each encode (``C(x + β·e)``): SparseLoCo's
accumulator (Sarfi et al. 2025), which replaces outer momentum with this decayed error feedback
(outer lr 1, no momentum); what β removes is lost on purpose, so old mass fades instead of being
sent rounds late. β = 1 is plain error feedback.

The residuals are explicit state owned by the caller: save them with :meth:`state_dict`,
restore with :meth:`load_state_dict`. Residuals are fp32 on the CPU.
"""

from __future__ import annotations

import torch

from .base import Codec, CodecError, Encoded, decode, prepare

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """Error-feedback wrapper around one codec, with one residual per tensor name.

    Args:
        codec: the (lossy) codec; its ``encode`` receives ``key=name`` (PowerSGD warm start).
        decay: β in (0, 1]: the residual is multiplied by it before it joins the next input.
    """

    def __init__(self, codec: Codec, decay: float = 1.0) -> None:
        if not isinstance(codec, Codec):
            raise CodecError(f"ErrorFeedback needs a Codec, got {type(codec).__name__}")
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay <= 1.0:
            raise CodecError(f"error feedback decay must be in (0, 1], got {decay!r}")
        self.codec = codec
        self.decay = float(decay)
        self._residuals: dict[str, torch.Tensor] = {}

    def encode(self, name: str, tensor: torch.Tensor) -> Encoded:
        """Encode ``tensor + decay·residual[name]`` and update the residual.

        Raises:
            CodecError: non-finite input (the residual is left unchanged), or a shape that
                differs from the stored residual's (call :meth:`reset` first if intended).
        """
        return self.encode_decoded(name, tensor)[0]

    def encode_decoded(self, name: str, tensor: torch.Tensor) -> tuple[Encoded, torch.Tensor]:
        """:meth:`encode`, and ``decode`` of what it returns (fp32, the input's shape): the
        residual needs that decode anyway, and a sender that also uses its own decoded values
        (as every receiver decodes them) need not decode a second time."""
        x = prepare(tensor).float().reshape(tensor.shape)
        residual = self._residuals.get(name)
        if residual is not None:
            if residual.shape != x.shape:
                raise CodecError(
                    f"error feedback {name!r}: shape {tuple(x.shape)} != stored residual "
                    f"{tuple(residual.shape)}; reset({name!r}) first"
                )
            x = x + (residual if self.decay == 1.0 else self.decay * residual)
        enc = self.codec.encode(x, key=name)
        # record the original dtype: the receiver may want it back
        enc = Encoded(enc.codec, enc.shape, str(tensor.dtype).removeprefix("torch."), enc.params, enc.buffers)
        decoded = decode(enc)
        self._residuals[name] = x - decoded
        return enc, decoded

    def residual(self, name: str) -> torch.Tensor | None:
        """The current residual for ``name`` (a copy), or None."""
        r = self._residuals.get(name)
        return None if r is None else r.clone()

    def names(self) -> list[str]:
        """The names that hold a residual."""
        return list(self._residuals)

    def reset(self, name: str | None = None) -> None:
        """Drop the residual of ``name`` (all residuals if None)."""
        if name is None:
            self._residuals.clear()
        else:
            self._residuals.pop(name, None)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Residuals by name (copies)."""
        return {k: v.clone() for k, v in self._residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Replace all residuals; refuses non-tensor, non-float or non-finite entries."""
        new: dict[str, torch.Tensor] = {}
        for k, v in state.items():
            if not isinstance(k, str) or not isinstance(v, torch.Tensor) or not v.is_floating_point():
                raise CodecError(f"error feedback state {k!r}: expected a float tensor")
            v = v.detach().float().cpu().clone()
            if not bool(torch.isfinite(v).all()):
                raise CodecError(f"error feedback state {k!r} contains NaN or Inf")
            new[k] = v
        self._residuals = new
