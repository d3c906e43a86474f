"""Signed parts (manifest averaging.verify): what lets every member check what a reducer did.

Member j of a round's group reduces part j: it answers every member with the aggregate of
everyone's contribution to that part. Nothing showed that the mean it returns is the aggregate of
the parts it received, so one member of a group could write any finite values into its part of
every replica's state (robust aggregation guards the contributions, not the reducer). With
averaging.verify every member signs each part it sends, and the reducer forwards the signed parts
with its answer (gather's `others`), so every member can recompute the aggregate with the same
deterministic code and refuse a mean that differs, or a part whose signature is not its member's
(peer/averaging/averager.py; docs/trust.md, "Reducers").

A signature is the sender's Ed25519 key (the one its peer id embeds) over (run id, manifest hash,
stage, round, group hash, part, weight, sha256 of the encoded tensors) under DOMAIN: a reducer
cannot move a part to another round, group, part or stage, change the weight it was sent with, or
change a byte of it. A member signs one part per (round, group, part), so a reducer has no second
signed part of a member to choose from.

Pure crypto over bytes; no network.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Sequence

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarmgrad.peer.net.identity import public_key_of
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.validation import PART_SIGNATURE_BYTES as SIGNATURE_BYTES

DOMAIN = b"swarmgrad/average-part/v1\x00"
"""Prefix of every signed part, so these signatures mean nothing in another protocol (DHT records
and round tickets sign under their own tags)."""


def tensors_digest(tensors: Sequence[pb.NamedTensor]) -> bytes:
    """sha256 of a part's encoded tensors, field by field (not protobuf's serialization, which is
    not promised to be canonical): what the sender encoded is what every member decodes."""
    h = hashlib.sha256()
    for named in tensors:
        t = named.tensor
        header = msgpack.packb([named.name, t.codec, list(t.shape), t.dtype, t.params_json, len(t.buffers)],
                               use_bin_type=True)
        h.update(struct.pack(">Q", len(header)))
        h.update(header)
        for buf in t.buffers:
            h.update(struct.pack(">Q", len(buf)))
            h.update(buf)
    return h.digest()


def part_message(run_id: str, manifest_hash: str, stage: int, round_no: int, group_hash: str, part: int,
                 weight: float, tensors: Sequence[pb.NamedTensor]) -> bytes:
    """What a part's signature covers."""
    return DOMAIN + msgpack.packb([run_id, manifest_hash, int(stage), int(round_no), group_hash, int(part),
                                   float(weight), tensors_digest(tensors)], use_bin_type=True)


def sign_part(key: Ed25519PrivateKey, run_id: str, manifest_hash: str, stage: int, round_no: int, group_hash: str,
              part: int, weight: float, tensors: Sequence[pb.NamedTensor]) -> bytes:
    return key.sign(part_message(run_id, manifest_hash, stage, round_no, group_hash, part, weight, tensors))


def part_refusal(member: str, signature: bytes, run_id: str, manifest_hash: str, stage: int, round_no: int,
                 group_hash: str, part: int, weight: float, tensors: Sequence[pb.NamedTensor]) -> str | None:
    """Why `signature` does not show that `member` sent this part (None: it does). Never raises."""
    if not signature:
        return f"the part of {member[-8:]} is not signed"
    if len(signature) != SIGNATURE_BYTES:
        return f"the part of {member[-8:]} has a signature of {len(signature)} bytes (not {SIGNATURE_BYTES})"
    try:
        key = public_key_of(member)
    except ValueError:
        return f"{member[-8:]} is not an Ed25519 peer id"
    try:
        key.verify(signature, part_message(run_id, manifest_hash, stage, round_no, group_hash, part, weight, tensors))
    except InvalidSignature:
        return f"the part of {member[-8:]} carries a signature that is not its own for this round, group and part"
    return None
