"""Vouchers: the owner of a public run saying, with its key, that a peer id is one of its own.

A public run's id is `NAME@FINGERPRINT`, the fingerprint of its owner's Ed25519 key
(peer/public/run_name.py), so the owner's key is the one thing in a public run that no stranger can
mint more of. A voucher is the owner's signature, under DOMAIN, over (run id, manifest hash, peer
id, expiry): "this peer id is mine (or one I trust) in this run until then". It carries the
owner's peer id (its public key): a reader checks that the key's fingerprint is the run id's, so the
voucher needs nothing but the run id to be checked, and it is not a claim.

A vouched peer is an *anchor*: it has a voice in its stage from the start (peer/evidence.py), so the
decisions that count voices have one before any round was averaged, and a newcomer with no evidence
counts anchors instead of ids (docs/trust.md, "Anchors: voices the owner vouches for").

How a voucher travels: in its peer's own stage record (`PeerRecord.voucher`), which only that peer
can write (peer/net/record_signing.py), so nobody attaches a voucher to another id; and it names its
peer id, so nobody copies one into a record of its own. Every reader checks it (`VoucherBook`, in
peer/net/dht_view.py's SwarmView) before the record counts as vouched.

What checking costs a reader: a voucher is at most MAX_VOUCHER_BYTES; the cheap checks (format, run,
peer, expiry, the owner key's fingerprint) come before the signature; each (peer, voucher) is
verified once and remembered (VERIFIED_KEPT of them, refusals too); and one read verifies at most
VERIFY_BUDGET new ones, picked at random, so a flood of forged vouchers costs a bounded number of
verifications per read, and cannot choose to be checked before a real one (a real one is checked
within a few reads; once checked it stays remembered).

Pure crypto over bytes; no network.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import random
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarmgrad.peer.net.identity import fingerprint, is_peer_id, peer_id_of, public_key_of

DOMAIN = b"swarmgrad/voucher/v1\x00"
"""Prefix of every signed voucher, so an owner's signature of a voucher means nothing as a manifest's
(signed_manifest.DOMAIN), a record's or a round ticket's, nor they as a voucher."""
VERSION = 1
MAX_VOUCHER_BYTES = 512
"""A voucher is about 210 bytes; anything larger is refused before it is parsed (it rides in every
stage record of its peer)."""
TEXT_PREFIX = "swarmgrad-voucher-v1:"
"""A voucher file holds one line: this prefix and the voucher in base64 (it is pasted into chats and
mails)."""
VERIFIED_KEPT = 4096
"""(peer, voucher) verdicts a reader remembers: a run's anchors, and the refusals of a flood."""
VERIFY_BUDGET = 32
"""New vouchers one read verifies at most (about 0.5 ms each, measured on a loaded 2-core machine:
16 ms per read at most); the rest wait for the next read."""
_MAX_FIELD_CHARS = 128

logger = logging.getLogger(__name__)


class VoucherRefused(ValueError):
    """A voucher that does not hold for this run and peer: str() is one line saying why."""


@dataclass(frozen=True)
class Voucher:
    """A voucher's signed fields."""
    owner_id: str
    """The owner's peer id (its Ed25519 public key); its fingerprint is the run id's."""
    run_id: str
    manifest_hash: str
    """The manifest it was signed for ("": any manifest of the run)."""
    peer_id: str
    expires_at: float
    """Unix time after which it no longer counts."""


def run_fingerprint(run_id: str) -> str | None:
    """The owner fingerprint in a public run id (`NAME@FINGERPRINT`), or None for a private run's."""
    name, at, fp = run_id.partition("@")
    return fp if at and name and fp else None


def sign_voucher(owner_key: Ed25519PrivateKey, run_id: str, peer_id: str, expires_at: float,
                 manifest_hash: str = "") -> bytes:
    """The owner's voucher for `peer_id` in `run_id` until `expires_at`. Raises ValueError when the
    key is not the run's owner's, or the run id or peer id is not one."""
    if run_fingerprint(run_id) != fingerprint(owner_key):
        raise ValueError(f"this key (fingerprint {fingerprint(owner_key)}) is not the owner key of run {run_id}")
    if not is_peer_id(peer_id):
        raise ValueError(f"{peer_id[:60]!r} is not an Ed25519 peer id")
    body = msgpack.packb([peer_id_of(owner_key), run_id, manifest_hash, peer_id, float(expires_at)],
                         use_bin_type=True)
    blob = msgpack.packb([VERSION, body, owner_key.sign(DOMAIN + body)], use_bin_type=True)
    if len(blob) > MAX_VOUCHER_BYTES:
        raise ValueError(f"the voucher has {len(blob)} bytes, more than {MAX_VOUCHER_BYTES}")
    return blob


def read_voucher(blob: object) -> tuple[Voucher, bytes, bytes]:
    """(fields, signed body, signature) of a voucher, before any check of what it says or who
    signed it. Raises VoucherRefused for anything that is not a voucher of this version."""
    if not isinstance(blob, bytes) or not 0 < len(blob) <= MAX_VOUCHER_BYTES:
        raise VoucherRefused(f"not a voucher (bytes, at most {MAX_VOUCHER_BYTES})")
    try:
        parts = msgpack.unpackb(blob, raw=False)
        fields = msgpack.unpackb(parts[1], raw=False) if isinstance(parts, list) and len(parts) == 3 \
            and isinstance(parts[1], bytes) else None
    except (ValueError, TypeError, msgpack.UnpackException):  # TypeError: e.g. a map with list keys
        raise VoucherRefused("not a voucher (not msgpack)") from None
    if fields is None or parts[0] != VERSION or not isinstance(parts[2], bytes) or len(parts[2]) != 64:
        raise VoucherRefused(f"not a voucher of version {VERSION}")
    if not (isinstance(fields, list) and len(fields) == 5
            and all(isinstance(f, str) and len(f) <= _MAX_FIELD_CHARS for f in fields[:4])
            and isinstance(fields[4], float) and fields[4] == fields[4]):
        raise VoucherRefused("a voucher with malformed fields")
    return Voucher(*fields), parts[1], parts[2]


def check_voucher(blob: object, run_id: str, peer_id: str, now: float, manifest_hash: str = "") -> Voucher:
    """The voucher in `blob`, checked for `peer_id` in `run_id` at time `now` (and for
    `manifest_hash` when both it and the voucher name one): signed by the key whose fingerprint the
    run id carries. Raises VoucherRefused saying why. The signature is checked last, after
    everything that costs nothing."""
    voucher, body, signature = read_voucher(blob)
    expected = run_fingerprint(run_id)
    if expected is None:
        raise VoucherRefused(f"run {run_id} is not a public run (NAME@FINGERPRINT): it has no owner key")
    if voucher.run_id != run_id:
        raise VoucherRefused(f"the voucher is for run {voucher.run_id}, not {run_id}")
    if voucher.peer_id != peer_id:
        raise VoucherRefused(f"the voucher is for peer {voucher.peer_id[:60]}, not {peer_id}")
    if manifest_hash and voucher.manifest_hash and voucher.manifest_hash != manifest_hash:
        raise VoucherRefused(f"the voucher is for manifest {voucher.manifest_hash[:12]}, not {manifest_hash[:12]}")
    if not voucher.expires_at > now:
        raise VoucherRefused(f"the voucher expired at {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(voucher.expires_at))} UTC")
    if not is_peer_id(voucher.owner_id) or fingerprint(voucher.owner_id) != expected:
        raise VoucherRefused(f"the voucher is not signed by the owner key of {run_id}")
    try:
        public_key_of(voucher.owner_id).verify(signature, DOMAIN + body)
    except InvalidSignature:
        raise VoucherRefused(f"the voucher's signature is not the owner's of {run_id} (forged or altered)") from None
    return voucher


def voucher_text(blob: bytes) -> str:
    """A voucher as the one line a voucher file holds."""
    return TEXT_PREFIX + base64.b64encode(blob).decode() + "\n"


def voucher_from_text(text: str) -> bytes:
    """The voucher a voucher file's text holds (`voucher_text`); VoucherRefused if it holds none."""
    text = text.strip()
    if not text.startswith(TEXT_PREFIX) or len(text) > 2 * MAX_VOUCHER_BYTES:
        raise VoucherRefused(f"not a voucher file (one line starting {TEXT_PREFIX!r}, as `swarmgrad vouch` writes)")
    try:
        return base64.b64decode(text[len(TEXT_PREFIX):], validate=True)
    except (binascii.Error, ValueError):
        raise VoucherRefused("a voucher file whose base64 does not decode") from None


class OwnVoucher:
    """The voucher this peer announces with its record: a fixed one (`swarmgrad peer --voucher FILE`),
    or one its owner key signs for it (`--owner-key`), signed again when half its lifetime is gone."""

    def __init__(self, blob: bytes | None = None, *, owner_key: Ed25519PrivateKey | None = None,
                 run_id: str = "", peer_id: str = "", manifest_hash: str = "", lifetime: float = 7 * 86400.0):
        if (blob is None) == (owner_key is None):
            raise ValueError("an own voucher is either given or signed by the owner key")
        self._blob = blob
        self._key = owner_key
        self._run, self._peer, self._manifest, self.lifetime = run_id, peer_id, manifest_hash, lifetime
        self._expires = read_voucher(blob)[0].expires_at if blob is not None else 0.0
        self._said_expired = False

    @property
    def expires_at(self) -> float:
        """When the voucher last announced stops counting (0: none signed yet)."""
        return self._expires

    def current(self, now: float) -> bytes:
        """The voucher to announce at `now` (b"" once a given one expired: the record then has none)."""
        if self._key is not None and self._expires - now < self.lifetime / 2:
            self._expires = now + self.lifetime
            self._blob = sign_voucher(self._key, self._run, self._peer, self._expires, self._manifest)
        if self._blob is not None and self._expires > now:
            return self._blob
        if not self._said_expired:
            self._said_expired = True
            logger.warning("this peer's voucher expired: it is no longer an anchor of the run (ask the owner for a "
                           "new one: swarmgrad vouch)")
        return b""


class VoucherBook:
    """One reader's verdicts on the vouchers it read, for one run (`run_id`, `manifest_hash`: "" for a
    view of any manifest). Which peer ids of a read are vouched for (`vouched`); verifications are
    bounded per read and remembered (module docstring)."""

    def __init__(self, run_id: str, manifest_hash: str = "", *, kept: int = VERIFIED_KEPT,
                 budget: int = VERIFY_BUDGET, rng: random.Random | None = None):
        self.run_id = run_id
        self.manifest_hash = manifest_hash
        self.kept = kept
        self.budget = budget
        self._rng = rng or random.Random()
        self._verdicts: OrderedDict[bytes, float | None] = OrderedDict()
        """sha256(peer id, voucher) -> its expiry (None: refused)."""
        self.verified = 0
        """Signatures and fields checked so far (what a flood cost this reader)."""
        self.refusals: dict[str, str] = {}
        """The last refusal's reason per peer id (the latest VERIFIED_KEPT peers), for logs and tests."""

    def vouched(self, entries: Iterable[tuple[str, bytes]], now: float) -> set[str]:
        """The peer ids among `entries` ((peer id, voucher)) whose voucher holds at `now`."""
        out, unknown = set(), []
        for peer_id, blob in entries:
            if not blob:
                continue
            key = hashlib.sha256(peer_id.encode() + b"\0" + blob).digest()
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                expires = self._verdicts[key]
                if expires is not None and expires > now:
                    out.add(peer_id)
            else:
                unknown.append((key, peer_id, blob))
        if len(unknown) > self.budget:  # a flood: which ones are checked now is not the flooder's choice
            unknown = self._rng.sample(unknown, self.budget)
        for key, peer_id, blob in unknown:
            self.verified += 1
            try:
                expires: float | None = check_voucher(blob, self.run_id, peer_id, now, self.manifest_hash).expires_at
            except VoucherRefused as e:
                expires = None
                self.refusals[peer_id] = str(e)
                while len(self.refusals) > self.kept:
                    del self.refusals[next(iter(self.refusals))]
            self._verdicts[key] = expires
            while len(self._verdicts) > self.kept:
                self._verdicts.popitem(last=False)
            if expires is not None:
                out.add(peer_id)
        return out
