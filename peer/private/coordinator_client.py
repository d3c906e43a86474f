"""A peer's calls to the coordinator of a private run: admission, renewal, revocations, checkpoints.

Blocking gRPC calls, each with a deadline; async code runs them in a thread. Everything the
coordinator returns is checked against the coordinator id the peer got from its invitation (or
its saved certificate), never against what the coordinator says about itself.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf.message import DecodeError

from swarmgrad.peer.private.credentials import (ADMIT_PROOF, CHECKPOINT_PROOF, RENEW_PROOF, Authority, Certificate,
                                                    CredentialError, Invitation, Revocations, proof_message)
from swarmgrad.peer.net.identity import peer_id_of
from swarmgrad.protocol import coordinator_pb2 as cpb
from swarmgrad.protocol import coordinator_pb2_grpc as cgrpc

MAX_GRPC_MESSAGE = 64 << 20
"""Largest gRPC message either side accepts (checkpoints stream in chunks well below it)."""
CHECKPOINT_CHUNK = 4 << 20


class CoordinatorUnavailable(RuntimeError):
    """The coordinator did not answer (down, unreachable, or refused): the caller decides whether
    that matters (joining: yes; renewing or restoring: try again later)."""


@dataclass(frozen=True)
class Admitted:
    certificate: Certificate
    manifest_toml: str
    manifest_hash: str
    revocations: Revocations | None
    initial_peers: tuple[str, ...]


def channel_options() -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", MAX_GRPC_MESSAGE), ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE)]


def served_run_id(address: str, coordinator_id: str, timeout: float = 10.0) -> str:
    """The run id of the manifest the coordinator at `address` serves, checked to be signed by
    `coordinator_id` (before a client exists: an Authority needs the run id). Raises
    CoordinatorUnavailable or CredentialError."""
    with grpc.insecure_channel(address, options=channel_options()) as channel:
        try:
            signed = cgrpc.CoordinatorStub(channel).GetManifest(cpb.Empty(), timeout=timeout)
        except grpc.RpcError as e:
            raise CoordinatorUnavailable(f"coordinator {address}: GetManifest: {e.code().name}") from None
    try:
        run_id = cpb.ManifestBody.FromString(signed.body).run_id
    except DecodeError:  # not a manifest body
        raise CredentialError("the coordinator's manifest does not parse") from None
    Authority(coordinator_id, run_id).manifest(signed)  # signed by that key, or CredentialError
    return run_id


class CoordinatorClient:
    def __init__(self, address: str, authority: Authority, key: Ed25519PrivateKey, timeout: float = 10.0):
        self.address = address
        self.authority = authority
        self.key = key
        self.peer_id = peer_id_of(key)
        self.timeout = timeout
        self._channel = grpc.insecure_channel(address, options=channel_options())
        self._stub = cgrpc.CoordinatorStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: str, request, timeout: float | None = None):
        try:
            return getattr(self._stub, method)(request, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise CoordinatorUnavailable(f"coordinator {self.address}: {method}: {e.code().name}: {e.details()}") \
                from None

    def _admitted(self, response: cpb.AdmitResponse) -> Admitted:
        cert = self.authority.certificate(response.certificate, peer_id=self.peer_id)
        manifest = self.authority.manifest(response.manifest)
        revocations = self.authority.revocations(response.revocations) if response.revocations.body else None
        peers = tuple(str(p)[:256] for p in response.initial_peers[:8])
        return Admitted(cert, manifest.manifest_toml, manifest.manifest_hash, revocations, peers)

    def admit(self, invitation: Invitation, dht_public_key: bytes) -> Admitted:
        proof = self.key.sign(proof_message(ADMIT_PROOF, invitation.signed.body, self.peer_id, dht_public_key))
        response = self._call("Admit", cpb.AdmitRequest(invitation=invitation.signed, peer_id=self.peer_id,
                                                        dht_public_key=dht_public_key, proof=proof))
        return self._admitted(response)

    def renew(self, certificate: cpb.Signed, dht_public_key: bytes) -> Admitted:
        now = time.time()
        proof = self.key.sign(proof_message(RENEW_PROOF, certificate.body, now, dht_public_key))
        return self._admitted(self._call("Renew", cpb.RenewRequest(certificate=certificate, time=now,
                                                                   dht_public_key=dht_public_key, proof=proof)))

    def manifest(self) -> cpb.ManifestBody:
        return self.authority.manifest(self._call("GetManifest", cpb.Empty()))

    def revocations(self) -> Revocations:
        return self.authority.revocations(self._call("GetRevocations", cpb.Empty()))

    def revoke(self, order: cpb.Signed) -> Revocations:
        return self.authority.revocations(self._call("Revoke", order))

    def checkpoints(self) -> list[cpb.CheckpointInfo]:
        return list(self._call("ListCheckpoints", cpb.Empty()).checkpoints)

    def checkpoint(self, stage: int, certificate: cpb.Signed, max_bytes: int) -> tuple[cpb.CheckpointInfo, bytes] | None:
        """The newest checkpoint of `stage` (its info and safetensors bytes), or None if the
        coordinator has none. The info must be signed by the coordinator key this client trusts
        (its Authority, from the invitation) and the bytes must hash to the signed digest: the
        stream itself is plain gRPC, so whoever sits on the path could send other bytes with a
        matching digest. Raises CoordinatorUnavailable or CredentialError."""
        now = time.time()
        proof = self.key.sign(proof_message(CHECKPOINT_PROOF, stage, now))
        request = cpb.CheckpointRequest(stage=stage, certificate=certificate, time=now, proof=proof)
        info, parts, size = None, [], 0
        try:
            for chunk in self._stub.GetCheckpoint(request, timeout=self.timeout * 6):
                if info is None:
                    if not chunk.HasField("signed_info"):
                        raise CredentialError("checkpoint stream does not start with its signed info")
                    info = self.authority.checkpoint(chunk.signed_info)
                size += len(chunk.data)
                if size > max_bytes:
                    raise CredentialError(f"checkpoint larger than {max_bytes} bytes")
                parts.append(chunk.data)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise CoordinatorUnavailable(f"coordinator {self.address}: GetCheckpoint: {e.code().name}: "
                                         f"{e.details()}") from None
        if info is None:
            return None
        data = b"".join(parts)
        if hashlib.sha256(data).hexdigest() != info.digest:
            raise CredentialError("checkpoint bytes do not match their digest")
        if info.stage != stage:
            raise CredentialError("checkpoint is of another stage")
        return info, data
