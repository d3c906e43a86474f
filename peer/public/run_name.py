"""The name of a public run: `NAME@FINGERPRINT`, where NAME is the manifest's `run_id` and
FINGERPRINT names the owner's Ed25519 key.

Why a fingerprint and not the owner's peer id: a peer id is 52 characters, which nobody types.
The fingerprint is the first 80 bits of sha256(raw public key) in lowercase base32 (16
characters): to squat `NAME@FINGERPRINT` a stranger would need a key with the same 80 bits (a
second preimage, about 2^80 hashes), so the pair names one owner. The fingerprint cannot be turned
back into a key, so a signed manifest carries the owner's peer id (the public key) and a reader
checks that it hashes to the fingerprint (signed_manifest.verify).

The full name is also the run id the peers of a public run use for every DHT key and RPC
namespace (`{NAME@FINGERPRINT}/stage/{s}`...), so two runs of one NAME under different keys never
see each other's records. Pure; no network.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from swarmgrad.peer.net.identity import FINGERPRINT_BYTES  # noqa: F401  (also read from here)
from swarmgrad.peer.net.identity import fingerprint as identity_fingerprint

FINGERPRINT_CHARS = 16
"""base32 of 10 bytes, unpadded."""
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # a manifest's run_id (peer/manifest.py)
_FINGERPRINT = re.compile(rf"^[a-z2-7]{{{FINGERPRINT_CHARS}}}$")


def fingerprint(key: Ed25519PrivateKey | Ed25519PublicKey | str) -> str:
    """The fingerprint of an Ed25519 key, or of the key a peer id embeds (identity.fingerprint:
    net's vouchers check it too)."""
    return identity_fingerprint(key)


@dataclass(frozen=True)
class RunName:
    """`NAME` or `NAME@FINGERPRINT` as a user wrote it; `fingerprint` is None for a bare name."""
    name: str
    fingerprint: str | None = None

    @property
    def full(self) -> str:
        if self.fingerprint is None:
            raise ValueError(f"{self.name!r} names no owner (NAME@FINGERPRINT)")
        return f"{self.name}@{self.fingerprint}"

    def __str__(self) -> str:
        return self.name if self.fingerprint is None else self.full


def parse(text: str) -> RunName:
    """`NAME` or `NAME@FINGERPRINT`; ValueError saying what is wrong."""
    name, at, fp = text.partition("@")
    if not _NAME.match(name):
        raise ValueError(f"{text!r}: a run name is 1-64 letters, digits, '_', '.', '-' (the manifest's run_id)")
    if not at:
        return RunName(name)
    if not _FINGERPRINT.match(fp):
        raise ValueError(f"{text!r}: the part after '@' must be a key fingerprint of {FINGERPRINT_CHARS} "
                         "characters a-z, 2-7 (as `swarmgrad keygen` and `swarmgrad runs` print it)")
    return RunName(name, fp)


def is_public_run_id(run_id: str) -> bool:
    """Whether a run id is a public run's `NAME@FINGERPRINT`."""
    try:
        return parse(run_id).fingerprint is not None
    except ValueError:
        return False
