"""swarmgrad.compression: tensor codecs (pure torch; no networking).

Quick use::

    from swarmgrad.compression import get_codec, decode, ErrorFeedback
    enc = get_codec("int8", block_size=128).encode(t)   # Encoded: codec, shape, dtype, params, buffers
    t2 = decode(enc)                                      # float32, shape of t

Codecs (wire names in ``CODEC_NAMES``): fp32, fp16, bf16 (dense); int8, int4 (blockwise
absmax); topk (sparse, values through a dense/blockwise codec); powersgd (low rank, warm
start); hadamard (rotated 2/4/8-bit) and lowrank (activation subspace) for pipeline
boundaries; chunktopk (per-chunk top-k, 2/4/8/16-bit values: pseudo-gradients far below int8).
``reduce_codec`` gives the codec a reducer sends an aggregate in (the union of sparse supports).
``ErrorFeedback`` carries residuals; ``SizeAdaptive`` picks a codec by tensor size.
Hot loops reuse memory: ``codec.encode_borrowed(t)`` (read-only memoryviews into the codec's
workspace; ``enc.owned()`` copies them into bytes for a protobuf field) and
``decode(enc, out=buf)`` (writes into the caller's tensor).
Every failure is a :class:`CodecError` (a ``ValueError``).
"""

from .adaptive import SizeAdaptive
from .base import DEFAULT_MAX_NUMEL, Codec, CodecError, Encoded, decode
from .blockwise import Int4Codec, Int8Codec
from .chunktopk import ChunkTopKCodec
from .dense import BFloat16Codec, Float16Codec, Float32Codec
from .error_feedback import ErrorFeedback
from .hadamard import HadamardCodec
from .lowrank import LowRankCodec
from .powersgd import PowerSGDCodec
from .reduce import reduce_codec
from .registry import CODEC_NAMES, get_codec, parse_codec_spec
from .topk import TopKCodec

__all__ = [
    "CODEC_NAMES",
    "DEFAULT_MAX_NUMEL",
    "BFloat16Codec",
    "ChunkTopKCodec",
    "Codec",
    "CodecError",
    "Encoded",
    "ErrorFeedback",
    "Float16Codec",
    "Float32Codec",
    "Int4Codec",
    "HadamardCodec",
    "Int8Codec",
    "LowRankCodec",
    "PowerSGDCodec",
    "SizeAdaptive",
    "TopKCodec",
    "decode",
    "get_codec",
    "parse_codec_spec",
    "reduce_codec",
]
