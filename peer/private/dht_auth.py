"""DHT access in a private run: hivemind's token authorizer, with our certificate as the token.

hivemind signs every DHT request and response with an RSA key of the node and attaches an
`AccessToken`; the receiving node checks the token before it serves or believes anything. Here
the token carries the coordinator-signed certificate (peer/private/credentials.py), whose
`dht_public_key` is that RSA key: a node without a certificate of this run, with an expired
one, or with a revoked one, gets no DHT request served and no response believed (hivemind drops
it), so an outsider can neither read nor write a record.

The authorizer lives in the DHT's own process (hivemind forks it), so it cannot share memory
with the peer: the peer writes its current certificate and the revocation list it has verified
into a private folder (`AuthFiles`), and the authorizer reads them (cached by modification time).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey

from swarmgrad.peer.private.credentials import Authority, CredentialError
from swarmgrad.protocol import coordinator_pb2 as cpb

CERTIFICATE_FILE = "certificate.bin"
REVOKED_FILE = "revoked.txt"


class AuthFiles:
    """The folder through which a peer hands its certificate and revocations to its DHT process."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _write(self, name: str, data: bytes) -> None:
        tmp = self.folder / f".{name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self.folder / name)

    def write_certificate(self, signed: cpb.Signed) -> None:
        self._write(CERTIFICATE_FILE, signed.SerializeToString())

    def write_revoked(self, peer_ids) -> None:
        self._write(REVOKED_FILE, "\n".join(sorted(peer_ids)).encode())


class _Cached:
    def __init__(self, path: Path):
        self.path = path
        self.mtime: float | None = None
        self.data = b""

    def read(self) -> bytes:
        try:
            mtime = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            return b""
        if mtime != self.mtime:
            self.data, self.mtime = self.path.read_bytes(), mtime
        return self.data


class CertificateAuthorizer(TokenAuthorizerBase):
    """Admits DHT requests and responses that carry a valid, unrevoked certificate of the run."""

    def __init__(self, coordinator_id: str, run_id: str, folder: Path, rsa_key: RSAPrivateKey):
        super().__init__(rsa_key)
        self.coordinator_id = coordinator_id
        self.run_id = run_id
        self.folder = Path(folder)
        self._authority: Authority | None = None
        self._certificate = _Cached(self.folder / CERTIFICATE_FILE)
        self._revoked = _Cached(self.folder / REVOKED_FILE)

    @property
    def authority(self) -> Authority:
        if self._authority is None:
            self._authority = Authority(self.coordinator_id, self.run_id)
        return self._authority

    def __getstate__(self) -> dict:
        # hivemind may pickle the DHT's arguments; asyncio locks and caches are rebuilt on the other side
        return {"coordinator_id": self.coordinator_id, "run_id": self.run_id, "folder": self.folder,
                "rsa_key": self._local_private_key}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["coordinator_id"], state["run_id"], state["folder"], state["rsa_key"])

    def _revoked_ids(self) -> set[str]:
        return set(self._revoked.read().decode(errors="replace").split())

    async def get_token(self) -> AccessToken:
        data = self._certificate.read()
        if not data:
            raise RuntimeError(f"no certificate in {self.folder}: this peer was not admitted")
        signed = cpb.Signed.FromString(data)
        cert = self.authority.certificate(signed)
        return AccessToken(username=cert.peer_id, public_key=cert.dht_public_key,
                           expiration_time=repr(cert.expires_at), signature=data)

    def is_token_valid(self, access_token: AccessToken) -> bool:
        try:
            cert = self.authority.certificate(cpb.Signed.FromString(access_token.signature),
                                              peer_id=access_token.username)
        except (CredentialError, Exception):
            return False
        return cert.dht_public_key == access_token.public_key and cert.peer_id not in self._revoked_ids()

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        # a renewed certificate on disk replaces the token at once; so does one about to expire
        if self._certificate.read() != access_token.signature:
            return True
        try:
            return float(access_token.expiration_time) < time.time() + 30
        except ValueError:
            return True
