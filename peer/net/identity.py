"""A peer's libp2p identity: an Ed25519 key whose public half is its peer id.

An Ed25519 libp2p peer id (`12D3KooW...`) is an identity multihash: the id *is* the public key
(protobuf-wrapped), not a hash of it. So anyone holding only a peer id can check a signature
made by that peer, which is what `record_signing.py` needs to bind a DHT record to the peer
named in its subkey. hivemind's own key files are RSA (their peer ids are sha256 hashes, which a
verifier cannot turn back into a key), so swarmgrad writes its key files itself, in the libp2p
format p2pd reads (`-id PATH`): a `crypto_pb2.PrivateKey(key_type=Ed25519, data=seed || public)`.

Pure functions over bytes and files; no network.
"""
from __future__ import annotations

import base64
import hashlib
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import base58
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from google.protobuf.message import DecodeError

from swarmgrad.protocol import libp2p_key_pb2 as crypto_pb2

_PEER_ID_PREFIX = bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20])
"""identity multihash (code 0, length 36) of PublicKey{key_type: Ed25519 (field 1 = 1), data (field 2): 32 bytes}."""
PEER_ID_CHARS = 52
"""Length of an Ed25519 peer id in base58 (`12D3KooW` + 44)."""
MAX_KEY_FILE_BYTES = 4096


class IdentityError(ValueError):
    """A key file that swarmgrad cannot use (unreadable, not a libp2p key, or not Ed25519)."""


def raw_public_key(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def peer_id_of(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """The base58 libp2p peer id of an Ed25519 key (what p2pd reports for the same key)."""
    return base58.b58encode(_PEER_ID_PREFIX + raw_public_key(key)).decode()


def public_key_of(peer_id: str) -> Ed25519PublicKey:
    """The Ed25519 public key embedded in a peer id. Raises ValueError for anything that is not the
    canonical base58 form of an Ed25519 peer id (RSA/secp256k1 ids, garbage, other lengths)."""
    if not isinstance(peer_id, str) or len(peer_id) != PEER_ID_CHARS:
        raise ValueError("not an Ed25519 peer id")
    raw = base58.b58decode(peer_id)
    if len(raw) != len(_PEER_ID_PREFIX) + 32 or not raw.startswith(_PEER_ID_PREFIX):
        raise ValueError("not an Ed25519 peer id")
    if base58.b58encode(raw).decode() != peer_id:  # one peer, one spelling
        raise ValueError("not a canonical peer id")
    return Ed25519PublicKey.from_public_bytes(raw[len(_PEER_ID_PREFIX):])


FINGERPRINT_BYTES = 10
"""A key's fingerprint is the first 80 bits of sha256(raw public key), in lowercase base32 (16
characters): what a public run's id carries after '@' (peer/public/run_name.py says why)."""


def fingerprint(key: Ed25519PrivateKey | Ed25519PublicKey | str) -> str:
    """The fingerprint of an Ed25519 key, or of the key a peer id embeds (ValueError for another id)."""
    if isinstance(key, str):
        key = public_key_of(key)
    digest = hashlib.sha256(raw_public_key(key)).digest()[:FINGERPRINT_BYTES]
    return base64.b32encode(digest).decode().lower().rstrip("=")


def is_peer_id(value: object) -> bool:
    try:
        public_key_of(value)  # type: ignore[arg-type]
    except ValueError:
        return False
    return True


def key_file_bytes(key: Ed25519PrivateKey) -> bytes:
    seed = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())
    return crypto_pb2.PrivateKey(key_type=crypto_pb2.Ed25519, data=seed + raw_public_key(key)).SerializeToString()


def key_from_file_bytes(data: bytes) -> Ed25519PrivateKey:
    """Parse a libp2p private key file. Raises IdentityError unless it holds an Ed25519 key whose
    stored public half matches its seed."""
    try:
        message = crypto_pb2.PrivateKey.FromString(data)
    except DecodeError as e:
        raise IdentityError(f"not a libp2p private key file ({type(e).__name__})") from None
    if message.key_type != crypto_pb2.Ed25519:
        kind = crypto_pb2.KeyType.Name(message.key_type) if message.key_type in crypto_pb2.KeyType.values() else "?"
        raise IdentityError(f"holds a key of type {kind} (hivemind writes RSA key files); swarmgrad signs "
                            "its DHT records with Ed25519: move the file away, or give a new path to create one")
    if len(message.data) not in (64, 96):  # seed || public (go-libp2p also reads a legacy 96-byte form)
        raise IdentityError(f"an Ed25519 key must have 64 bytes, this one has {len(message.data)}")
    key = Ed25519PrivateKey.from_private_bytes(message.data[:32])
    if raw_public_key(key) != message.data[32:64]:
        raise IdentityError("the Ed25519 key's public half does not match its private half")
    return key


def write_key_file(path: Path, key: Ed25519PrivateKey) -> None:
    """Write `key` to a new file readable by its owner alone; refuses to overwrite."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key_file_bytes(key))


def load_key(path: Path) -> Ed25519PrivateKey:
    """The Ed25519 key in an existing key file. Raises IdentityError (naming the path) if it cannot
    be read or holds no usable Ed25519 key (e.g. hivemind's RSA)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as e:
        raise IdentityError(f"{path}: {e.strerror}") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise IdentityError(f"{path}: not a key file (over {MAX_KEY_FILE_BYTES} bytes)")
    try:
        return key_from_file_bytes(data)
    except IdentityError as e:
        raise IdentityError(f"{path}: {e}") from None


def load_or_create(path: Path) -> Ed25519PrivateKey:
    """The key in `path` (load_key), or a new Ed25519 key written there if the file does not exist yet."""
    if path.exists():
        return load_key(path)
    if not path.parent.is_dir():
        raise IdentityError(f"{path}: the folder {path.parent} does not exist")
    key = Ed25519PrivateKey.generate()
    write_key_file(path, key)
    return key


@contextmanager
def ephemeral_key_file(key: Ed25519PrivateKey | None = None) -> Iterator[tuple[Path, Ed25519PrivateKey]]:
    """`key` (default: a fresh Ed25519 key) in a private temp folder (0700), removed on exit: p2pd
    reads its key file once at start, so the file need not outlive the DHT's start-up."""
    folder = Path(tempfile.mkdtemp(prefix="swarmgrad-id-"))
    try:
        key = key if key is not None else Ed25519PrivateKey.generate()
        write_key_file(folder / "identity.key", key)
        yield folder / "identity.key", key
    finally:
        shutil.rmtree(folder, ignore_errors=True)
