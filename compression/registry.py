"""Building codecs by name or spec string: :func:`get_codec`, :func:`parse_codec_spec`."""

from __future__ import annotations

import inspect
from typing import Any

from .adaptive import SizeAdaptive
from .base import Codec, CodecError, ParamValue, codec_class
from .blockwise import Int4Codec, Int8Codec
from .chunktopk import ChunkTopKCodec
from .dense import BFloat16Codec, Float16Codec, Float32Codec
from .hadamard import HadamardCodec
from .lowrank import LowRankCodec
from .powersgd import PowerSGDCodec
from .topk import TopKCodec

__all__ = ["CODEC_NAMES", "get_codec", "parse_codec_spec"]

#: wire names of all codecs, in the order of increasing compression (roughly)
CODEC_NAMES: tuple[str, ...] = tuple(
    c.name for c in (Float32Codec, Float16Codec, BFloat16Codec, Int8Codec, Int4Codec, TopKCodec, PowerSGDCodec)
) + (HadamardCodec.name, LowRankCodec.name) + (  # the pipeline-boundary codecs
    ChunkTopKCodec.name,  # chunked top-k with low-bit values (DeMo / SparseLoCo family)
)


def get_codec(name: str, **kwargs: Any) -> Codec:
    """Build a codec.

    Args:
        name: a wire name in ``CODEC_NAMES``, ``"adaptive"`` (kwargs ``threshold``, ``small``,
            ``large``; the latter two Codec objects or spec strings), or a spec string such as
            ``"topk:fraction=0.01,values=int8"`` or ``"chunktopk:chunk=4096,k=64,bits=2"`` (then
            kwargs override the spec's values).
        **kwargs: the codec's constructor arguments.

    Raises:
        CodecError: unknown codec name, unknown argument, or invalid argument value; the
            message names the parameter.
    """
    if not isinstance(name, str):
        raise CodecError(f"codec name must be a str, got {type(name).__name__}")
    if ":" in name:
        spec_name, spec_kwargs = _split_spec(name)
        return get_codec(spec_name, **{**spec_kwargs, **kwargs})
    if name == SizeAdaptive.name:
        return _adaptive(**kwargs)
    if name not in CODEC_NAMES:
        raise CodecError(f"unknown codec {name!r}; known codecs: {', '.join(CODEC_NAMES)}, adaptive")
    cls = codec_class(name)
    allowed = set(inspect.signature(cls.__init__).parameters) - {"self"}
    unknown = set(kwargs) - allowed
    if unknown:
        raise CodecError(f"codec {name!r} has no parameter(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    return cls(**kwargs)


def parse_codec_spec(spec: str) -> Codec:
    """Build a codec from a spec string (what :meth:`Codec.spec` returns).

    Grammar: ``name`` or ``name:key=value,key=value``; values parse as int, float, or
    ``true``/``false``, else stay strings. Size-adaptive: ``adaptive:threshold=N|SMALL|LARGE``,
    e.g. ``"adaptive:threshold=65536|fp16|topk:fraction=0.01,values=int8"``.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise CodecError(f"codec spec must be a non-empty string, got {spec!r}")
    name, kwargs = _split_spec(spec.strip())
    return get_codec(name, **kwargs)


def _split_spec(spec: str) -> tuple[str, dict[str, Any]]:
    name, _, rest = spec.partition(":")
    name = name.strip()
    if name == SizeAdaptive.name:
        parts = rest.split("|", 2)
        if len(parts) != 3:
            raise CodecError(f"adaptive spec must be 'adaptive:threshold=N|SMALL|LARGE', got {spec!r}")
        head = _parse_kwargs(parts[0], spec)
        return name, {**head, "small": parts[1], "large": parts[2]}
    return name, _parse_kwargs(rest, spec)


def _parse_kwargs(text: str, spec: str) -> dict[str, ParamValue]:
    kwargs: dict[str, ParamValue] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise CodecError(f"codec spec {spec!r}: expected key=value, got {item!r}")
        kwargs[key.strip()] = _parse_value(value.strip())
    return kwargs


def _parse_value(text: str) -> ParamValue:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def _adaptive(threshold: Any = None, small: Any = "fp16", large: Any = "int8", **extra: Any) -> SizeAdaptive:
    if extra:
        raise CodecError(f"codec 'adaptive' has no parameter(s) {sorted(extra)}; allowed: large, small, threshold")
    if threshold is None:
        raise CodecError("codec 'adaptive' needs threshold=N")
    small = parse_codec_spec(small) if isinstance(small, str) else small
    large = parse_codec_spec(large) if isinstance(large, str) else large
    return SizeAdaptive(threshold, small, large)
