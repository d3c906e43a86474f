"""Which wire codec names a receiver accepts on each path, computed from the manifest's specs.

A peer only decodes what the manifest says its peers send: anything else is refused by name
before a codec runs, so a stranger cannot pick the codec whose decode is costliest for us.
"""
from __future__ import annotations

from swarmgrad.compression import Codec, SizeAdaptive, parse_codec_spec, reduce_codec

FP32_ONLY = frozenset({"fp32"})
"""State sync sends θ_global and momentum whole, in fp32 (peer/state/sync.py)."""


def wire_codec_names(codec: str | Codec) -> frozenset[str]:
    """The `EncodedTensor.codec` names an encoder built from `codec` can emit.

    A spec string or a Codec: "int8" -> {"int8"}; "topk:values=int8" -> {"topk"} (its values
    travel inside the topk message); "powersgd:rank=4,fallback=fp16" -> {"powersgd", "fp16"}
    (small or 1-D tensors go out in the fallback; likewise "lowrank"); "adaptive:threshold=N|fp32|int8" ->
    {"fp32", "int8"}. Raises CodecError for a spec that does not parse.
    """
    if isinstance(codec, str):
        codec = parse_codec_spec(codec)
    if isinstance(codec, SizeAdaptive):
        return wire_codec_names(codec.small) | wire_codec_names(codec.large)
    # low-rank codecs (powersgd, lowrank) send tensors where factors do not pay in their dense
    # `fallback` codec, named as such on the wire
    fallback = getattr(codec, "fallback", None)
    if isinstance(fallback, str):
        return frozenset({codec.name, fallback})
    return frozenset({codec.name})


def averaging_codecs(spec: str | Codec, small_tensor_threshold: int, *, mean: bool = False,
                     reducer_feedback: bool = False) -> frozenset[str]:
    """Codecs of the averaging path, as peer/averaging/averager.py encodes them.

    mean=False: the members' contributions (AverageRequest): the configured codec for large
    tensors and fp32 for those under the threshold (SizeAdaptive(averaging.small_tensor_threshold,
    fp32, averaging.codec)). mean=True: the reducer's answer (AverageResponse), encoded with
    `compression.reduce_codec` of that codec: the same names for dense codecs, a union-of-supports
    "chunktopk" for sparse ones ("topk" -> {"chunktopk"}), so a mean is never re-sparsified;
    with `reducer_feedback` (averaging.reducer_feedback), the contributions' own names.
    """
    codec = parse_codec_spec(spec) if isinstance(spec, str) else spec
    large = wire_codec_names(reduce_codec(codec, feedback=reducer_feedback) if mean else codec)
    return large if small_tensor_threshold <= 0 else large | FP32_ONLY
