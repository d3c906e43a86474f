"""DHT records that only their subject can write: every value is signed by the peer named in its subkey.

hivemind lets anyone store anything under any key and subkey. Without this validator a stranger
could announce a stage record for another peer id, register another member for a round, post
its cross-check digest, or move the run's epoch. With it (`DHT(record_validators=[...])`, the same
on every peer of a swarm), a record is accepted, stored, forwarded and returned only if:

- its subkey is a peer id string in canonical form whose peer id is an Ed25519 key (`12D3KooW...`:
  the id embeds the public key, `identity.public_key_of`);
- its value ends in our envelope, `MAGIC || Ed25519 signature` (72 bytes), and the signature by
  that key verifies over (DHT key id, subkey bytes, value bytes, expiration time) under a
  domain tag. So a record cannot be replayed under another key (another stage, round), for
  another peer, with another value, or with a later expiry;
- its expiration time is finite and at most now + `max_ttl` + `clock_skew`, so nobody pins a
  value in other peers' storage. Per-kind lifetimes (a stage record lives 2 x announce_ttl at
  most) are the reader's check, in `swarm.SwarmView`, because the validator cannot tell kinds
  apart (below).

Why every key, not only the run's prefix: hivemind hands validators the key's DHTID (a SHA-1 of
the serialized key), never the key itself, so a validator cannot recognise a prefix; a schema
validator only works for a fixed list of keys, and round keys are unbounded. A swarmgrad DHT
therefore holds signed subkey records only; a plain (subkey-less) value is refused everywhere.

Where it runs (hivemind 1.1.12, read in dht/node.py and dht/protocol.py): `sign_value` when our
node stores (then our own node validates the signed record before keeping a local copy);
`validate` on every store request another node sends us (a whole replicated dictionary is
refused if one entry fails) and on every value another node returns to a get (that node's
whole answer is dropped if one entry fails); `strip_value` before a get hands the value to the
application. Records that fail never reach peer code.

Pure crypto and msgpack; tested without a network (tests/test_record_signing.py).
"""
from __future__ import annotations

import logging
import math
from typing import Callable

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarmgrad.peer.net.identity import PEER_ID_CHARS, peer_id_of, public_key_of

logger = logging.getLogger(__name__)

MAGIC = b"\xffsgsig1"
"""Marks a signed value: value || MAGIC || 64-byte signature."""
SIGNATURE_BYTES = 64
ENVELOPE_BYTES = len(MAGIC) + SIGNATURE_BYTES
DOMAIN = b"swarmgrad/dht-record/v1\x00"
"""Prefix of every signed message, so these signatures mean nothing in another protocol."""
MAX_RECORD_TTL = 600.0
"""The longest lifetime (s) a writer may give any record. Writers clamp to it (SwarmView)."""
MAX_CLOCK_SKEW = 60.0
"""How far (s) a writer's clock may run ahead of ours before its expiries look too late."""
_MAX_SUBKEY_BYTES = PEER_ID_CHARS + 2  # msgpack str8 header + the id


def signed_message(record: DHTRecord) -> bytes:
    """What a signature covers: the key id, subkey bytes, value bytes (without the envelope) and
    expiration time (a float64), under DOMAIN."""
    return DOMAIN + msgpack.packb([record.key, record.subkey, record.value, float(record.expiration_time)],
                                  use_bin_type=True)


def split_envelope(value: bytes) -> tuple[bytes, bytes] | None:
    """(value, signature) of a signed value, or None if it carries no envelope."""
    if len(value) < ENVELOPE_BYTES or value[-ENVELOPE_BYTES:-SIGNATURE_BYTES] != MAGIC:
        return None
    return value[:-ENVELOPE_BYTES], value[-SIGNATURE_BYTES:]


def subkey_bytes(peer_id: str) -> bytes:
    """A subkey as hivemind serializes it on the wire (DHTProtocol.serializer)."""
    return MSGPackSerializer.dumps(peer_id)


class SignedRecordValidator(RecordValidatorBase):
    """Signs this peer's records and accepts only records signed by the peer in their subkey.

    `private_key`: this peer's libp2p identity key (the one p2pd runs with), or None for a
    read-only client (`swarmgrad status`), which verifies and strips but signs nothing.
    `validate` never raises: any malformed input is a refusal, logged at DEBUG with its reason.
    """

    def __init__(self, private_key: Ed25519PrivateKey | None = None, *, max_ttl: float = MAX_RECORD_TTL,
                 clock_skew: float = MAX_CLOCK_SKEW, clock: Callable[[], float] = get_dht_time):
        if not (0 < max_ttl < math.inf and 0 <= clock_skew < math.inf):
            raise ValueError(f"max_ttl must be finite and > 0, clock_skew finite and >= 0 "
                             f"(got {max_ttl}, {clock_skew})")
        self._private_key = private_key
        self.max_ttl = max_ttl
        self.clock_skew = clock_skew
        self._clock = clock
        self.peer_id = peer_id_of(private_key) if private_key is not None else None
        self._own_subkey = subkey_bytes(self.peer_id) if self.peer_id is not None else None

    def refusal(self, record: DHTRecord) -> str | None:
        """Why `record` is refused, or None if it is valid. Never raises: it runs inside
        hivemind's DHT handlers, where an exception would fail a whole request. A record the
        checks below did not foresee is refused, and the exception logged with its traceback:
        it is a bug here, not the stranger's bytes (those are refusals)."""
        try:
            return self._refusal(record)
        except Exception as e:  # a bug of ours must not let a record through, nor be quiet
            logger.exception("the record validator failed on a record (refused)")
            return f"malformed record ({type(e).__name__})"

    def _refusal(self, record: DHTRecord) -> str | None:
        if not (isinstance(record.subkey, bytes) and isinstance(record.value, bytes)
                and isinstance(record.key, bytes)):
            return "key, subkey and value must be bytes"
        if not 0 < len(record.subkey) <= _MAX_SUBKEY_BYTES:
            return "the subkey must be a peer id (plain values without a subkey are not accepted)"
        try:
            subkey = msgpack.unpackb(record.subkey, raw=False)
        except ValueError as e:  # msgpack's ExtraData, FormatError, bad UTF-8...: not msgpack of a str
            return f"the subkey is not msgpack ({type(e).__name__})"
        if not isinstance(subkey, str) or subkey_bytes(subkey) != record.subkey:
            return "the subkey must be a peer id string in canonical msgpack"
        try:
            public_key = public_key_of(subkey)
        except ValueError as e:
            return f"the subkey must be an Ed25519 peer id: {e}"
        expiration = record.expiration_time
        if not isinstance(expiration, (int, float)) or not math.isfinite(expiration):
            return "the expiration time must be a finite number"
        if expiration > self._clock() + self.max_ttl + self.clock_skew:
            return f"expires more than {self.max_ttl:.0f}s (+{self.clock_skew:.0f}s skew) from now"
        parts = split_envelope(record.value)
        if parts is None:
            return "the value is not signed"
        value, signature = parts
        try:
            public_key.verify(signature, signed_message(DHTRecord(record.key, record.subkey, value, expiration)))
        except InvalidSignature:
            return f"the signature is not {subkey[:16]}...'s"
        return None

    def validate(self, record: DHTRecord) -> bool:
        reason = self.refusal(record)
        if reason is not None:
            logger.debug("refused a DHT record: %s", reason)
        return reason is None

    def sign_value(self, record: DHTRecord) -> bytes:
        """Our own records (subkey = our peer id) get the envelope; any other record is left as it
        is and will fail validation, here and on every other peer (the store returns False)."""
        if self._private_key is None or record.subkey != self._own_subkey:
            return record.value
        signature = self._private_key.sign(signed_message(record))
        return record.value + MAGIC + signature

    def strip_value(self, record: DHTRecord) -> bytes:
        parts = split_envelope(record.value)
        return record.value if parts is None else parts[0]

    @property
    def priority(self) -> int:
        # validated first and stripped first, before any validator that parses values
        return 20

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        if self._private_key is not None:  # cryptography's keys do not pickle; their raw seed does
            from cryptography.hazmat.primitives import serialization
            state["_private_key"] = self._private_key.private_bytes(
                serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())
        return state

    def __setstate__(self, state: dict) -> None:
        if isinstance(state.get("_private_key"), bytes):
            state["_private_key"] = Ed25519PrivateKey.from_private_bytes(state["_private_key"])
        self.__dict__.update(state)
