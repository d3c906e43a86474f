"""Joining a private run: from an invitation (or a certificate saved by an earlier join) to a peer
whose DHT and RPC servers admit only certified peers.

    invitation --Admit--> certificate + signed manifest + revocations + the coordinator's DHT address
    certificate --> AuthFiles --> the DHT's authorizer (peer/private/dht_auth.py)
    certificate --> Admission: the gate of every RPC server, renewal, revocations (peer/private/admission.py)

A peer with an identity key file keeps its certificate beside it (`KEY.cert`), so that it can
restart with `--coordinator HOST:PORT` and no new invitation; the coordinator renews it unless
the peer was revoked.
"""
from __future__ import annotations

import asyncio
import logging
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind import DHT
from hivemind.utils.crypto import RSAPrivateKey

from swarmgrad.peer.private.admission import Admission
from swarmgrad.peer.private.coordinator_client import Admitted, CoordinatorClient, CoordinatorUnavailable
from swarmgrad.peer.private.credentials import Authority, CredentialError, parse_invitation
from swarmgrad.peer.private.dht_auth import AuthFiles, CertificateAuthorizer
from swarmgrad.peer.net.errors import RPCFailed
from swarmgrad.peer.net.identity import peer_id_of
from swarmgrad.peer.manifest import Manifest, loads
from swarmgrad.peer.model import StagedModel
from swarmgrad.peer.state.stage_state import StateSnapshot, snapshot_from_bytes
from swarmgrad.protocol import coordinator_pb2 as cpb

logger = logging.getLogger(__name__)

CERT_SUFFIX = ".cert"
AUTH_SUFFIX = ".auth"
"""Beside the identity key: the folder through which the peer hands its certificate and the
revocations to its DHT process (peer/private/dht_auth.py)."""


@dataclass
class PrivateRun:
    """A peer's membership of a private run, between admission and shutdown."""
    authority: Authority
    client: CoordinatorClient
    admitted: Admitted
    manifest: Manifest
    rsa: RSAPrivateKey
    files: AuthFiles
    folder_owned: bool

    def authorizer(self) -> CertificateAuthorizer:
        return CertificateAuthorizer(self.authority.coordinator_id, self.authority.run_id, self.files.folder, self.rsa)

    def admission(self, dht: DHT) -> Admission:
        t = self.manifest.timeouts
        return Admission(authority=self.authority, certificate=self.admitted.certificate, dht=dht, files=self.files,
                         client=self.client, dht_public_key=self.rsa.get_public_key().to_bytes(),
                         heartbeat=t.heartbeat, dht_timeout=t.dht, revocations=self.admitted.revocations)

    def checkpoint_source(self, model: StagedModel, admission: Admission
                          ) -> Callable[[int], Awaitable[StateSnapshot | None]]:
        """The coordinator's newest checkpoint of a stage, checked against the stage's shapes and
        its own digest (peer/state/stage_state.py), for an empty stage to restore. The fetch returns
        None if the coordinator has none; raises RPCFailed if it did not answer or its answer fails
        the credential checks (state/ knows no coordinator errors), CheckpointError if the
        checkpoint does not fit the stage."""
        async def fetch(stage: int) -> StateSnapshot | None:
            loop = asyncio.get_running_loop()
            shapes = {n: tuple(p.shape) for n, p in model.build_stage(stage).named_parameters()}
            # θ_global and momentum in fp32, and a header: nothing bigger is a checkpoint of this stage
            max_bytes = 8 * sum(math.prod(s) for s in shapes.values()) + (1 << 20)
            try:
                got = await loop.run_in_executor(None, self.client.checkpoint, stage, admission.certificate.signed,
                                                 max_bytes)
            except (CoordinatorUnavailable, CredentialError) as e:
                raise RPCFailed(f"the coordinator's checkpoint of stage {stage}: {type(e).__name__}: {e}") from e
            if got is None:
                return None
            info, data = got
            snap = await loop.run_in_executor(None, snapshot_from_bytes, data, shapes)
            logger.info("stage %d: the coordinator's newest checkpoint has %d applied rounds", stage,
                        snap.applied_rounds)
            return snap
        return fetch

    def resume_round(self) -> int:
        """The round of the coordinator's newest checkpoint (0 if it has none or does not answer:
        then a resumed swarm's first round is long, not wrong)."""
        try:
            return max((int(c.round) for c in self.client.checkpoints()), default=0)
        except (CoordinatorUnavailable, CredentialError) as e:
            logger.warning("could not list the coordinator's checkpoints: %s", e)
            return 0

    def close(self) -> None:
        self.client.close()
        if self.folder_owned:
            shutil.rmtree(self.files.folder, ignore_errors=True)


def join(key: Ed25519PrivateKey, *, invitation: str | None = None, coordinator: str | None = None,
         identity_path: Path | None = None, timeout: float = 15.0) -> PrivateRun:
    """Admit this peer: with an invitation, or with the certificate saved beside its identity key
    from an earlier admission (`coordinator` then says where to renew it). Raises CredentialError
    (a bad or spent invitation, a revoked peer, a tampered reply) or CoordinatorUnavailable."""
    rsa = RSAPrivateKey()
    dht_key = rsa.get_public_key().to_bytes()
    cert_path = Path(str(identity_path) + CERT_SUFFIX) if identity_path else None
    if invitation is not None:
        inv = parse_invitation(invitation)
        authority = Authority(inv.coordinator_id, inv.run_id)
        client = CoordinatorClient(coordinator or inv.coordinator, authority, key, timeout)
        admitted = client.admit(inv, dht_key)
    else:
        if cert_path is None or not cert_path.exists():
            raise CredentialError("--coordinator without --join needs the certificate of an earlier admission: "
                                  "give the same --identity key file you joined with")
        assert coordinator is not None
        saved = cpb.Signed.FromString(cert_path.read_bytes())
        body = cpb.CertificateBody.FromString(saved.body)
        coordinator_id = cert_path.with_suffix(".coordinator").read_text().strip() \
            if cert_path.with_suffix(".coordinator").exists() else ""
        authority = Authority(coordinator_id, body.run_id)
        client = CoordinatorClient(coordinator, authority, key, timeout)
        admitted = client.renew(saved, dht_key)
    if admitted.certificate.peer_id != peer_id_of(key):
        raise CredentialError("the coordinator certified another peer id")
    manifest = loads(admitted.manifest_toml)
    if manifest.hash != admitted.manifest_hash or manifest.run_id != authority.run_id:
        raise CredentialError("the signed manifest does not match its declared hash or run id")
    if cert_path is not None:
        cert_path.write_bytes(admitted.certificate.signed.SerializeToString())
        cert_path.with_suffix(".coordinator").write_text(authority.coordinator_id + "\n")
    # With a key file the folder for our DHT process lives beside it and is reused at the next
    # start, so a SIGKILLed peer leaves nothing in /tmp; an ephemeral key gets a temp folder.
    owned = identity_path is None
    folder = Path(tempfile.mkdtemp(prefix="swarmgrad-auth-")) if owned else Path(str(identity_path) + AUTH_SUFFIX)
    files = AuthFiles(folder)
    files.write_certificate(admitted.certificate.signed)
    if admitted.revocations is not None:
        files.write_revoked(admitted.revocations.peer_ids)
    return PrivateRun(authority=authority, client=client, admitted=admitted, manifest=manifest, rsa=rsa,
                      files=files, folder_owned=owned)
