"""The codec a reducer encodes an aggregate with: :func:`reduce_codec`.

In a reduce-scatter each reducer decodes the members' contributions, aggregates them and sends
every member the same encoded aggregate. Members run error feedback on what *their own* encode
dropped; nothing feeds back what the reducer's encode drops. So the reducer's codec must not drop
anything the contributions carried:

- a sparse codec (``topk``, ``chunktopk`` with k >= 1): the aggregate's support is the *union* of
  the members' supports (the weighted mean and centered clipping around the coordinate-wise
  median are both zero where every member is zero), up to n times one member's k. Re-encoding it
  with the members' own k would cut it back to k and lose the rest for good (measured: about
  half of a 2-member round's mass at 1 %). The reducer sends every non-zero instead
  (``chunktopk`` with k = 0), values at >= 8 bits (fp16 for fp16/bf16/fp32-valued top-k), so
  the only loss is one fine rounding of each value.
- a dense codec (fp32/fp16/bf16/int8/int4, hadamard, lowrank): the aggregate is dense anyway; the
  same codec re-quantises it once.
- powersgd: unchanged (known limitation: a mean of rank-r contributions re-encoded at rank r).

Or the reducer keeps error feedback of its own (``feedback=True``): then it encodes the mean
with the members' codec, and what that drops is added to the next mean it reduces, as a member's
residual is. That keeps the answer as small as a contribution (the union at >= 8 bits costs 3x a
2-bit contribution's bytes), and loses nothing for good.
"""

from __future__ import annotations

from .adaptive import SizeAdaptive
from .base import Codec
from .chunktopk import ChunkTopKCodec
from .topk import TopKCodec

__all__ = ["reduce_codec", "UNION_CHUNK"]

UNION_CHUNK = 4096
"""Chunk size of the union message for plain ``topk`` contributions (12-bit indices)."""


def reduce_codec(codec: Codec, *, feedback: bool = False) -> Codec:
    """The codec a reducer uses for the aggregate of contributions encoded with ``codec``.

    ``feedback``: the reducer keeps error feedback of its own (manifest averaging.reducer_feedback),
    so it may drop what ``codec`` drops, as members do: the answer uses ``codec`` itself.

    Pure and deterministic: every reducer and every receiver derives the same codec from the
    manifest's spec (``protocol.codecs`` accepts its wire names on the reducer's answer)."""
    if feedback:
        return codec
    if isinstance(codec, SizeAdaptive):
        return SizeAdaptive(codec.threshold, reduce_codec(codec.small), reduce_codec(codec.large))
    if isinstance(codec, ChunkTopKCodec):
        return ChunkTopKCodec(chunk=codec.chunk, k=0, bits=max(8, codec.bits))
    if isinstance(codec, TopKCodec):
        bits = 16 if codec.values.name in ("fp32", "fp16", "bf16") else 8
        return ChunkTopKCodec(chunk=UNION_CHUNK, k=0, bits=bits)
    return codec
