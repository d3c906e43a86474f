"""Validation of every response another peer sends us, like validation.py does for requests.

A response is the other peer's word about work it did for us: its status must be one we know,
every number must be finite and bounded, and every tensor must have the names, shapes and
codecs we expect. A response that fails a check raises ProtocolError(BAD_REQUEST, reason), and
the caller treats it as a failed call (retry elsewhere, ban with backoff). A well-formed refusal
(status other than OK) is returned, typed, for the caller to act on.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch

from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.framing import MAX_REASON_CHARS, ProtocolError, is_known_status
from swarmgrad.protocol.validation import MAX_ID_CHARS, MAX_ROUND, PART_SIGNATURE_BYTES, Codecs, decode_named, decode_tensor

MAX_LOSS = 1e6
"""A mean loss in nats above this is no loss a model of ours reports (ln(vocab) is ~10)."""
MAX_ROUTE_HOPS = 64
"""Peer ids in a forward response's route: at most one per stage, and no run has this many."""
MAX_REPORTED_SECONDS = 3600.0
"""Bound on a forward response's timings (request_s, serve_s): they only feed the driver's estimates."""
MAX_TOTAL_WEIGHT = 1e12
"""Default cap on an averaging response's total weight (samples over the whole group)."""
_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{1,%d}" % MAX_ID_CHARS)  # base58, as libp2p writes ids


def _reason(text: str) -> str:
    return text[:MAX_REASON_CHARS]


def _check_status(status: int, what: str) -> None:
    if not is_known_status(status):
        raise ProtocolError(pb.BAD_REQUEST, f"{what}: unknown status {status}")


def _check_peer_id(value: str, what: str) -> str:
    if value and not _PEER_ID.fullmatch(value):
        raise ProtocolError(pb.BAD_REQUEST, f"{what}: {value[:16]!r}... is not a peer id")
    return value


@dataclass(frozen=True)
class ForwardResult:
    status: int
    reason: str
    """The remote's reason for a refusal, cut to MAX_REASON_CHARS."""
    failed_peer: str = ""
    """DOWNSTREAM_FAILED: the peer that failed; NOT_READY: the busy peer (empty: the replica itself)."""
    route: tuple[str, ...] = ()
    """Peer ids that served the microbatch downstream of the peer we called."""
    loss: float = 0.0
    n_targets: int = 0
    grad: torch.Tensor | None = None
    """Gradient w.r.t. the activations we sent (None for eval_only and for refusals)."""
    request_s: float = 0.0
    """Seconds the remote took to read our request, first frame to last (0: not reported)."""
    serve_s: float = 0.0
    """Seconds from the remote's whole request read to its answer (0: not reported)."""

    @property
    def ok(self) -> bool:
        return self.status == pb.OK


def validate_forward_response(resp: pb.ForwardResponse, expected_grad_shape: tuple[int, ...], eval_only: bool,
                              max_numel: int, allowed_codecs: Codecs = None, *, max_loss: float = MAX_LOSS,
                              max_targets: int | None = None) -> ForwardResult:
    """Check a forward response; returns refusals typed and OK responses decoded.

    Args:
        expected_grad_shape: the shape of the activations we sent (the gradient's shape).
        eval_only: whether we asked for forward only (then no gradient is decoded).
        max_numel: bound on decoded elements.
        allowed_codecs: names for pipeline.gradient_codec (protocol.codecs.wire_codec_names).
        max_loss: a finite loss must lie in [0, max_loss].
        max_targets: bound on n_targets (default max_numel).

    Raises:
        ProtocolError(BAD_REQUEST): unknown status, non-finite or out-of-range loss, too many
            targets, malformed peer ids or route, a missing or malformed gradient.
    """
    _check_status(resp.status, "forward response")
    failed = _check_peer_id(resp.failed_peer, "forward response failed_peer")
    hops = tuple(resp.route.split(",")) if resp.route else ()
    if len(hops) > MAX_ROUTE_HOPS:
        raise ProtocolError(pb.BAD_REQUEST, f"forward response route has more than {MAX_ROUTE_HOPS} hops")
    for hop in hops:
        _check_peer_id(hop or "?", "forward response route")
    if resp.status != pb.OK:
        return ForwardResult(resp.status, _reason(resp.reason), failed_peer=failed, route=hops)
    if not (math.isfinite(resp.loss) and 0.0 <= resp.loss <= max_loss):
        raise ProtocolError(pb.BAD_REQUEST, f"forward response loss {resp.loss} is not in [0, {max_loss}]")
    limit = max_numel if max_targets is None else max_targets
    if resp.n_targets > limit:
        raise ProtocolError(pb.BAD_REQUEST, f"forward response claims {resp.n_targets} targets (at most {limit})")
    grad = None
    if not eval_only:
        if not resp.HasField("grad_input"):
            raise ProtocolError(pb.BAD_REQUEST, "forward response has no grad_input")
        grad = decode_tensor(resp.grad_input, max_numel, "grad_input", tuple(expected_grad_shape),
                             allowed_codecs=allowed_codecs)
    timings = []
    for name in ("request_s", "serve_s"):
        value = getattr(resp, name)
        if not (math.isfinite(value) and 0.0 <= value <= MAX_REPORTED_SECONDS):
            raise ProtocolError(pb.BAD_REQUEST, f"forward response {name} {value} is not in [0, {MAX_REPORTED_SECONDS}]")
        timings.append(float(value))
    return ForwardResult(pb.OK, "", failed_peer=failed, route=hops, loss=float(resp.loss),
                         n_targets=int(resp.n_targets), grad=grad, request_s=timings[0], serve_s=timings[1])


@dataclass(frozen=True)
class AverageResult:
    status: int
    reason: str
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """The decoded weighted mean of the part (empty for refusals)."""
    contributors: tuple[str, ...] = ()
    total_weight: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == pb.OK


def validate_average_response(resp: pb.AverageResponse, expected: Mapping[str, tuple[int, ...]],
                              members: Sequence[str], max_numel: int, allowed_codecs: Codecs = None, *,
                              max_total_weight: float = MAX_TOTAL_WEIGHT, what: str = "mean") -> AverageResult:
    """Check a reducer's answer for one part.

    Args:
        expected: names and shapes of the part's tensors.
        members: the round's group; the contributors must be exactly these peers.
        allowed_codecs: protocol.codecs.averaging_codecs(...).
        max_total_weight: total_weight must be finite and in [0, max_total_weight].

    Raises:
        ProtocolError(BAD_REQUEST): unknown status, contributors other than the group, a bad
            total weight, tensors with other names, shapes or codecs, non-finite values.
    """
    _check_status(resp.status, f"{what} response")
    if resp.status != pb.OK:
        return AverageResult(resp.status, _reason(resp.reason))
    contributors = tuple(resp.contributors)
    if sorted(contributors) != sorted(members) or len(set(contributors)) != len(contributors):
        raise ProtocolError(pb.BAD_REQUEST, f"{what}: averaged over {len(contributors)} contributors that are "
                                            f"not the group of {len(members)}")
    if not (math.isfinite(resp.total_weight) and 0.0 <= resp.total_weight <= max_total_weight):
        raise ProtocolError(pb.BAD_REQUEST, f"{what}: total_weight {resp.total_weight} is not in "
                                            f"[0, {max_total_weight}]")
    tensors = decode_named(resp.tensors, dict(expected), max_numel, what, allowed_codecs=allowed_codecs)
    return AverageResult(pb.OK, "", tensors, contributors, float(resp.total_weight))


@dataclass(frozen=True)
class GatherResult:
    status: int
    reason: str
    others: tuple[tuple[str, float, dict[str, torch.Tensor]], ...] = ()
    """(member, weight, decoded part) of every other member, sorted by member (empty for refusals)."""
    contributors: tuple[str, ...] = ()
    total_weight: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == pb.OK


def validate_gather_response(resp: pb.AverageResponse, expected: Mapping[str, tuple[int, ...]],
                             members: Sequence[str], me: str, max_weights: Mapping[str, float], max_numel: int,
                             allowed_codecs: Codecs = None, *, what: str = "gathered part",
                             with_mean: bool = False) -> GatherResult:
    """Check a reducer's answer in the gather exchange (averaging.gather_up_to): the other members'
    own encoded parts instead of a mean.

    Args:
        expected: names and shapes of the part's tensors.
        members: the round's group; `me` is the caller, whose own part is not sent back.
        max_weights: what each member registered for the round; a contribution may not claim more.
        allowed_codecs: the members' codecs (protocol.codecs.averaging_codecs(..., mean=False)).
        with_mean: the answer also carries a mean in `tensors` (averaging.verify in a group that
            reduces: the parts come so that the caller can check the mean); it is not checked here.

    Raises:
        ProtocolError(BAD_REQUEST): unknown status, contributors other than the group, others that
            are not exactly every other member once in sorted order, a weight that is not finite or
            above the member's registration, a mean in `tensors`, tensors with other names, shapes
            or codecs, non-finite values.
    """
    _check_status(resp.status, f"{what} response")
    if resp.status != pb.OK:
        return GatherResult(resp.status, _reason(resp.reason))
    contributors = tuple(resp.contributors)
    if sorted(contributors) != sorted(members) or len(set(contributors)) != len(contributors):
        raise ProtocolError(pb.BAD_REQUEST, f"{what}: {len(contributors)} contributors that are not the group "
                                            f"of {len(members)}")
    if len(resp.tensors) and not with_mean:
        raise ProtocolError(pb.BAD_REQUEST, f"{what}: a mean in a gather answer")
    wanted = sorted(p for p in members if p != me)
    got = [c.member for c in resp.others]
    if got != wanted:
        raise ProtocolError(pb.BAD_REQUEST, f"{what}: {len(got)} parts that are not every other member's, "
                                            f"sorted")
    others = []
    for c in resp.others:
        if len(c.signature) not in (0, PART_SIGNATURE_BYTES):
            raise ProtocolError(pb.BAD_REQUEST, f"{what}: the signature of {c.member[-8:]}'s part is "
                                                f"{len(c.signature)} bytes (not {PART_SIGNATURE_BYTES})")
        w = c.weight
        if not (math.isfinite(w) and 0.0 <= w <= max_weights.get(c.member, 0.0)):
            raise ProtocolError(pb.BAD_REQUEST, f"{what}: weight {w} of {c.member[-8:]} is not in "
                                                f"[0, its registered {max_weights.get(c.member, 0.0)}]")
        tensors = decode_named(c.tensors, dict(expected), max_numel, f"{what} of {c.member[-8:]}",
                               allowed_codecs=allowed_codecs)
        others.append((c.member, float(w), tensors))
    if not (math.isfinite(resp.total_weight) and 0.0 <= resp.total_weight <= MAX_TOTAL_WEIGHT):
        raise ProtocolError(pb.BAD_REQUEST, f"{what}: total_weight {resp.total_weight} is not in "
                                            f"[0, {MAX_TOTAL_WEIGHT}]")
    return GatherResult(pb.OK, "", tuple(others), contributors, float(resp.total_weight))


@dataclass(frozen=True)
class StateResult:
    status: int
    reason: str
    round: int = 0
    applied_rounds: int = 0
    digest: str = ""
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    momentum: dict[str, torch.Tensor] = field(default_factory=dict)
    """Empty when the replica has no momentum yet."""
    trained_samples: int = 0

    @property
    def ok(self) -> bool:
        return self.status == pb.OK


Digest = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor], int], str]
"""(params, momentum, trained_samples) -> digest: peer.state.state_digest."""
MAX_SAMPLES = 2**50


def validate_state_response(resp: pb.StateResponse, shapes: Mapping[str, tuple[int, ...]], max_numel: int, *,
                            digest_fn: Digest | None, allowed_codecs: Codecs = None) -> StateResult:
    """Check a downloaded state: names and shapes exact, rounds bounded, digest recomputed.

    Args:
        shapes: the stage's parameter names and shapes; params must be exactly these, momentum
            exactly these or empty.
        digest_fn: (params, momentum, trained_samples) -> digest, as the receiver computes it
            (peer.state.state_digest); None for one part of a state fetched in parts (`shapes`
            then names that part), whose digest the caller checks once all parts are in.
        allowed_codecs: default any; state sync sends fp32 (protocol.codecs.FP32_ONLY).

    Raises:
        ProtocolError(BAD_REQUEST): unknown status, round or applied_rounds over MAX_ROUND,
            trained_samples over MAX_SAMPLES, tensors that do not match, a digest that differs from the recomputed one.
    """
    _check_status(resp.status, "state response")
    if resp.status != pb.OK:
        return StateResult(resp.status, _reason(resp.reason))
    for name, value in (("round", resp.round), ("applied_rounds", resp.applied_rounds)):
        if value > MAX_ROUND:
            raise ProtocolError(pb.BAD_REQUEST, f"state response {name} {value} exceeds {MAX_ROUND}")
    if resp.trained_samples > MAX_SAMPLES:
        raise ProtocolError(pb.BAD_REQUEST, f"state response trained_samples {resp.trained_samples} exceeds {MAX_SAMPLES}")
    if not resp.state_digest or len(resp.state_digest) > MAX_ID_CHARS:
        raise ProtocolError(pb.BAD_REQUEST, f"state response digest must have 1..{MAX_ID_CHARS} characters")
    params = decode_named(resp.params, dict(shapes), max_numel, "state params", allowed_codecs=allowed_codecs)
    momentum = (decode_named(resp.momentum, dict(shapes), max_numel, "state momentum", allowed_codecs=allowed_codecs)
                if len(resp.momentum) else {})
    digest = resp.state_digest if digest_fn is None else digest_fn(params, momentum, int(resp.trained_samples))
    if digest != resp.state_digest:
        raise ProtocolError(pb.BAD_REQUEST, "state does not match its declared digest")
    return StateResult(pb.OK, "", int(resp.round), int(resp.applied_rounds), digest, params, momentum,
                       int(resp.trained_samples))


@dataclass(frozen=True)
class TokenizerChunk:
    status: int
    reason: str
    total_bytes: int = 0
    data: bytes = b""


def validate_tokenizer_chunk(resp: pb.TokenizerResponse, offset: int, max_total: int, max_chunk: int
                             ) -> TokenizerChunk:
    """A chunk of a run's tokenizer file asked from `offset`: it starts there, the file is at most
    `max_total` bytes, the chunk at most `max_chunk` and not past the file's end, and it is empty only
    at the end. Whether the bytes are the right ones is the caller's check (the signed sha256)."""
    _check_status(resp.status, "tokenizer response")
    if resp.status != pb.OK:
        return TokenizerChunk(resp.status, _reason(resp.reason))
    if resp.offset != offset:
        raise ProtocolError(pb.BAD_REQUEST, f"tokenizer response starts at byte {resp.offset}, asked {offset}")
    if resp.total_bytes > max_total:
        raise ProtocolError(pb.BAD_REQUEST, f"tokenizer response: a file of {resp.total_bytes} bytes "
                                            f"(at most {max_total} accepted)")
    n = len(resp.data)
    if n > max_chunk or offset + n > resp.total_bytes or (n == 0 and offset < resp.total_bytes):
        raise ProtocolError(pb.BAD_REQUEST, f"tokenizer response: {n} bytes at {offset} of a file of "
                                            f"{resp.total_bytes} (chunks of 1..{max_chunk} bytes)")
    return TokenizerChunk(pb.OK, "", int(resp.total_bytes), bytes(resp.data))
