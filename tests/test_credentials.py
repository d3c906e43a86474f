"""Private-run credentials without a network: certificates, invitations, revocations, the signed
manifest, and the coordinator service's decisions over a real state dir."""
from __future__ import annotations

import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarmgrad.peer.private.admission import Admission
from swarmgrad.peer.private.credentials import (ADMIT_PROOF, REVOCATIONS, CredentialError,
                                                    Issuer, make_invitation, parse_duration, parse_invitation,
                                                    proof_message, revoke_order, sign)
from swarmgrad.peer.coordinator.service import CoordinatorService, Refused
from swarmgrad.peer.coordinator.store import StateDir
from swarmgrad.peer.private.dht_auth import AuthFiles, CertificateAuthorizer
from swarmgrad.peer.net.identity import peer_id_of
from swarmgrad.protocol import coordinator_pb2 as cpb

RUN = "private-run"


@pytest.fixture
def issuer() -> Issuer:
    return Issuer(Ed25519PrivateKey.generate(), RUN)


def test_certificate_round_trip_and_binding(issuer: Issuer) -> None:
    peer = Ed25519PrivateKey.generate()
    signed = issuer.certificate(peer_id_of(peer), ttl=60, serial=7, dht_public_key=b"rsa")
    cert = issuer.authority.certificate(signed, peer_id=peer_id_of(peer))
    assert (cert.peer_id, cert.role, cert.serial, cert.dht_public_key) == (peer_id_of(peer), "peer", 7, b"rsa")
    with pytest.raises(CredentialError, match="not"):  # presented by another peer id
        issuer.authority.certificate(signed, peer_id=peer_id_of(Ed25519PrivateKey.generate()))


def test_certificate_expiry(issuer: Issuer) -> None:
    signed = issuer.certificate(peer_id_of(Ed25519PrivateKey.generate()), ttl=10, serial=1, now=1000.0)
    issuer.authority.certificate(signed, now=1009.0)
    with pytest.raises(CredentialError, match="expired"):
        issuer.authority.certificate(signed, now=1010.5)


def test_tampered_and_foreign_certificates_refused(issuer: Issuer) -> None:
    peer_id = peer_id_of(Ed25519PrivateKey.generate())
    signed = issuer.certificate(peer_id, ttl=60, serial=1)
    body = cpb.CertificateBody.FromString(signed.body)
    body.expires_at += 1e6  # a longer life, same signature
    with pytest.raises(CredentialError, match="signature"):
        issuer.authority.certificate(cpb.Signed(body=body.SerializeToString(), signature=signed.signature))
    rogue = Issuer(Ed25519PrivateKey.generate(), RUN)  # another key, same run id
    with pytest.raises(CredentialError, match="signature"):
        issuer.authority.certificate(rogue.certificate(peer_id, ttl=60, serial=1))
    other_run = Issuer(issuer.key, "another-run")
    with pytest.raises(CredentialError, match="run"):
        issuer.authority.certificate(other_run.certificate(peer_id, ttl=60, serial=1))
    # a signature made for a revocation list is no certificate, even over the same bytes
    cross = sign(issuer.key, REVOCATIONS, cpb.CertificateBody.FromString(signed.body))
    with pytest.raises(CredentialError, match="signature"):
        issuer.authority.certificate(cross)
    with pytest.raises(CredentialError):
        issuer.authority.certificate(cpb.Signed(body=b"\xff" * 10, signature=b"x" * 64))


def test_invitation_string_round_trip_and_damage(issuer: Issuer) -> None:
    inv = make_invitation(issuer.key, RUN, "10.0.0.1:7000", expires_in=3600, stage=1)
    parsed = parse_invitation(inv.encode())
    assert (parsed.run_id, parsed.coordinator, parsed.coordinator_id, parsed.stage) == \
        (RUN, "10.0.0.1:7000", issuer.coordinator_id, 1)
    text = inv.encode()
    with pytest.raises(CredentialError):
        parse_invitation(text[:-6])
    with pytest.raises(CredentialError):
        parse_invitation("hello")
    expired = make_invitation(issuer.key, RUN, "h:1", expires_in=10, now=time.time() - 100)  # made long ago
    with pytest.raises(CredentialError, match="expired"):
        parse_invitation(expired.encode())


def test_revocations_and_manifest(issuer: Issuer) -> None:
    victim = peer_id_of(Ed25519PrivateKey.generate())
    rev = issuer.authority.revocations(issuer.revocations([victim], version=3))
    assert rev.version == 3 and victim in rev.peer_ids
    body = issuer.authority.manifest(issuer.manifest("run_id = 'x'", "abc"))
    assert body.manifest_hash == "abc"
    signed = issuer.manifest("run_id = 'x'", "abc")
    tampered = cpb.ManifestBody.FromString(signed.body)
    tampered.manifest_toml = "run_id = 'evil'"
    with pytest.raises(CredentialError):
        issuer.authority.manifest(cpb.Signed(body=tampered.SerializeToString(), signature=signed.signature))


def test_duration_parsing() -> None:
    assert parse_duration("7d") == 7 * 86400 and parse_duration("30m") == 1800 and parse_duration("45") == 45
    for bad in ("", "-1h", "soon", "infd"):
        with pytest.raises(ValueError):
            parse_duration(bad)


# ------------------------------------------------------------------ the service's decisions

def _service(issuer: Issuer, tmp_path, revoked=None) -> CoordinatorService:
    return CoordinatorService(issuer, StateDir(tmp_path / "state", RUN), "run_id = 'private-run'", "hash",
                              certificate_ttl=600, initial_peers=lambda: ["/ip4/127.0.0.1/tcp/1"],
                              on_revoke=(revoked or (lambda signed: None)))


def _admit_request(inv, peer: Ed25519PrivateKey, dht_key: bytes = b"rsa") -> cpb.AdmitRequest:
    proof = peer.sign(proof_message(ADMIT_PROOF, inv.signed.body, peer_id_of(peer), dht_key))
    return cpb.AdmitRequest(invitation=inv.signed, peer_id=peer_id_of(peer), dht_public_key=dht_key, proof=proof)


def test_admission_is_single_use_and_bound_to_the_key(issuer: Issuer, tmp_path) -> None:
    service = _service(issuer, tmp_path)
    inv = make_invitation(issuer.key, RUN, "h:1", expires_in=60)
    peer = Ed25519PrivateKey.generate()
    thief = Ed25519PrivateKey.generate()
    stolen = _admit_request(inv, peer)
    stolen.peer_id = peer_id_of(thief)  # replays the peer's proof under its own id
    with pytest.raises(CredentialError, match="proof"):
        service.admit(stolen)
    assert not service.store.state.spent_invitations  # a refused request spends nothing
    response = service.admit(_admit_request(inv, peer))
    cert = issuer.authority.certificate(response.certificate, peer_id=peer_id_of(peer))
    assert cert.dht_public_key == b"rsa" and list(response.initial_peers) == ["/ip4/127.0.0.1/tcp/1"]
    with pytest.raises(Refused, match="already used"):
        service.admit(_admit_request(inv, Ed25519PrivateKey.generate()))
    # the state survives a restart: the admitted peer and the spent invitation
    again = _service(issuer, tmp_path)
    assert peer_id_of(peer) in again.store.state.admitted
    with pytest.raises(Refused, match="already used"):
        again.admit(_admit_request(inv, Ed25519PrivateKey.generate()))
    with pytest.raises(ValueError, match="another"):
        StateDir(tmp_path / "state", "some-other-run")


def test_revocation_refuses_renewal_and_grows_the_list(issuer: Issuer, tmp_path) -> None:
    published = []
    service = _service(issuer, tmp_path, published.append)
    peer = Ed25519PrivateKey.generate()
    service.admit(_admit_request(make_invitation(issuer.key, RUN, "h:1", expires_in=60), peer))
    with pytest.raises(CredentialError):  # only the key holder orders a revocation
        service.revoke(revoke_order(Ed25519PrivateKey.generate(), RUN, peer_id_of(peer)))
    signed = service.revoke(revoke_order(issuer.key, RUN, peer_id_of(peer)))
    rev = issuer.authority.revocations(signed)
    assert rev.version == 1 and peer_id_of(peer) in rev.peer_ids and published == [signed]
    with pytest.raises(CredentialError, match="recent"):  # an old order replayed
        service.revoke(revoke_order(issuer.key, RUN, peer_id_of(peer), now=time.time() - 3600))
    with pytest.raises(Refused, match="revoked"):  # a revoked peer cannot come back with a new invitation
        service.admit(_admit_request(make_invitation(issuer.key, RUN, "h:1", expires_in=60), peer))
    assert _service(issuer, tmp_path).store.state.revocations_version == 1


def test_admission_gate(issuer: Issuer, tmp_path) -> None:
    import asyncio
    asyncio.run(_admission_gate(issuer, tmp_path))


async def _admission_gate(issuer: Issuer, tmp_path) -> None:
    me, other, stranger = (Ed25519PrivateKey.generate() for _ in range(3))
    authority = issuer.authority
    mine = authority.certificate(issuer.certificate(peer_id_of(me), ttl=600, serial=1))
    gate = Admission(authority=authority, certificate=mine, dht=None, files=AuthFiles(tmp_path / "auth"),
                     client=None, dht_public_key=b"", heartbeat=1.0, dht_timeout=1.0, lookup_backoff=1e9)
    gate.known[peer_id_of(other)] = authority.certificate(issuer.certificate(peer_id_of(other), ttl=600, serial=2))
    assert await gate.check(peer_id_of(other)) is None
    gate._looked_up[peer_id_of(stranger)] = 1e18  # no DHT here: the stranger is not looked up
    assert "no certificate" in await gate.check(peer_id_of(stranger))
    assert gate.adopt_revocations(authority.revocations(issuer.revocations([peer_id_of(other)], version=2)))
    assert "revoked" in await gate.check(peer_id_of(other))
    assert not gate.adopt_revocations(authority.revocations(issuer.revocations([], version=1)))  # older: ignored
    assert "revoked" in await gate.check(peer_id_of(other))
    assert (tmp_path / "auth" / "revoked.txt").read_text().split() == [peer_id_of(other)]
    assert gate.refused == 3  # the stranger once, the revoked peer twice
    assert not gate.self_revoked.is_set()
    assert gate.adopt_revocations(authority.revocations(issuer.revocations([peer_id_of(other), peer_id_of(me)],
                                                                           version=3)))
    assert gate.self_revoked.is_set()  # the daemon stops on this


def test_dht_authorizer_tokens(issuer: Issuer, tmp_path) -> None:
    from hivemind.utils.crypto import RSAPrivateKey
    rsa = RSAPrivateKey()
    peer = Ed25519PrivateKey.generate()
    files = AuthFiles(tmp_path / "auth")
    files.write_certificate(issuer.certificate(peer_id_of(peer), ttl=600, serial=1,
                                               dht_public_key=rsa.get_public_key().to_bytes()))
    authorizer = CertificateAuthorizer(issuer.coordinator_id, RUN, files.folder, rsa)
    import asyncio
    token = asyncio.run(authorizer.get_token())
    assert authorizer.is_token_valid(token)
    forged = type(token)()
    forged.CopyFrom(token)
    forged.public_key = RSAPrivateKey().get_public_key().to_bytes()  # someone else's DHT key
    assert not authorizer.is_token_valid(forged)
    rogue = Issuer(Ed25519PrivateKey.generate(), RUN)
    forged.CopyFrom(token)
    forged.signature = rogue.certificate(peer_id_of(peer), ttl=600, serial=1,
                                         dht_public_key=token.public_key).SerializeToString()
    assert not authorizer.is_token_valid(forged)
    files.write_revoked([peer_id_of(peer)])
    assert not authorizer.is_token_valid(token)


def test_renewal(issuer: Issuer, tmp_path) -> None:
    from swarmgrad.peer.private.credentials import RENEW_PROOF
    service = _service(issuer, tmp_path)
    peer = Ed25519PrivateKey.generate()
    admitted = service.admit(_admit_request(make_invitation(issuer.key, RUN, "h:1", expires_in=60), peer))
    old = issuer.authority.certificate(admitted.certificate)

    def request(key=peer, at=None, dht_key=b"rsa2"):
        at = time.time() if at is None else at
        proof = key.sign(proof_message(RENEW_PROOF, admitted.certificate.body, at, dht_key))
        return cpb.RenewRequest(certificate=admitted.certificate, time=at, dht_public_key=dht_key, proof=proof)

    new = issuer.authority.certificate(service.renew(request()).certificate, peer_id=peer_id_of(peer))
    assert new.serial > old.serial and new.dht_public_key == b"rsa2" and new.expires_at >= old.expires_at
    with pytest.raises(CredentialError, match="proof"):  # someone holding a copy of the certificate, not the key
        service.renew(request(key=Ed25519PrivateKey.generate()))
    with pytest.raises(Refused, match="clock"):  # an old renewal replayed
        service.renew(request(at=time.time() - 3600))
    service.revoke(revoke_order(issuer.key, RUN, peer_id_of(peer)))
    with pytest.raises(Refused, match="revoked"):
        service.renew(request())


def test_checkpoint_plan_waits_for_every_stage_and_the_majority() -> None:
    from swarmgrad.peer.coordinator.checkpoints import checkpoint_plan
    from swarmgrad.peer.records import PeerRecord

    def rec(peer: str, stage: int, digest: str, applied: int, state: str = "online") -> PeerRecord:
        return PeerRecord(peer_id=peer, stage=stage, state=state, throughput=1.0, round=applied, applied_rounds=applied,
                          digest=digest, manifest_hash="h", driver=stage == 0)

    view = {0: [rec("a", 0, "x", 4), rec("b", 0, "x", 4), rec("c", 0, "evil", 99)],
            1: [rec("d", 1, "y", 5), rec("e", 1, "y", 5, state="joining")]}
    round, plan = checkpoint_plan(view, 2, None, every=2)
    assert round == 4  # the least advanced stage's majority; the lone claim of 99 rounds counts for nothing
    assert plan == {0: ("x", ["a", "b"]), 1: ("y", ["d"])}
    assert checkpoint_plan(view, 2, last_round=3, every=2) is None  # not 2 rounds since the last one
    assert checkpoint_plan(view, 2, last_round=2, every=2)[0] == 4
    assert checkpoint_plan({0: view[0]}, 2, None, every=2) is None  # a stage with nobody online
    assert checkpoint_plan(view, 2, None, every=5) is None


def test_checkpoint_store_keeps_the_newest(tmp_path) -> None:
    store = StateDir(tmp_path, RUN, keep_checkpoints=2)
    info = {"round": 1, "applied_rounds": 1, "trained_samples": 8, "digest": "d"}
    for round_no in (2, 4, 6):
        store.write_checkpoint(round_no, {0: (b"zero", info), 1: (b"one", info)}, "run_id = 'x'", 2)
    assert store.checkpoint_rounds() == [4, 6]
    assert store.newest(1).round == 1 and store.newest(1).path.read_bytes() == b"one"
    (tmp_path / "checkpoints" / "round-00000008").mkdir()  # a crash before the index: not a checkpoint
    assert store.checkpoint_rounds() == [4, 6]
    assert store.newest(7) is None


def test_a_certificates_stage_is_enforced(issuer: Issuer, tmp_path) -> None:
    """An invitation with `--stage 1` admits its peer to stage 1 only (issue 43, point 8): every
    admitted peer ignores its stage records and round registrations under any other stage, so
    nobody routes to it or averages with it there. On main the stage was carried and never read."""
    import asyncio
    from swarmgrad.peer.manifest import load
    from swarmgrad.peer.records import PeerRecord
    from tests.support.dht import MemoryDHT, swarm_view

    me, pinned = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    authority = issuer.authority
    gate = Admission(authority=authority, certificate=authority.certificate(issuer.certificate(peer_id_of(me), ttl=600,
                                                                                                serial=1)),
                     dht=None, files=None, client=None, dht_public_key=b"", heartbeat=1.0, dht_timeout=1.0)
    pid = peer_id_of(pinned)
    gate.known[pid] = authority.certificate(issuer.certificate(pid, stage=1, ttl=600, serial=2))
    assert gate.admitted(pid) and gate.admitted(pid, 1)
    assert not gate.admitted(pid, 0) and "stage 1 only" in gate.reason(pid, stage=0)
    assert gate.admitted(peer_id_of(me), 0)  # a certificate without a stage admits to any

    async def scenario() -> None:
        manifest = load("peer/defaults/tiny-gpt.toml")
        dht = MemoryDHT()
        theirs, mine = swarm_view(dht, pid, manifest), swarm_view(dht, peer_id_of(me), manifest)
        mine.admitted = gate.admitted
        for stage in (0, 1):
            await theirs.announce(PeerRecord(peer_id=pid, stage=stage, state="online", throughput=1.0, round=0,
                                             applied_rounds=0, digest="d", manifest_hash=manifest.hash, driver=False))
            await theirs.register_round(stage, 3, pid, {"digest": "d", "applied_rounds": 0, "weight": 1.0})
        assert [r.peer_id for r in await mine.stage_records(0)] == []
        assert [r.peer_id for r in await mine.stage_records(1)] == [pid]
        assert list(await mine.round_registrations(0, 3)) == []
        assert list(await mine.round_registrations(1, 3)) == [pid]
    asyncio.run(scenario())


def test_checkpoints_from_the_coordinator_are_signed(issuer: Issuer) -> None:
    """The checkpoint stream is plain gRPC, and its sha256 came on the same stream as the bytes:
    whoever sat on the path (or answered at the coordinator's address) could send any state with a
    matching digest, and on main the peer restored an emptied stage from it. Now the first chunk
    carries the info signed by the coordinator key the peer trusts (from its invitation), and the
    bytes must hash to the signed digest."""
    import hashlib
    from swarmgrad.peer.private.coordinator_client import CoordinatorClient

    peer = Ed25519PrivateKey.generate()
    good, forged = b"theta of stage 1", b"the attacker's weights"

    def info(data: bytes, stage: int = 1) -> cpb.CheckpointInfo:
        return cpb.CheckpointInfo(stage=stage, round=7, applied_rounds=7, trained_samples=64,
                                  digest=hashlib.sha256(data).hexdigest(), time=time.time())

    class Stub:
        def __init__(self, chunks: list[cpb.CheckpointChunk]):
            self.chunks = chunks

        def GetCheckpoint(self, request, timeout=None):  # noqa: N802 (gRPC's name)
            return iter(self.chunks)

    def fetch(chunks: list[cpb.CheckpointChunk]):
        client = CoordinatorClient("127.0.0.1:1", issuer.authority, peer)
        client._stub = Stub(chunks)
        try:
            return client.checkpoint(1, cpb.Signed(), max_bytes=1 << 20)
        finally:
            client.close()

    signed = issuer.checkpoint(info(good))
    got_info, data = fetch([cpb.CheckpointChunk(info=info(good), data=good[:5], signed_info=signed),
                            cpb.CheckpointChunk(data=good[5:])])
    assert data == good and got_info.round == 7
    with pytest.raises(CredentialError):  # forged bytes with their own digest, unsigned (main's stream)
        fetch([cpb.CheckpointChunk(info=info(forged), data=forged)])
    with pytest.raises(CredentialError, match="signature"):  # signed by another key
        other = Issuer(Ed25519PrivateKey.generate(), RUN)
        fetch([cpb.CheckpointChunk(info=info(forged), data=forged, signed_info=other.checkpoint(info(forged)))])
    with pytest.raises(CredentialError, match="digest"):  # the coordinator's signed info, other bytes
        fetch([cpb.CheckpointChunk(info=info(forged), data=forged, signed_info=signed)])
    with pytest.raises(CredentialError, match="not 'private-run'"):
        fetch([cpb.CheckpointChunk(data=good, signed_info=Issuer(issuer.key, "other-run").checkpoint(info(good)))])
    with pytest.raises(CredentialError, match="another stage"):
        fetch([cpb.CheckpointChunk(data=good, signed_info=issuer.checkpoint(info(good, stage=2)))])
