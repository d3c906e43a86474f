"""Who may talk to this peer in a private run, and keeping this peer admitted.

Every RPC server of the peer (pipeline, averaging, state download, backups: peer/net/rpc.py)
asks `Admission.check(remote)` before it reads a byte of a request. `remote` is the libp2p id
the transport authenticated (ctx.remote_id), never a field the caller wrote. It is admitted if
it holds a coordinator-signed certificate for this run that has not expired and is not on the
newest revocation list this peer has verified.

Where the certificates come from: every admitted peer publishes its own under the run's
`certificates` key in the DHT (a signed subkey record, so only it can write its entry; and the
DHT itself only serves admitted peers: peer/private/dht_auth.py). Each heartbeat this peer reads them
all, and the coordinator's revocation list, verifies them, and replaces its view. A caller not
in the view yet (a peer that joined a moment ago) costs one DHT lookup, at most one per
`lookup_backoff` seconds per caller, so strangers cannot make us hammer the DHT.

The coordinator is not on this path: if it is down, certificates keep verifying until they
expire (hours), and the newest list we saw stays in force. Renewal (at half-life) and the
revocation list are fetched from it when it answers, and from the DHT when it does not.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from google.protobuf.message import DecodeError
from hivemind import DHT
from hivemind.utils import get_dht_time

from swarmgrad.peer.private.coordinator_client import CoordinatorClient, CoordinatorUnavailable
from swarmgrad.peer.private.credentials import Authority, Certificate, CredentialError, Revocations
from swarmgrad.peer.net.errors import BestEffort, LoopSteps, dht_call
from swarmgrad.peer.private.dht_auth import AuthFiles
from swarmgrad.peer.net.identity import is_peer_id
from swarmgrad.peer.net.record_signing import MAX_RECORD_TTL
from swarmgrad.peer.net.dht_view import signed_entries
from swarmgrad.protocol import coordinator_pb2 as cpb

logger = logging.getLogger(__name__)

MAX_CERTIFICATE_BYTES = 4096


def certificates_key(run_id: str) -> str:
    return f"{run_id}/certificates"


def revocations_key(run_id: str) -> str:
    return f"{run_id}/revocations"


class Admission:
    """The gate of one peer of a private run (one per process, shared by all its RPC servers)."""

    def __init__(self, *, authority: Authority, certificate: Certificate, dht: DHT | None, files: AuthFiles | None,
                 client: CoordinatorClient | None, dht_public_key: bytes, heartbeat: float, dht_timeout: float,
                 revocations: Revocations | None = None, lookup_backoff: float = 5.0):
        self.authority = authority
        self.certificate = certificate
        self.peer_id = certificate.peer_id
        self.dht = dht
        self.files = files
        self.client = client
        self.dht_public_key = dht_public_key
        self.heartbeat = heartbeat
        self.dht_timeout = dht_timeout
        self.lookup_backoff = lookup_backoff
        self.known: dict[str, Certificate] = {certificate.peer_id: certificate}
        self.revocations = revocations
        self._looked_up: dict[str, float] = {}
        self._lookup_lock = asyncio.Lock()
        self._lookup = BestEffort("looking up an unknown caller's certificate", logger)
        self._steps = LoopSteps("admission", logger)
        self.refused = 0
        """Requests refused so far (a metric: an outsider's calls land here)."""
        self.self_revoked = asyncio.Event()
        """Set once a verified revocation list names this peer: every other peer refuses it now, so
        the daemon stops instead of training alone (peer/node/peer.py)."""

    # the check ------------------------------------------------------------------------------------
    @property
    def revoked(self) -> frozenset[str]:
        return self.revocations.peer_ids if self.revocations is not None else frozenset()

    def reason(self, peer_id: str, now: float | None = None, stage: int | None = None) -> str | None:
        """Why `peer_id` may not be served now, or None if it may (from what we know; no I/O).
        With `stage`: also why it may not act as a replica of that stage (its certificate names
        another: an invitation with `--stage` admits its peer to that stage only)."""
        if peer_id in self.revoked:
            return "revoked by the run's coordinator"
        cert = self.known.get(peer_id)
        if cert is None:
            return "holds no certificate of this run"
        if cert.remaining(now) <= 0:
            return "its certificate expired"
        if stage is not None and cert.stage is not None and cert.stage != stage:
            return f"its certificate admits it to stage {cert.stage} only, not {stage}"
        return None

    def admitted(self, peer_id: str, stage: int | None = None) -> bool:
        """Whether `peer_id` is admitted now (to `stage`, when one is named: SwarmView asks so
        for every stage record and round registration it reads)."""
        return self.reason(peer_id, stage=stage) is None

    async def check(self, peer: Any) -> str | None:
        """The gate: None to serve `peer` (a hivemind PeerID or its string), else the refusal."""
        peer_id = str(peer)
        why = self.reason(peer_id)
        if why is None:
            return None
        if peer_id in self.revoked:
            self.refused += 1
            return why
        now = time.monotonic()
        # a lookup per unknown caller at most every lookup_backoff s, and one at a time for all of
        # them together: strangers with many ids cannot turn refusals into DHT traffic
        if (now - self._looked_up.get(peer_id, -1e9) >= self.lookup_backoff and is_peer_id(peer_id)
                and not self._lookup_lock.locked()):
            self._looked_up[peer_id] = now
            if len(self._looked_up) > 10_000:  # forget the oldest lookups: strangers are many
                for stale in sorted(self._looked_up, key=self._looked_up.get)[:5_000]:
                    del self._looked_up[stale]
            with self._lookup:
                async with self._lookup_lock:
                    await self.refresh_certificates()
            why = self.reason(peer_id)
        if why is not None:
            self.refused += 1
        return why

    # keeping the view fresh ---------------------------------------------------------------------
    def adopt_revocations(self, revocations: Revocations | None) -> bool:
        """Keep `revocations` if it is newer than ours. True if it changed our view."""
        if revocations is None or (self.revocations is not None and revocations.version <= self.revocations.version):
            return False
        self.revocations = revocations
        for peer_id in revocations.peer_ids:
            self.known.pop(peer_id, None)
        if self.files is not None:
            self.files.write_revoked(revocations.peer_ids)
        logger.info("revocation list v%d: %d peers revoked", revocations.version, len(revocations.peer_ids))
        if self.peer_id in revocations.peer_ids and not self.self_revoked.is_set():
            logger.error("this peer (%s) was revoked by the run's coordinator (list v%d): stopping",
                         self.peer_id, revocations.version)
            self.self_revoked.set()
        return True

    async def _get(self, key: str) -> Any:
        """The DHT's value under `key`; raises SwarmUnavailable when the network fails the read."""
        dht = self.dht
        assert dht is not None
        found = await dht_call(f"reading {key}", lambda: dht.get(key, latest=True, return_future=True),
                               self.dht_timeout)
        return None if found is None else found.value

    async def refresh_certificates(self) -> None:
        key = certificates_key(self.authority.run_id)
        entries = signed_entries(await self._get(key), MAX_RECORD_TTL, key)
        now = time.time()
        fresh = {self.peer_id: self.certificate}
        for subkey, value in entries:
            if not isinstance(value, bytes) or len(value) > MAX_CERTIFICATE_BYTES:
                continue
            try:
                cert = self.authority.certificate(cpb.Signed.FromString(value), peer_id=subkey, now=now)
            except (CredentialError, DecodeError):  # not a certificate of this run
                continue
            if cert.peer_id not in self.revoked:
                fresh[cert.peer_id] = cert
        # keep what we knew and did not see this time (a lookup may miss an entry) until it expires
        for peer_id, cert in self.known.items():
            if peer_id not in fresh and cert.remaining(now) > 0 and peer_id not in self.revoked:
                fresh[peer_id] = cert
        self.known = fresh

    async def refresh_revocations(self) -> None:
        key = revocations_key(self.authority.run_id)
        for subkey, value in signed_entries(await self._get(key), MAX_RECORD_TTL, key):
            if subkey != self.authority.coordinator_id or not isinstance(value, bytes):
                continue
            try:
                revocations = self.authority.revocations(cpb.Signed.FromString(value))
            except (CredentialError, DecodeError) as e:
                logger.debug("ignored a revocation list in the DHT: %s: %s", type(e).__name__, e)
                continue
            self.adopt_revocations(revocations)

    async def publish(self) -> None:
        """Store our certificate where the others look for it. Raises SwarmUnavailable when the
        network fails the write."""
        dht = self.dht
        assert dht is not None
        ttl = max(1.0, min(MAX_RECORD_TTL, self.certificate.remaining()))
        key, value = certificates_key(self.authority.run_id), self.certificate.signed.SerializeToString()
        await dht_call(f"storing our certificate under {key}", lambda: dht.store(
            key, value, get_dht_time() + ttl, subkey=self.peer_id, return_future=True), self.dht_timeout)

    async def renew_if_due(self) -> None:
        """At half-life, ask the coordinator for a new certificate (and its revocation list)."""
        cert = self.certificate
        if self.client is None or cert.remaining() > (cert.expires_at - cert.issued_at) / 2:
            return
        loop = asyncio.get_running_loop()
        try:
            admitted = await loop.run_in_executor(None, self.client.renew, cert.signed, self.dht_public_key)
        except (CoordinatorUnavailable, CredentialError) as e:
            logger.warning("could not renew the certificate (expires in %.0fs): %s", cert.remaining(), e)
            return
        self.certificate = admitted.certificate
        self.known[self.peer_id] = admitted.certificate
        if self.files is not None:
            self.files.write_certificate(admitted.certificate.signed)
        self.adopt_revocations(admitted.revocations)
        await self.publish()
        logger.info("certificate renewed until %s", time.strftime("%H:%M:%S", time.localtime(
            admitted.certificate.expires_at)))

    async def step(self) -> None:
        """One heartbeat's work. Each part survives the others' failures: the network's are logged
        (`BestEffort`), anything else (a bug, a file not written) with its traceback, and the next
        heartbeat tries again; the gate keeps answering from what it knows."""
        for what in (self.refresh_revocations, self.renew_if_due, self.publish, self.refresh_certificates):
            await self._steps.run(what.__name__, what)

    async def run(self) -> None:
        """Every heartbeat until cancelled."""
        while True:
            await self.step()
            await asyncio.sleep(self.heartbeat)
