"""Validation of every message another peer sends us: wire messages in, typed values out.

Nothing from the network reaches peer code without passing through here. Each check that
fails raises ProtocolError with a wire Status and a reason that the caller sends back, so a
bad message is refused, explained, and leaves no trace in the receiver's state.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from swarmgrad.compression import CODEC_NAMES, CodecError, Encoded, decode
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.framing import ProtocolError

Codecs = frozenset[str] | None
"""Wire codec names accepted on a path (protocol/codecs.py computes them from the manifest);
None accepts every known codec (kept for callers that predate the check)."""

MAX_PARAMS_JSON = 4096
"""Codec parameters are a handful of numbers; anything longer is not a codec's."""

MAX_ROUND = 2**40
"""Round numbers and counts of applied rounds from other peers lie in [0, MAX_ROUND]: a peer that
claims a larger number is refused rather than believed (thousands of years of rounds)."""
MAX_ID_CHARS = 128
"""Peer ids, digests and hashes from the wire are at most this long (ours are 24-64 characters)."""
ROUND_TICKET_BYTES = 64
"""A forward request's round ticket is an Ed25519 signature, or absent."""
PART_SIGNATURE_BYTES = 64
"""An averaging part's signature (averaging.verify: peer/averaging/signed_parts.py) is an Ed25519
signature, or absent."""

RAW_DTYPES = {"int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8, "float32": torch.float32}
DTYPE_NAMES = {"float32", "float16", "bfloat16"}

Spec = Callable[[int], tuple[tuple[int, ...], torch.dtype]]
"""batch size -> (shape, dtype) of a boundary tensor."""


@dataclass(frozen=True)
class RunIdentity:
    run_id: str
    manifest_hash: str


def check_envelope(env: pb.Envelope, identity: RunIdentity, stages: Sequence[int]) -> None:
    if env.run_id != identity.run_id:
        raise ProtocolError(pb.WRONG_RUN, f"run_id {env.run_id!r} is not this peer's run {identity.run_id!r}")
    if env.manifest_hash != identity.manifest_hash:
        raise ProtocolError(pb.WRONG_RUN, f"manifest hash {env.manifest_hash[:12]!r} differs from ours "
                                          f"{identity.manifest_hash[:12]!r}: the peers run different manifests")
    if env.stage not in stages:
        raise ProtocolError(pb.WRONG_STAGE, f"stage {env.stage} is not served here (serving {list(stages)})")


def envelope(identity: RunIdentity, stage: int) -> pb.Envelope:
    return pb.Envelope(run_id=identity.run_id, manifest_hash=identity.manifest_hash, stage=stage)


def _check_shape(shape: Sequence[int], max_numel: int, what: str) -> tuple[int, ...]:
    if len(shape) > 8:
        raise ProtocolError(pb.BAD_REQUEST, f"{what}: {len(shape)} dimensions (at most 8)")
    numel = 1
    for dim in shape:
        if dim < 0:
            raise ProtocolError(pb.BAD_REQUEST, f"{what}: negative dimension in shape {list(shape)}")
        numel *= dim
        if numel > max_numel:
            raise ProtocolError(pb.TOO_LARGE, f"{what}: shape {list(shape)} exceeds {max_numel} elements")
    return tuple(int(d) for d in shape)


def encoded_from_proto(msg: pb.EncodedTensor, max_numel: int, what: str = "tensor", *,
                       allowed_codecs: Codecs = None) -> Encoded:
    """Turn a wire EncodedTensor into an Encoded after checking its header (not its payload).

    Raises ProtocolError(BAD_REQUEST) for an unknown codec or one not in `allowed_codecs`, a
    bad dtype, or codec params that are not a flat JSON object of numbers, strings and bools;
    TOO_LARGE for a shape over `max_numel`.
    """
    if msg.codec not in CODEC_NAMES:
        raise ProtocolError(pb.BAD_REQUEST, f"{what}: unknown codec {msg.codec[:32]!r}")
    if allowed_codecs is not None and msg.codec not in allowed_codecs:
        raise ProtocolError(pb.BAD_REQUEST, f"{what}: codec {msg.codec!r} is not accepted here "
                                            f"(the manifest allows {sorted(allowed_codecs)})")
    if msg.dtype not in DTYPE_NAMES:
        raise ProtocolError(pb.BAD_REQUEST, f"{what}: dtype {msg.dtype!r} not one of {sorted(DTYPE_NAMES)}")
    shape = _check_shape(msg.shape, max_numel, what)
    if len(msg.params_json) > MAX_PARAMS_JSON:
        raise ProtocolError(pb.BAD_REQUEST, f"{what}: codec params longer than {MAX_PARAMS_JSON} characters")
    try:
        params = json.loads(msg.params_json) if msg.params_json else {}
    except json.JSONDecodeError as e:
        raise ProtocolError(pb.BAD_REQUEST, f"{what}: codec params are not JSON ({e})") from None
    except (RecursionError, ValueError, OverflowError, MemoryError, TypeError) as e:
        # deep nesting (RecursionError), over-long integers (ValueError), ...
        raise ProtocolError(pb.BAD_REQUEST, f"{what}: codec params are not usable JSON ({type(e).__name__})") from None
    if not isinstance(params, dict):
        raise ProtocolError(pb.BAD_REQUEST, f"{what}: codec params must be a JSON object")
    try:
        return Encoded(codec=msg.codec, shape=shape, dtype=msg.dtype, params=params, buffers=tuple(msg.buffers))
    except CodecError as e:  # e.g. a param that is a list or null
        raise ProtocolError(pb.BAD_REQUEST, f"{what}: {e}"[:500]) from None


def encoded_to_proto(enc: Encoded) -> pb.EncodedTensor:
    """The wire form of an encoded tensor. A borrowed Encoded (codec.encode_borrowed) is copied
    into bytes here: protobuf takes nothing else, and a codec may reuse the buffers it lent."""
    enc = enc.owned()
    return pb.EncodedTensor(codec=enc.codec, shape=list(enc.shape), dtype=enc.dtype,
                            params_json=enc.params_json(), buffers=list(enc.buffers))


def decode_tensor(msg: pb.EncodedTensor, max_numel: int, what: str = "tensor",
                  expected_shape: tuple[int, ...] | None = None, *, allowed_codecs: Codecs = None) -> torch.Tensor:
    """Header checks, shape check against what we expect, payload decode, finiteness.

    Every failure, including an exception a codec was not written to expect, is a
    ProtocolError with a reason: nothing another peer sends escapes as another exception."""
    enc = encoded_from_proto(msg, max_numel, what, allowed_codecs=allowed_codecs)
    if expected_shape is not None and enc.shape != tuple(expected_shape):
        raise ProtocolError(pb.BAD_REQUEST, f"{what}: shape {list(enc.shape)[:9]} but expected {list(expected_shape)}")
    try:
        tensor = decode(enc, max_numel=max_numel)
    except CodecError as e:
        raise ProtocolError(pb.BAD_REQUEST, f"{what}: {e}"[:500]) from None
    except (RecursionError, ValueError, OverflowError, MemoryError, TypeError, IndexError, RuntimeError) as e:
        raise ProtocolError(pb.BAD_REQUEST, f"{what}: undecodable {enc.codec} payload "
                                            f"({type(e).__name__}: {e})"[:500]) from None
    if not torch.isfinite(tensor).all():
        raise ProtocolError(pb.BAD_REQUEST, f"{what}: contains NaN or Inf")
    return tensor


_NARROW = (torch.uint8, torch.int32)
"""RAW_DTYPES' integer dtypes narrower than int64, narrowest first."""


def narrow_integers(tensor: torch.Tensor) -> torch.Tensor:
    """An integer tensor in the narrowest raw dtype that holds its values (anything else as is).

    Targets of a byte-level model travel as uint8: 1 byte per position instead of int64's 8, which
    with the demo's boundary codecs was 15 % of a request's bytes. The receiver widens them back
    (`validate_forward`), so nothing but the wire changes."""
    if tensor.is_floating_point() or tensor.dtype in (torch.uint8, torch.bool) or not tensor.numel():
        return tensor
    low, high = int(tensor.min()), int(tensor.max())
    for dtype in _NARROW:
        if torch.iinfo(dtype).min <= low and high <= torch.iinfo(dtype).max:
            return tensor.to(dtype)
    return tensor


def raw_from_tensor(tensor: torch.Tensor) -> pb.RawTensor:
    tensor = tensor.detach().cpu().contiguous()
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in RAW_DTYPES:
        raise ValueError(f"raw tensors must be one of {sorted(RAW_DTYPES)}, not {name}")
    return pb.RawTensor(dtype=name, shape=list(tensor.shape), data=tensor.numpy().tobytes())


def raw_to_tensor(msg: pb.RawTensor, max_numel: int, what: str = "raw tensor") -> torch.Tensor:
    if msg.dtype not in RAW_DTYPES:
        raise ProtocolError(pb.BAD_REQUEST, f"{what}: dtype {msg.dtype!r} not one of {sorted(RAW_DTYPES)}")
    shape = _check_shape(msg.shape, max_numel, what)
    dtype = RAW_DTYPES[msg.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = math.prod(shape)
    if len(msg.data) != numel * itemsize:
        raise ProtocolError(pb.BAD_REQUEST, f"{what}: {len(msg.data)} bytes for shape {list(shape)} of {msg.dtype}")
    array = np.frombuffer(msg.data, dtype=str(dtype).removeprefix("torch.")).reshape(shape)
    tensor = torch.from_numpy(array.copy())
    if tensor.is_floating_point() and not torch.isfinite(tensor).all():
        raise ProtocolError(pb.BAD_REQUEST, f"{what}: contains NaN or Inf")
    return tensor


@dataclass(frozen=True)
class ForwardInput:
    microbatch_id: int
    attempt: int
    driver: str
    activations: torch.Tensor
    targets: torch.Tensor
    deadline: float
    eval_only: bool
    round: int
    round_ticket: bytes = b""
    """The driver's signature that it is in `round` (empty or ROUND_TICKET_BYTES long; whether it
    verifies is the stage server's check, peer/net/round_tickets.py)."""


@dataclass(frozen=True)
class StageContract:
    """What one stage accepts: boundary specs from the model, limits from the manifest."""
    stage: int
    n_stages: int
    max_batch: int
    input_spec: Spec
    targets_spec: Spec
    vocab_size: int | None = None
    """If set, integer targets must lie in [0, vocab_size)."""


def validate_forward(req: pb.ForwardRequest, identity: RunIdentity, contract: StageContract,
                     max_numel: int, *, allowed_codecs: Codecs = None) -> ForwardInput:
    """`allowed_codecs`: names for pipeline.activation_codec (protocol.codecs.wire_codec_names)."""
    check_envelope(req.envelope, identity, [contract.stage])
    if contract.stage == 0:
        raise ProtocolError(pb.WRONG_STAGE, "stage 0 is driven locally and takes no forward requests")
    if not req.HasField("activations") or not req.HasField("targets"):
        raise ProtocolError(pb.BAD_REQUEST, "forward request needs activations and targets")
    if not req.driver:
        raise ProtocolError(pb.BAD_REQUEST, "forward request names no driver")
    if len(req.driver) > MAX_ID_CHARS:
        raise ProtocolError(pb.BAD_REQUEST, f"driver id longer than {MAX_ID_CHARS} characters")
    if req.round > MAX_ROUND:
        raise ProtocolError(pb.BAD_REQUEST, f"round {req.round} exceeds {MAX_ROUND}")
    if len(req.round_ticket) not in (0, ROUND_TICKET_BYTES):
        raise ProtocolError(pb.BAD_REQUEST, f"a round ticket is a {ROUND_TICKET_BYTES}-byte signature "
                                            f"(got {len(req.round_ticket)} bytes)")
    shape = tuple(req.activations.shape)
    batch = shape[0] if shape else 0
    if not 1 <= batch <= contract.max_batch:
        raise ProtocolError(pb.BAD_REQUEST, f"batch of {batch} outside 1..{contract.max_batch} (inner.microbatch_size)")
    expected_shape, _ = contract.input_spec(batch)
    activations = decode_tensor(req.activations, max_numel, "activations", expected_shape,
                                allowed_codecs=allowed_codecs)
    targets = raw_to_tensor(req.targets, max_numel, "targets")
    t_shape, t_dtype = contract.targets_spec(batch)
    if _widens(targets.dtype, t_dtype):  # sent narrowed (narrow_integers): values are what count
        targets = targets.to(t_dtype)
    if tuple(targets.shape) != tuple(t_shape) or targets.dtype != t_dtype:
        raise ProtocolError(pb.BAD_REQUEST, f"targets: {list(targets.shape)} {targets.dtype} but expected "
                                            f"{list(t_shape)} {t_dtype}")
    if contract.vocab_size is not None and targets.numel() and not targets.is_floating_point():
        if int(targets.min()) < 0 or int(targets.max()) >= contract.vocab_size:
            raise ProtocolError(pb.BAD_REQUEST, f"targets outside [0, {contract.vocab_size})")
    if not math.isfinite(req.deadline):
        raise ProtocolError(pb.BAD_REQUEST, "deadline is not a finite time")
    return ForwardInput(microbatch_id=req.microbatch_id, attempt=req.attempt, driver=req.driver,
                        activations=activations, targets=targets, deadline=req.deadline, eval_only=req.eval_only,
                        round=req.round, round_ticket=bytes(req.round_ticket))


def _widens(sent: torch.dtype, expected: torch.dtype) -> bool:
    """An integer dtype that `expected`, a wider integer dtype, holds every value of."""
    if sent == expected or sent.is_floating_point or expected.is_floating_point or expected == torch.bool:
        return False
    return torch.iinfo(sent).min >= torch.iinfo(expected).min and torch.iinfo(sent).max <= torch.iinfo(expected).max


def decode_named(tensors: Sequence[pb.NamedTensor], expected: dict[str, tuple[int, ...]], max_numel: int,
                 what: str, *, allowed_codecs: Codecs = None) -> dict[str, torch.Tensor]:
    """Decode named tensors that must be exactly the `expected` names and shapes."""
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise ProtocolError(pb.BAD_REQUEST, f"{what}: duplicate tensor names")
    if set(names) != set(expected):
        missing, extra = sorted(set(expected) - set(names)), sorted(set(names) - set(expected))
        extra = [n[:64] for n in extra[:3]]
        raise ProtocolError(pb.BAD_REQUEST, f"{what}: tensors do not match (missing {missing[:3]}, unexpected {extra})")
    return {t.name: decode_tensor(t.tensor, max_numel, f"{what} {t.name}", expected[t.name],
                                  allowed_codecs=allowed_codecs) for t in tensors}


@dataclass(frozen=True)
class AverageInput:
    round: int
    group_hash: str
    state_digest: str
    weight: float
    part: int
    tensors: dict[str, torch.Tensor]


def validate_average(req: pb.AverageRequest, identity: RunIdentity, stage: int,
                     part_shapes: Callable[[int], dict[str, tuple[int, ...]] | None], max_numel: int, *,
                     allowed_codecs: Codecs = None, max_weight: float = math.inf) -> AverageInput:
    """`part_shapes(part)` gives the names and shapes this reducer expects for a part (None: not ours).

    `allowed_codecs`: protocol.codecs.averaging_codecs(...); `max_weight`: the most samples one
    member can have trained on in a round (protocol.records.MAX_WEIGHT is a generous default)."""
    check_envelope(req.envelope, identity, [stage])
    if not (math.isfinite(req.weight) and 0 <= req.weight <= max_weight):
        raise ProtocolError(pb.BAD_REQUEST, f"weight must be finite and in [0, {max_weight}] (got {req.weight})")
    if not req.group_hash or not req.state_digest:
        raise ProtocolError(pb.BAD_REQUEST, "average request needs group_hash and state_digest")
    if len(req.group_hash) > MAX_ID_CHARS or len(req.state_digest) > MAX_ID_CHARS:
        raise ProtocolError(pb.BAD_REQUEST, f"group_hash and state_digest are at most {MAX_ID_CHARS} characters")
    if req.round > MAX_ROUND:
        raise ProtocolError(pb.BAD_REQUEST, f"round {req.round} exceeds {MAX_ROUND}")
    if len(req.signature) not in (0, PART_SIGNATURE_BYTES):
        raise ProtocolError(pb.BAD_REQUEST, f"a part's signature is {PART_SIGNATURE_BYTES} bytes or absent "
                                            f"(got {len(req.signature)} bytes)")
    expected = part_shapes(req.part)
    if expected is None:
        raise ProtocolError(pb.GROUP_MISMATCH, f"part {req.part} is not reduced by this peer")
    tensors = decode_named(req.tensors, expected, max_numel, f"part {req.part}", allowed_codecs=allowed_codecs)
    return AverageInput(round=req.round, group_hash=req.group_hash, state_digest=req.state_digest,
                        weight=req.weight, part=req.part, tensors=tensors)


MAX_COMMITS = 1024
"""Microbatches one commit request may name (a driver has a handful in flight)."""


def validate_commit(req: pb.CommitRequest, identity: RunIdentity, stage: int, caller: str
                    ) -> list[tuple[str, int, int]]:
    """The (driver, microbatch id, attempt) keys a commit names. The driver is the caller itself:
    nobody commits another driver's microbatches."""
    check_envelope(req.envelope, identity, [stage])
    if len(req.microbatch_ids) != len(req.attempts):
        raise ProtocolError(pb.BAD_REQUEST, "commit: microbatch_ids and attempts differ in length")
    if len(req.microbatch_ids) > MAX_COMMITS:
        raise ProtocolError(pb.BAD_REQUEST, f"commit names more than {MAX_COMMITS} microbatches")
    return [(caller, int(mb), int(a)) for mb, a in zip(req.microbatch_ids, req.attempts)]


_HEX = frozenset("0123456789abcdef")


def validate_tokenizer_request(req: pb.TokenizerRequest, identity: RunIdentity, sha256: str, size: int) -> int:
    """The offset a request for this run's tokenizer file asks from (peer/public/tokenizer_share.py).
    The caller must name the run, its manifest and the file's digest, `sha256` (a caller that expects
    other bytes is told so rather than sent these)."""
    check_envelope(req.envelope, identity, [0])
    if len(req.sha256) != 64 or not set(req.sha256) <= _HEX:
        raise ProtocolError(pb.BAD_REQUEST, "tokenizer request: sha256 must be 64 lowercase hex digits")
    if req.sha256 != sha256:
        raise ProtocolError(pb.WRONG_RUN, f"tokenizer request for sha256 {req.sha256[:12]}..., this peer's "
                                          f"tokenizer is {sha256[:12]}...")
    if req.offset > size:
        raise ProtocolError(pb.BAD_REQUEST, f"tokenizer request: offset {req.offset} is past the file's {size} bytes")
    return int(req.offset)
