"""What the coordinator of a private run signs, and how a peer checks it: certificates,
invitations, revocation lists, the manifest, revoke orders. Pure functions over bytes and keys.

The coordinator key is an Ed25519 libp2p key (peer/net/identity.py), so the coordinator's peer id
*is* its public key: an invitation names it, and a peer checks every signature against it
without ever trusting the coordinator's replies about who it is. Each signature covers a
domain string naming the message type, so a signature made for one kind of message can never be
presented as another (a certificate as a revocation list, say).

A certificate binds a libp2p peer id to the run for a while (`certificate_ttl`); the peer renews
it at half-life. Revocation is a signed list with a version that only grows: a peer keeps the
highest version it has seen, so an old list replayed by anyone changes nothing.
"""
from __future__ import annotations

import base64
import os
import struct
import time
from dataclasses import dataclass
from typing import Iterable

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from google.protobuf.message import DecodeError, Message

from swarmgrad.peer.net.identity import is_peer_id, peer_id_of, public_key_of
from swarmgrad.protocol import coordinator_pb2 as cpb

CERTIFICATE = b"swarmgrad-certificate-v1"
INVITATION = b"swarmgrad-invitation-v1"
REVOCATIONS = b"swarmgrad-revocations-v1"
MANIFEST = b"swarmgrad-manifest-v1"
REVOKE = b"swarmgrad-revoke-v1"
ADMIT_PROOF = b"swarmgrad-admit-v1"
RENEW_PROOF = b"swarmgrad-renew-v1"
CHECKPOINT_PROOF = b"swarmgrad-checkpoint-v1"
CHECKPOINT_INFO = b"swarmgrad-checkpoint-info-v1"

INVITE_PREFIX = "swarmgrad-invite:"
ROLES = ("peer", "coordinator")
MAX_SIGNED_BYTES = 1 << 20
"""A signed blob larger than this is refused before it is parsed (a manifest is a few kB)."""
MAX_REVOKED = 100_000
CLOCK_SKEW = 120.0
"""Seconds a signed request's time may differ from the receiver's clock."""


class CredentialError(ValueError):
    """A credential that does not verify: the message says why (for logs and refusals)."""


def sign(key: Ed25519PrivateKey, domain: bytes, body: Message) -> cpb.Signed:
    data = body.SerializeToString(deterministic=True)
    return cpb.Signed(body=data, signature=key.sign(domain + data))


def _verify(public: Ed25519PublicKey, domain: bytes, signed: cpb.Signed, body_type: type[Message], what: str):
    if not isinstance(signed, cpb.Signed) or len(signed.body) > MAX_SIGNED_BYTES or len(signed.signature) != 64:
        raise CredentialError(f"{what}: not a signed message of a usable size")
    try:
        public.verify(signed.signature, domain + signed.body)
    except InvalidSignature:
        raise CredentialError(f"{what}: the signature is not the coordinator's") from None
    body = body_type()
    try:
        body.ParseFromString(signed.body)
    except DecodeError:
        raise CredentialError(f"{what}: the signed body does not parse") from None
    return body


def proof_message(domain: bytes, *parts: bytes | str | float | int) -> bytes:
    """The bytes a peer signs to prove it holds its key: the domain and the parts, each length-
    prefixed so that no two different lists of parts give the same bytes."""
    out = [domain]
    for part in parts:
        if isinstance(part, str):
            part = part.encode()
        elif isinstance(part, float):
            part = struct.pack(">d", part)
        elif isinstance(part, int):
            part = struct.pack(">q", part)
        out.append(struct.pack(">I", len(part)) + part)
    return b"".join(out)


def check_proof(peer_id: str, proof: bytes, message: bytes, what: str) -> None:
    """`proof` must be peer_id's Ed25519 signature over `message`."""
    try:
        public_key_of(peer_id).verify(proof, message)
    except ValueError:
        raise CredentialError(f"{what}: {peer_id[:16]!r} is not an Ed25519 peer id") from None
    except InvalidSignature:
        raise CredentialError(f"{what}: the proof is not signed by the peer's key") from None


@dataclass(frozen=True)
class Certificate:
    """A checked certificate: who (peer_id), in what role, until when."""
    peer_id: str
    role: str
    stage: int | None
    issued_at: float
    expires_at: float
    serial: int
    dht_public_key: bytes
    signed: cpb.Signed

    def remaining(self, now: float | None = None) -> float:
        return self.expires_at - (time.time() if now is None else now)


@dataclass(frozen=True)
class Invitation:
    run_id: str
    coordinator: str
    coordinator_id: str
    secret: bytes
    expires_at: float
    stage: int | None
    signed: cpb.Signed

    def encode(self) -> str:
        return INVITE_PREFIX + base64.urlsafe_b64encode(self.signed.SerializeToString()).decode().rstrip("=")


@dataclass(frozen=True)
class Revocations:
    version: int
    issued_at: float
    peer_ids: frozenset[str]
    signed: cpb.Signed


class Authority:
    """Checks what the coordinator of one run signed. Built from the coordinator's peer id (from
    an invitation, or the coordinator's own key) and the run id."""

    def __init__(self, coordinator_id: str, run_id: str):
        try:
            self.public = public_key_of(coordinator_id)
        except ValueError:
            raise CredentialError(f"coordinator id {coordinator_id[:20]!r} is not an Ed25519 peer id") from None
        self.coordinator_id = coordinator_id
        self.run_id = run_id

    def certificate(self, signed: cpb.Signed, *, peer_id: str | None = None, now: float | None = None) -> Certificate:
        """The certificate in `signed`, checked: signed by the coordinator, for this run, not
        expired, and (if given) for `peer_id`. Raises CredentialError."""
        body = _verify(self.public, CERTIFICATE, signed, cpb.CertificateBody, "certificate")
        now = time.time() if now is None else now
        if body.run_id != self.run_id:
            raise CredentialError(f"certificate is for run {body.run_id[:40]!r}, not {self.run_id!r}")
        if body.role not in ROLES or not is_peer_id(body.peer_id):
            raise CredentialError("certificate names no valid role or peer id")
        if peer_id is not None and body.peer_id != peer_id:
            raise CredentialError(f"certificate is for {body.peer_id[-8:]}, not {peer_id[-8:]}")
        if not body.expires_at > now:
            raise CredentialError(f"certificate of {body.peer_id[-8:]} expired {now - body.expires_at:.0f}s ago")
        return Certificate(peer_id=body.peer_id, role=body.role, stage=None if body.stage < 0 else body.stage,
                           issued_at=body.issued_at, expires_at=body.expires_at, serial=body.serial,
                           dht_public_key=body.dht_public_key, signed=signed)

    def invitation(self, signed: cpb.Signed, *, now: float | None = None) -> Invitation:
        body = _verify(self.public, INVITATION, signed, cpb.InvitationBody, "invitation")
        now = time.time() if now is None else now
        if body.run_id != self.run_id:
            raise CredentialError(f"invitation is for run {body.run_id[:40]!r}, not {self.run_id!r}")
        if body.coordinator_id != self.coordinator_id:
            raise CredentialError("invitation names another coordinator")
        if len(body.secret) != 16:
            raise CredentialError("invitation has no valid secret")
        if not body.expires_at > now:
            raise CredentialError("invitation expired")
        return Invitation(run_id=body.run_id, coordinator=body.coordinator, coordinator_id=body.coordinator_id,
                          secret=body.secret, expires_at=body.expires_at,
                          stage=None if body.stage < 0 else body.stage, signed=signed)

    def revocations(self, signed: cpb.Signed) -> Revocations:
        body = _verify(self.public, REVOCATIONS, signed, cpb.RevocationsBody, "revocation list")
        if body.run_id != self.run_id:
            raise CredentialError("revocation list is for another run")
        if len(body.peer_ids) > MAX_REVOKED:
            raise CredentialError("revocation list too long")
        return Revocations(version=body.version, issued_at=body.issued_at, peer_ids=frozenset(body.peer_ids),
                           signed=signed)

    def manifest(self, signed: cpb.Signed) -> cpb.ManifestBody:
        """The manifest text the coordinator signed for this run (the caller parses and checks its
        hash: peer/manifest.py)."""
        body = _verify(self.public, MANIFEST, signed, cpb.ManifestBody, "manifest")
        if body.run_id != self.run_id:
            raise CredentialError(f"manifest is for run {body.run_id[:40]!r}, not {self.run_id!r}")
        return body

    def checkpoint(self, signed: cpb.Signed) -> cpb.CheckpointInfo:
        """What the coordinator says of a checkpoint it serves (stage, round, the file's sha256),
        checked to be signed by its key for this run: the bytes that follow on the same stream are
        believed only if they hash to this digest."""
        body = _verify(self.public, CHECKPOINT_INFO, signed, cpb.CheckpointBody, "checkpoint")
        if body.run_id != self.run_id:
            raise CredentialError(f"checkpoint is of run {body.run_id[:40]!r}, not {self.run_id!r}")
        return body.info

    def revoke_order(self, signed: cpb.Signed, *, now: float | None = None) -> str:
        """The peer id a `swarmgrad revoke` order names, checked (signed, this run, recent)."""
        body = _verify(self.public, REVOKE, signed, cpb.RevokeBody, "revoke order")
        now = time.time() if now is None else now
        if body.run_id != self.run_id:
            raise CredentialError("revoke order is for another run")
        if abs(body.issued_at - now) > CLOCK_SKEW:
            raise CredentialError("revoke order is not recent (check the clocks)")
        if not is_peer_id(body.peer_id):
            raise CredentialError("revoke order names no valid peer id")
        return body.peer_id


class Issuer:
    """The coordinator's side: signs certificates, invitations, revocation lists, the manifest."""

    def __init__(self, key: Ed25519PrivateKey, run_id: str):
        self.key = key
        self.run_id = run_id
        self.coordinator_id = peer_id_of(key)
        self.authority = Authority(self.coordinator_id, run_id)

    def certificate(self, peer_id: str, *, role: str = "peer", stage: int | None = None, ttl: float,
                    serial: int, dht_public_key: bytes = b"", now: float | None = None) -> cpb.Signed:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}")
        now = time.time() if now is None else now
        return sign(self.key, CERTIFICATE, cpb.CertificateBody(
            run_id=self.run_id, peer_id=peer_id, role=role, stage=-1 if stage is None else stage, issued_at=now,
            expires_at=now + ttl, serial=serial, dht_public_key=dht_public_key))

    def revocations(self, peer_ids: Iterable[str], version: int, now: float | None = None) -> cpb.Signed:
        return sign(self.key, REVOCATIONS, cpb.RevocationsBody(
            run_id=self.run_id, version=version, issued_at=time.time() if now is None else now,
            peer_ids=sorted(peer_ids)))

    def manifest(self, toml_text: str, manifest_hash: str) -> cpb.Signed:
        return sign(self.key, MANIFEST, cpb.ManifestBody(run_id=self.run_id, manifest_toml=toml_text,
                                                         manifest_hash=manifest_hash))

    def checkpoint(self, info: cpb.CheckpointInfo) -> cpb.Signed:
        return sign(self.key, CHECKPOINT_INFO, cpb.CheckpointBody(run_id=self.run_id, info=info))


def make_invitation(key: Ed25519PrivateKey, run_id: str, coordinator: str, *, expires_in: float,
                    stage: int | None = None, now: float | None = None) -> Invitation:
    """A new single-use invitation (`swarmgrad invite`): needs only the key, not the coordinator's
    state; the coordinator refuses a secret it has seen before."""
    now = time.time() if now is None else now
    body = cpb.InvitationBody(run_id=run_id, coordinator=coordinator, coordinator_id=peer_id_of(key),
                              secret=os.urandom(16), expires_at=now + expires_in, stage=-1 if stage is None else stage)
    signed = sign(key, INVITATION, body)
    return Authority(peer_id_of(key), run_id).invitation(signed, now=now)


def revoke_order(key: Ed25519PrivateKey, run_id: str, peer_id: str, now: float | None = None) -> cpb.Signed:
    return sign(key, REVOKE, cpb.RevokeBody(run_id=run_id, peer_id=peer_id,
                                            issued_at=time.time() if now is None else now))


def parse_invitation(text: str, *, now: float | None = None) -> Invitation:
    """An invitation string as `swarmgrad invite` prints it, checked against the coordinator id and
    run id it names itself (the peer trusts the invitation's sender for those; everything later
    is checked against them). Raises CredentialError."""
    text = text.strip()
    if not text.startswith(INVITE_PREFIX) or len(text) > 4096:
        raise CredentialError(f"an invitation starts with {INVITE_PREFIX!r}")
    raw = text[len(INVITE_PREFIX):]
    try:
        data = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4))
        signed = cpb.Signed.FromString(data)
        body = cpb.InvitationBody.FromString(signed.body)
    except (ValueError, DecodeError):
        raise CredentialError("the invitation is damaged (copy it whole)") from None
    return Authority(body.coordinator_id, body.run_id).invitation(signed, now=now)


def parse_duration(text: str) -> float:
    """'7d', '12h', '30m', '45s', '3600' -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
    t = text.strip().lower()
    unit = units.get(t[-1:], None)
    try:
        value = float(t[:-1] if unit else t)
    except ValueError:
        raise ValueError(f"{text!r} is not a duration like 7d, 12h or 30m") from None
    if not 0 < value < float("inf"):
        raise ValueError(f"a duration must be > 0 (got {text!r})")
    return value * (unit or 1)
