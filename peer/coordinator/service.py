"""The coordinator's gRPC service: admission, renewal, revocation, the manifest, checkpoints.

Each method checks what it is sent with peer/private/credentials.py and changes the state
dir (peer/coordinator/store.py) only once the request has passed every check, so a refused
request leaves nothing behind. A refusal is a gRPC status with a reason: PERMISSION_DENIED for
credentials, INVALID_ARGUMENT for malformed requests, NOT_FOUND for a missing checkpoint.
"""
from __future__ import annotations

import logging
import time
from typing import AsyncIterator, Callable

import grpc

from swarmgrad.peer.private.coordinator_client import CHECKPOINT_CHUNK
from swarmgrad.peer.private.credentials import (ADMIT_PROOF, CHECKPOINT_PROOF, CLOCK_SKEW, RENEW_PROOF,
                                                    CredentialError, Issuer, check_proof, proof_message)
from swarmgrad.peer.coordinator.store import AdmittedPeer, StateDir, secret_id
from swarmgrad.peer.net.identity import is_peer_id
from swarmgrad.protocol import coordinator_pb2 as cpb
from swarmgrad.protocol import coordinator_pb2_grpc as cgrpc

logger = logging.getLogger(__name__)

MAX_DHT_KEY_BYTES = 1024


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, reason: str):
        super().__init__(reason)
        self.code = code
        self.reason = reason


class CoordinatorService(cgrpc.CoordinatorServicer):
    """Args:
        issuer: signs with the coordinator key.
        store: the state dir.
        manifest_toml, manifest_hash: the run's manifest, served signed.
        certificate_ttl: seconds a certificate lives (peers renew at half of it).
        initial_peers: the coordinator DHT node's addresses, given to every admitted peer.
        on_revoke: called with the new signed revocation list (the coordinator publishes it).
    """

    def __init__(self, issuer: Issuer, store: StateDir, manifest_toml: str, manifest_hash: str, *,
                 certificate_ttl: float, initial_peers: Callable[[], list[str]],
                 on_revoke: Callable[[cpb.Signed], None] = lambda signed: None):
        self.issuer = issuer
        self.store = store
        self.certificate_ttl = certificate_ttl
        self.initial_peers = initial_peers
        self.on_revoke = on_revoke
        self.signed_manifest = issuer.manifest(manifest_toml, manifest_hash)
        self.calls: dict[str, int] = {}
        self.refusals: dict[str, int] = {}

    # the pieces ---------------------------------------------------------------------------------
    def revocations(self) -> cpb.Signed:
        state = self.store.state
        return self.issuer.revocations(state.revoked, state.revocations_version)

    def _issue(self, peer_id: str, role: str, stage: int | None, dht_public_key: bytes) -> cpb.AdmitResponse:
        state = self.store.state
        serial = state.next_serial
        state.next_serial += 1
        now = time.time()
        certificate = self.issuer.certificate(peer_id, role=role, stage=stage, ttl=self.certificate_ttl,
                                              serial=serial, dht_public_key=dht_public_key, now=now)
        previous = state.admitted.get(peer_id)
        state.admitted[peer_id] = AdmittedPeer(peer_id=peer_id, role=role, stage=stage,
                                               admitted_at=previous.admitted_at if previous else now,
                                               expires=now + self.certificate_ttl, serial=serial)
        self.store.save()
        return cpb.AdmitResponse(certificate=certificate, manifest=self.signed_manifest,
                                 revocations=self.revocations(), initial_peers=self.initial_peers())

    def admit(self, request: cpb.AdmitRequest) -> cpb.AdmitResponse:
        authority = self.issuer.authority
        invitation = authority.invitation(request.invitation)
        if not is_peer_id(request.peer_id):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "peer_id is not an Ed25519 libp2p peer id")
        if len(request.dht_public_key) > MAX_DHT_KEY_BYTES:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "dht_public_key too large")
        check_proof(request.peer_id, request.proof, proof_message(ADMIT_PROOF, request.invitation.body,
                                                                  request.peer_id, request.dht_public_key), "admit")
        state = self.store.state
        if request.peer_id in state.revoked:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, "this peer was revoked")
        spent = secret_id(invitation.secret)
        if spent in state.spent_invitations:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, "this invitation was already used")
        state.spent_invitations[spent] = time.time()
        logger.info("admitted %s (stage %s)", request.peer_id, "any" if invitation.stage is None else invitation.stage)
        return self._issue(request.peer_id, "peer", invitation.stage, request.dht_public_key)

    def renew(self, request: cpb.RenewRequest) -> cpb.AdmitResponse:
        cert = self.issuer.authority.certificate(request.certificate)
        if abs(request.time - time.time()) > CLOCK_SKEW:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, "the request's time is far from ours (check the clocks)")
        if len(request.dht_public_key) > MAX_DHT_KEY_BYTES:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "dht_public_key too large")
        check_proof(cert.peer_id, request.proof, proof_message(RENEW_PROOF, request.certificate.body, request.time,
                                                               request.dht_public_key), "renew")
        if cert.peer_id in self.store.state.revoked:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, "this peer was revoked")
        return self._issue(cert.peer_id, cert.role, cert.stage, request.dht_public_key)

    def revoke(self, order: cpb.Signed) -> cpb.Signed:
        peer_id = self.issuer.authority.revoke_order(order)
        state = self.store.state
        if peer_id not in state.revoked:
            state.revoked[peer_id] = time.time()
            state.revocations_version += 1
            self.store.save()
            logger.warning("revoked %s (revocation list v%d)", peer_id, state.revocations_version)
        signed = self.revocations()
        self.on_revoke(signed)
        return signed

    def checkpoint_entry(self, request: cpb.CheckpointRequest):
        cert = self.issuer.authority.certificate(request.certificate)
        if abs(request.time - time.time()) > CLOCK_SKEW:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, "the request's time is far from ours (check the clocks)")
        check_proof(cert.peer_id, request.proof, proof_message(CHECKPOINT_PROOF, int(request.stage), request.time),
                    "checkpoint")
        if cert.peer_id in self.store.state.revoked:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, "this peer was revoked")
        entry = self.store.newest(int(request.stage))
        if entry is None:
            raise Refused(grpc.StatusCode.NOT_FOUND, f"no checkpoint of stage {request.stage} yet")
        return entry

    # gRPC ---------------------------------------------------------------------------------------
    async def _run(self, name: str, context: grpc.aio.ServicerContext, fn, *args):
        self.calls[name] = self.calls.get(name, 0) + 1
        try:
            return fn(*args)
        except CredentialError as e:
            code, reason = grpc.StatusCode.PERMISSION_DENIED, str(e)
        except Refused as e:
            code, reason = e.code, e.reason
        self.refusals[name] = self.refusals.get(name, 0) + 1
        logger.info("refused %s: %s", name, reason)
        await context.abort(code, reason)

    async def GetManifest(self, request, context):
        return self.signed_manifest

    async def Admit(self, request, context):
        return await self._run("Admit", context, self.admit, request)

    async def Renew(self, request, context):
        return await self._run("Renew", context, self.renew, request)

    async def Revoke(self, request, context):
        return await self._run("Revoke", context, self.revoke, request)

    async def GetRevocations(self, request, context):
        return self.revocations()

    async def ListCheckpoints(self, request, context):
        out = cpb.CheckpointList()
        for round_no in self.store.checkpoint_rounds():
            for entry in self.store.checkpoint(round_no).values():
                out.checkpoints.append(cpb.CheckpointInfo(
                    stage=entry.stage, round=entry.round, applied_rounds=entry.applied_rounds,
                    trained_samples=entry.trained_samples, digest=entry.file_sha256, time=entry.time))
        return out

    async def GetCheckpoint(self, request, context) -> AsyncIterator[cpb.CheckpointChunk]:
        entry = await self._run("GetCheckpoint", context, self.checkpoint_entry, request)
        info = cpb.CheckpointInfo(stage=entry.stage, round=entry.round, applied_rounds=entry.applied_rounds,
                                  trained_samples=entry.trained_samples, digest=entry.file_sha256, time=entry.time)
        with open(entry.path, "rb") as f:
            first = True
            while True:
                data = f.read(CHECKPOINT_CHUNK)
                if not data and not first:
                    return
                yield cpb.CheckpointChunk(info=info, data=data, signed_info=self.issuer.checkpoint(info)) \
                    if first else cpb.CheckpointChunk(data=data)
                first = False
