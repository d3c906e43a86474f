"""A public run's manifest, signed by its owner: what every peer of the run stores in the DHT and a
joiner checks before it trusts a byte of it. Pure functions over bytes and keys; no network.

The signed body (canonical JSON) holds the run's NAME, the owner's peer id (its public key), the
manifest's TOML text and hash, the sha256 of the tokenizer file's bytes where the manifest names one
(`data.tokenizer`), and when it was signed. The blob is msgpack `[VERSION, body, signature]`, the
signature by the owner's key over DOMAIN || body. `verify` accepts a blob only if the signature is
the owner's, the owner's key has the fingerprint the reader asked for, the TOML parses into a
manifest whose run_id is NAME and whose hash is the signed one, and the signed tokenizer digest is
the one the manifest names: so nobody can alter a manifest (any byte changes the signature's
message), forge one for someone else's name (the fingerprint would differ) or squat a name (a
second key gives a second `NAME@FINGERPRINT`).

A signature does not expire: the run's manifest never changes (its hash is checked on every record
and call). An owner who signs a second manifest under the same name gets a second, later
`issued_at`; readers take the latest one (directory.py).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarmgrad.peer.manifest import Manifest, ManifestError, loads
from swarmgrad.peer.net.identity import is_peer_id, peer_id_of, public_key_of
from swarmgrad.peer.public.run_name import RunName, fingerprint

DOMAIN = b"swarmgrad-public-manifest-v1\x00"
"""Prefix of the signed message, so this signature means nothing as any other swarmgrad signature."""
VERSION = 1
MAX_BLOB_BYTES = 12 * 1024
"""A signed manifest larger than this is neither signed nor accepted: it travels as a DHT value, and
hivemind's pipe to its DHT process breaks on values over ~16 KiB (net/dht_view.py). A manifest is
1-3 kB."""
_HEX64 = frozenset("0123456789abcdef")


class ManifestRefused(ValueError):
    """A signed manifest that does not verify; the message is one line saying why."""


@dataclass(frozen=True)
class PublishedManifest:
    """A verified public manifest. `manifest` is the one the run's peers train with: the TOML's, with
    its run_id set to `NAME@FINGERPRINT` (public_manifest), so its hash differs from `toml_hash`."""
    name: str
    fingerprint: str
    owner_id: str
    toml: str
    toml_hash: str
    tokenizer_sha256: str | None
    issued_at: float
    blob: bytes
    manifest: Manifest

    @property
    def run_id(self) -> str:
        return f"{self.name}@{self.fingerprint}"


def public_manifest(manifest: Manifest, owner_fingerprint: str) -> Manifest:
    """The manifest a public run trains with: its run_id becomes `NAME@FINGERPRINT`, the prefix of
    every DHT key and RPC namespace of the run. `dataclasses.replace` skips the manifest's checks on
    purpose: '@' is not allowed in a TOML run_id, so no hand-written manifest can take a public
    run's id; every other field was checked when the TOML loaded."""
    if "@" in manifest.run_id:
        raise ValueError(f"{manifest.run_id!r} is already a public run id")
    return dataclasses.replace(manifest, run_id=f"{manifest.run_id}@{owner_fingerprint}")


def tokenizer_digest(manifest: Manifest, base: Path) -> str | None:
    """sha256 of the tokenizer file's bytes, where the manifest names one (`data.tokenizer`, relative
    to `base`, the manifest's folder), checked against `data.tokenizer_sha256` where that is set.
    None for a manifest without a tokenizer (the byte-level models). Raises ManifestRefused for a
    file that is missing or does not match."""
    path_text = getattr(manifest.data, "tokenizer", "") or ""
    if not path_text:
        return None
    path = Path(path_text) if Path(path_text).is_absolute() else base / path_text
    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as e:
        raise ManifestRefused(f"data.tokenizer {path}: {e.strerror}") from None
    expected = getattr(manifest.data, "tokenizer_sha256", "") or ""
    if expected and expected.lower() != digest:
        raise ManifestRefused(f"data.tokenizer {path} has sha256 {digest[:12]}..., the manifest's "
                              f"tokenizer_sha256 is {expected[:12]}...")
    return digest


def sign(key: Ed25519PrivateKey, toml_text: str, *, tokenizer_sha256: str | None = None,
         now: float | None = None) -> bytes:
    """The signed blob of a manifest (`swarmgrad peer --manifest PATH --owner-key KEY`). Raises
    ManifestError for a TOML that does not load, ManifestRefused for one too large to publish."""
    manifest = loads(toml_text)
    body = json.dumps({
        "name": manifest.run_id, "owner": peer_id_of(key), "manifest_toml": toml_text,
        "manifest_hash": manifest.hash, "tokenizer_sha256": tokenizer_sha256,
        "issued_at": time.time() if now is None else now,
    }, sort_keys=True, separators=(",", ":")).encode()
    blob = msgpack.packb([VERSION, body, key.sign(DOMAIN + body)], use_bin_type=True)
    if len(blob) > MAX_BLOB_BYTES:
        raise ManifestRefused(f"the signed manifest has {len(blob)} bytes; a public run's may have "
                              f"{MAX_BLOB_BYTES} (it travels as a DHT value)")
    return blob


def verify(blob: Any, expected: RunName) -> PublishedManifest:
    """The manifest in `blob` (bytes, as stored in the DHT), verified for `expected` (a NAME, or
    NAME@FINGERPRINT: only then is the owner's fingerprint checked, which a bare name's caller must
    do itself, directory.py). Raises ManifestRefused with one line saying why."""
    body_bytes, signature = _unpack(blob)
    try:
        body = json.loads(body_bytes)
    except (UnicodeDecodeError, ValueError):
        body = None
    if not isinstance(body, dict):
        raise ManifestRefused("the signed manifest's body is not a JSON object")
    owner = body.get("owner")
    if not isinstance(owner, str) or not is_peer_id(owner):
        raise ManifestRefused("the signed manifest names no Ed25519 owner key")
    owner_fp = fingerprint(owner)
    if expected.fingerprint is not None and owner_fp != expected.fingerprint:
        raise ManifestRefused(f"a manifest for {expected.full} is signed by another key "
                              f"(fingerprint {owner_fp}): forged or squatted")
    try:
        public_key_of(owner).verify(signature, DOMAIN + body_bytes)
    except InvalidSignature:
        raise ManifestRefused(f"the manifest of {expected.name}@{owner_fp} does not match its owner's "
                              "signature (altered or forged)") from None
    name, toml_text, toml_hash = body.get("name"), body.get("manifest_toml"), body.get("manifest_hash")
    tokenizer, issued_at = body.get("tokenizer_sha256"), body.get("issued_at")
    if not (isinstance(name, str) and isinstance(toml_text, str) and isinstance(toml_hash, str)
            and (tokenizer is None or (isinstance(tokenizer, str) and len(tokenizer) == 64
                                       and set(tokenizer) <= _HEX64))
            and isinstance(issued_at, (int, float)) and not isinstance(issued_at, bool)):
        raise ManifestRefused(f"the signed manifest of {expected} has a malformed body")
    if name != expected.name:
        raise ManifestRefused(f"the signed manifest is for run {name[:64]!r}, not {expected.name!r}")
    try:
        manifest = loads(toml_text)
    except ManifestError as e:
        raise ManifestRefused(f"the signed manifest of {expected} does not load: {e}") from None
    if manifest.run_id != name or manifest.hash != toml_hash:
        raise ManifestRefused(f"the signed manifest of {expected} is not the manifest its owner hashed")
    named = getattr(manifest.data, "tokenizer_sha256", "") or ""
    if named and named.lower() != tokenizer:
        raise ManifestRefused(f"the signed tokenizer digest of {expected} is not the manifest's tokenizer_sha256")
    return PublishedManifest(name=name, fingerprint=owner_fp, owner_id=owner, toml=toml_text, toml_hash=toml_hash,
                             tokenizer_sha256=tokenizer, issued_at=float(issued_at), blob=bytes(blob),
                             manifest=public_manifest(manifest, owner_fp))


def _unpack(blob: Any) -> tuple[bytes, bytes]:
    """(body, signature) of a blob, before any check of what they say; ManifestRefused for anything
    that is not a blob of this version and a usable size."""
    if not isinstance(blob, bytes) or len(blob) > MAX_BLOB_BYTES:
        raise ManifestRefused("not a signed manifest of a usable size")
    try:
        parts = msgpack.unpackb(blob, raw=False)
    except (ValueError, msgpack.UnpackException):
        raise ManifestRefused("the signed manifest is not msgpack") from None
    if not (isinstance(parts, list) and len(parts) == 3 and parts[0] == VERSION
            and isinstance(parts[1], bytes) and isinstance(parts[2], bytes) and len(parts[2]) == 64):
        raise ManifestRefused(f"not a signed manifest of version {VERSION}")
    return parts[1], parts[2]
