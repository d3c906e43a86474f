"""The codec contract: :class:`Encoded`, :class:`Codec`, :class:`CodecError`, the registry.

An :class:`Encoded` is self-describing: codec name, original shape and dtype, a flat dict of
JSON primitives (``params``) and raw byte buffers. Anyone can decode it with the module-level
:func:`decode` without knowing the sender's codec object, and the protocol layer can rebuild it
from primitive fields alone (``codec``, ``shape``, ``dtype``, ``params_json``, ``buffers``).

Decoding is hardened against untrusted input: every header field is checked, and each codec
checks that its buffer lengths agree with the header *before* it allocates anything the header
declares, so a tiny message that claims a huge shape is refused at once.

All multi-byte payloads are little-endian regardless of the host.
"""

from __future__ import annotations

import json
import math
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Union

import numpy as np
import torch

__all__ = [
    "CodecError",
    "Encoded",
    "Codec",
    "ParamValue",
    "DEFAULT_MAX_NUMEL",
    "register",
    "codec_class",
    "registered_names",
    "decode",
]

ParamValue = Union[int, float, str, bool]

#: decode refuses a declared shape with more elements than this unless told otherwise
DEFAULT_MAX_NUMEL = 2**31
#: decode refuses a declared shape with more dimensions than this
MAX_NDIM = 32

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


class CodecError(ValueError):
    """Bad input to a codec: invalid parameters, non-finite values, or a malformed Encoded."""


@dataclass(frozen=True)
class Encoded:
    """One compressed tensor, as it travels.

    Attributes:
        codec: wire name of the codec that produced it (one of ``CODEC_NAMES``).
        shape: the original tensor's shape (``()`` for a 0-d tensor).
        dtype: the original tensor's dtype name, e.g. ``"float32"`` or ``"bfloat16"``.
        params: everything decode needs besides the buffers; JSON primitives only
            (int, float, str, bool), so ``json.loads(json.dumps(params))`` is equal to it.
        buffers: raw payloads, codec-specific layout (see each codec's docstring): ``bytes``,
            or read-only byte memoryviews from :meth:`Codec.encode_borrowed`.

    The constructor only normalises types (a list shape becomes a tuple, bytearray and writable
    memoryview buffers become bytes); it raises :class:`CodecError` on wrongly typed fields.
    A read-only memoryview is kept without a copy (whoever made it must not change the memory
    beneath it); :meth:`owned` turns one into bytes. Semantic checks (non-negative dims, buffer
    lengths) happen in :func:`decode`.
    """

    codec: str
    shape: tuple[int, ...]
    dtype: str
    params: Mapping[str, ParamValue] = field(default_factory=dict)
    buffers: tuple[Union[bytes, memoryview], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.codec, str):
            raise CodecError(f"Encoded.codec must be a str, got {type(self.codec).__name__}")
        if not isinstance(self.dtype, str):
            raise CodecError(f"Encoded.dtype must be a str, got {type(self.dtype).__name__}")
        try:
            shape = tuple(self.shape)
        except TypeError:
            raise CodecError("Encoded.shape must be a sequence of ints") from None
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise CodecError(f"Encoded.shape must contain ints only, got {shape!r}")
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))
        if not isinstance(self.params, Mapping):
            raise CodecError("Encoded.params must be a mapping")
        for key, value in self.params.items():
            if not isinstance(key, str) or not isinstance(value, (int, float, str, bool)):
                raise CodecError(f"Encoded.params must map str to int/float/str/bool; bad entry {key!r}")
        object.__setattr__(self, "params", dict(self.params))
        buffers = []
        for buf in self.buffers:
            if isinstance(buf, memoryview) and buf.readonly and buf.format == "B" and buf.ndim == 1 \
                    and buf.c_contiguous:
                buffers.append(buf)
                continue
            if isinstance(buf, (bytearray, memoryview)):
                buf = bytes(buf)
            if not isinstance(buf, bytes):
                raise CodecError(f"Encoded.buffers must hold bytes, got {type(buf).__name__}")
            buffers.append(buf)
        object.__setattr__(self, "buffers", tuple(buffers))

    def owned(self) -> "Encoded":
        """This Encoded with every buffer as ``bytes`` (``self`` when they already are).

        A protobuf ``bytes`` field takes ``bytes`` only, so a borrowed Encoded pays this one
        copy on its way to the wire; ``encode`` pays the same copy inside the codec."""
        if all(isinstance(b, bytes) for b in self.buffers):
            return self
        return Encoded(self.codec, self.shape, self.dtype, self.params, tuple(bytes(b) for b in self.buffers))

    @property
    def nbytes(self) -> int:
        """Exact payload bytes on the wire: ``sum(len(b) for b in buffers)``.

        The small header (codec name, shape, dtype, params JSON; typically 20-120 bytes) is
        *excluded*; :attr:`header_nbytes` gives its JSON size if needed.
        """
        return sum(len(b) for b in self.buffers)

    @property
    def header_nbytes(self) -> int:
        """Bytes of the header as plain text (codec, dtype, shape, params JSON); an estimate
        of what the protocol layer adds on top of :attr:`nbytes`."""
        return len(self.codec) + len(self.dtype) + 8 * len(self.shape) + len(self.params_json())

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def params_json(self) -> str:
        """``params`` as canonical JSON (sorted keys), for the protobuf ``params_json`` field."""
        return json.dumps(self.params, sort_keys=True, separators=(",", ":"))


class Codec(ABC):
    """A tensor codec. Subclasses are small objects configured at construction.

    ``encode`` accepts any floating tensor (fp16/bf16/fp32/fp64, any device, contiguous or not,
    0-d or empty) and works on a CPU copy. It raises :class:`CodecError` for non-finite values
    (policy: refuse; a NaN/Inf pseudo-gradient is a bug upstream, never something to transmit)
    and for non-float tensors. ``decode`` returns a CPU tensor of the original shape.
    """

    #: wire name; set by subclasses
    name: ClassVar[str] = ""

    @abstractmethod
    def encode(self, tensor: torch.Tensor, *, key: str | None = None) -> Encoded:
        """Compress ``tensor``. ``key`` names a state slot for stateful codecs (PowerSGD's
        warm start); stateless codecs ignore it."""

    def encode_borrowed(self, tensor: torch.Tensor, *, key: str | None = None) -> Encoded:
        """Like :meth:`encode` (the same bytes), but the buffers may be read-only memoryviews
        into memory this codec object reuses once nothing references them any more.

        For callers that use the result in-process or copy it once themselves (``enc.owned()``
        before a protobuf field, which takes ``bytes`` only): a codec with a workspace (int8,
        int4) then neither page-faults a fresh output nor copies it into ``bytes``. Holding on to
        the result is safe, only slower (the next call allocates afresh). The default is
        :meth:`encode`."""
        return self.encode(tensor, key=key)

    def decode(
        self, enc: Encoded, dtype: torch.dtype | None = torch.float32, *, max_numel: int = DEFAULT_MAX_NUMEL,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode any :class:`Encoded` (dispatch on ``enc.codec``; see :func:`decode`)."""
        return decode(enc, dtype, max_numel=max_numel, out=out)

    @classmethod
    def decode_encoded(cls, enc: Encoded, max_numel: int) -> torch.Tensor:
        """Decode ``enc`` (already header-checked, ``enc.codec == cls.name``) to float32.

        Must verify buffer count and lengths against the header before allocating."""
        raise NotImplementedError

    @classmethod
    def decode_into(cls, enc: Encoded, max_numel: int, out: torch.Tensor) -> None:
        """Decode ``enc`` (header-checked) into ``out``: flat, contiguous, float32, ``enc.numel``
        items. Every item is written. Codecs that can write in place override this default
        (decode into a fresh tensor, then copy)."""
        out.copy_(cls.decode_encoded(enc, max_numel).reshape(-1))

    def config(self) -> dict[str, ParamValue]:
        """Constructor keyword arguments that rebuild an equal codec."""
        return {}

    def spec(self) -> str:
        """A spec string accepted by ``parse_codec_spec``, e.g. ``"int8:block_size=128"``."""
        cfg = self.config()
        if not cfg:
            return self.name
        return self.name + ":" + ",".join(f"{k}={_spec_value(v)}" for k, v in cfg.items())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec()!r})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.config() == other.config()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), self.spec()))


def _spec_value(v: ParamValue) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


# --------------------------------------------------------------------------- registry

_REGISTRY: dict[str, type[Codec]] = {}


def register(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make ``cls`` reachable by its wire name."""
    assert cls.name and cls.name not in _REGISTRY, cls.name
    _REGISTRY[cls.name] = cls
    return cls


def codec_class(name: str) -> type[Codec]:
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise CodecError(f"unknown codec {name!r}; known codecs: {sorted(_REGISTRY)}") from None


def registered_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


# --------------------------------------------------------------------------- decode


def decode(
    enc: Encoded, dtype: torch.dtype | None = torch.float32, *, max_numel: int = DEFAULT_MAX_NUMEL,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode ``enc`` with the codec it names.

    Args:
        enc: the Encoded, possibly rebuilt from untrusted wire fields.
        dtype: dtype of the result; ``None`` means the original dtype (``enc.dtype``).
        max_numel: refuse a declared shape with more elements than this.
        out: optional destination, reused by the caller across calls: a contiguous CPU tensor
            of shape ``enc.shape`` and the result's dtype. Every item is overwritten (int8/int4
            write in place: no page faults of a fresh output); on an error its contents are
            undefined.

    Returns:
        A CPU tensor of shape ``enc.shape`` (``out`` itself when given).

    Raises:
        CodecError: unknown codec, bad shape/dtype/params, buffers that disagree with the
            header, out-of-range indices, non-finite scales or factors, an ``out`` of the wrong
            shape, dtype or layout. Nothing the header declares is allocated before the buffer
            lengths have been checked.
    """
    if not isinstance(enc, Encoded):
        raise CodecError(f"decode expects an Encoded, got {type(enc).__name__}")
    cls = codec_class(enc.codec)
    check_header(enc, max_numel)
    target = _DTYPES[enc.dtype] if dtype is None else dtype
    if out is not None:
        check_out(enc, out, target)
        if out.dtype == torch.float32:
            cls.decode_into(enc, max_numel, out.view(-1))
        else:
            out.copy_(cls.decode_encoded(enc, max_numel).reshape(enc.shape))
        return out
    out = cls.decode_encoded(enc, max_numel)
    if out.shape != torch.Size(enc.shape):
        out = out.reshape(enc.shape)
    return out if out.dtype == target else out.to(target)


def check_out(enc: Encoded, out: torch.Tensor, dtype: torch.dtype) -> None:
    """Refuse a ``decode(out=...)`` destination that cannot take ``enc`` as ``dtype``."""
    if not isinstance(out, torch.Tensor):
        raise CodecError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.shape != torch.Size(enc.shape) or out.dtype != dtype:
        raise CodecError(f"out has shape {tuple(out.shape)} and dtype {out.dtype}; "
                         f"decode needs shape {enc.shape} and dtype {dtype}")
    if out.device.type != "cpu" or not out.is_contiguous() or out.requires_grad:
        raise CodecError("out must be a contiguous CPU tensor that does not require grad")


def check_header(enc: Encoded, max_numel: int) -> None:
    """Checks common to every codec: shape, numel limit, dtype name."""
    if len(enc.shape) > MAX_NDIM:
        raise CodecError(f"shape has {len(enc.shape)} dims; at most {MAX_NDIM} allowed")
    if any(d < 0 for d in enc.shape):
        raise CodecError(f"shape {enc.shape} has a negative dimension")
    numel = math.prod(enc.shape)  # exact Python int: no overflow
    if numel > max_numel:
        raise CodecError(f"shape {enc.shape} declares {numel} elements > max_numel={max_numel}")
    if enc.dtype not in _DTYPES:
        raise CodecError(f"dtype {enc.dtype!r} not supported; expected one of {sorted(_DTYPES)}")


# --------------------------------------------------------------------------- helpers for codecs


def prepare(tensor: torch.Tensor, *, check_finite: bool = True) -> torch.Tensor:
    """Validate an encode input and return it as a flat, contiguous CPU float tensor.

    fp16/bf16/fp32 keep their dtype (so dense codecs avoid a round trip through fp32);
    fp64 becomes fp32."""
    if not isinstance(tensor, torch.Tensor):
        raise CodecError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise CodecError(f"expected a floating-point tensor, got dtype {tensor.dtype}")
    if dtype_name(tensor.dtype) not in _DTYPES:
        raise CodecError(f"dtype {tensor.dtype} not supported")
    x = tensor.detach()
    if x.device.type != "cpu":
        x = x.cpu()
    if x.dtype == torch.float64:
        x = x.float()
    x = x.contiguous().reshape(-1)
    if check_finite:
        require_finite(x)
    return x


def require_finite(x: torch.Tensor, what: str = "input") -> float:
    """Raise CodecError on NaN/Inf; return max |x| (0.0 for an empty tensor).

    Uses amax/amin (NaN propagates, Inf shows up as an infinite extreme): two streaming
    reductions are ~10x faster on CPU than ``isfinite(x).all()``."""
    if x.numel() == 0:
        return 0.0
    absmax = max(float(x.amax()), -float(x.amin()))
    if not math.isfinite(absmax):
        raise CodecError(f"{what} contains NaN or Inf; refusing to encode (fix the producer)")
    return absmax


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_bytes(x: torch.Tensor) -> bytes:
    """Raw little-endian bytes of a contiguous CPU tensor (bf16 via an int16 view)."""
    if x.dtype == torch.bfloat16:
        x = x.view(torch.int16)
    arr = x.numpy()
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and not np.little_endian):
        arr = arr.byteswap()
    return arr.tobytes()


_NP_LE = {
    torch.float32: "<f4",
    torch.float16: "<f2",
    torch.bfloat16: "<i2",
    torch.int8: "i1",
    torch.uint8: "u1",
    torch.int64: "<i8",
}


def tensor_from_bytes(buf: bytes, dtype: torch.dtype, count: int, offset: int = 0) -> torch.Tensor:
    """A read-only CPU tensor viewing ``count`` items of ``buf`` (caller checked the length).

    Do not write into the result; derive new tensors from it."""
    arr = np.frombuffer(buf, dtype=_NP_LE[dtype], count=count, offset=offset)
    if not np.little_endian and arr.dtype.itemsize > 1:
        arr = arr.byteswap().view(arr.dtype.newbyteorder("="))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "array is not writable": we never write
        t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def expect_buffers(enc: Encoded, lengths: tuple[int, ...]) -> None:
    """Refuse unless ``enc.buffers`` has exactly these lengths."""
    if len(enc.buffers) != len(lengths):
        raise CodecError(f"{enc.codec}: expected {len(lengths)} buffers, got {len(enc.buffers)}")
    for i, (buf, n) in enumerate(zip(enc.buffers, lengths)):
        if len(buf) != n:
            raise CodecError(f"{enc.codec}: buffer {i} has {len(buf)} bytes; header implies {n}")


def param_int(enc: Encoded, key: str, lo: int, hi: int | None = None) -> int:
    value = enc.params.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise CodecError(f"{enc.codec}: param {key!r} must be an int, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        raise CodecError(f"{enc.codec}: param {key!r}={value} out of range [{lo}, {hi}]")
    return value


def param_str(enc: Encoded, key: str, choices: tuple[str, ...]) -> str:
    value = enc.params.get(key)
    if value not in choices:
        raise CodecError(f"{enc.codec}: param {key!r}={value!r} not one of {choices}")
    return value  # type: ignore[return-value]


def check_positive_int(name: str, value: Any, hi: int | None = None) -> int:
    """Constructor check: ``value`` is an int >= 1 (and <= hi)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1 or (hi is not None and value > hi):
        bound = f" and <= {hi}" if hi is not None else ""
        raise CodecError(f"{name} must be an int >= 1{bound}, got {value!r}")
    return value
