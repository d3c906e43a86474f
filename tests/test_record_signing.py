"""Records cannot be forged: the Ed25519 record signer (pure), the identity files, and a small live
swarm of DHTs where a forger writes on behalf of an honest peer and the honest peers never see it."""
from __future__ import annotations

import asyncio
import dataclasses
import math
import pickle
import random
from pathlib import Path

import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p.p2p_daemon import P2P

from swarmgrad.peer.net.identity import (IdentityError, is_peer_id, key_file_bytes, key_from_file_bytes,
                                     load_or_create, peer_id_of, public_key_of, write_key_file)
from swarmgrad.peer.net.record_signing import (ENVELOPE_BYTES, MAGIC, MAX_CLOCK_SKEW, MAX_RECORD_TTL,
                                           SignedRecordValidator, subkey_bytes)
from swarmgrad.peer.net.dht_view import SwarmView, agreed_epoch
from swarmgrad.peer.records import PeerRecord, round_key, stage_key

NOW = 1_000_000.0


def clock() -> float:
    return NOW


def validator(key: Ed25519PrivateKey | None = None) -> SignedRecordValidator:
    return SignedRecordValidator(key, clock=clock)


def record(key: Ed25519PrivateKey, value: bytes = msgpack.packb({"stage": 1}), *, subkey: str | None = None,
           expiration: float = NOW + 15.0, dht_key: str = "run/stage/1") -> DHTRecord:
    """A record as hivemind hands it to sign_value: key id, serialized subkey and value."""
    return DHTRecord(DHTID.generate(source=dht_key).to_bytes(), subkey_bytes(subkey or peer_id_of(key)),
                     value, expiration)


def signed(key: Ed25519PrivateKey, **kwargs) -> DHTRecord:
    rec = record(key, **kwargs)
    return dataclasses.replace(rec, value=validator(key).sign_value(rec))


# ---- pure: the signer --------------------------------------------------------------------------

def test_sign_verify_strip_round_trip() -> None:
    key = Ed25519PrivateKey.generate()
    rec = record(key)
    signed_value = validator(key).sign_value(rec)
    assert len(signed_value) == len(rec.value) + ENVELOPE_BYTES
    out = dataclasses.replace(rec, value=signed_value)
    reader = validator()  # a read-only client verifies with the peer id alone
    assert reader.refusal(out) is None and reader.validate(out)
    assert reader.strip_value(out) == rec.value
    assert reader.sign_value(rec) == rec.value  # no key: signs nothing


def test_tampered_records_are_refused() -> None:
    key = Ed25519PrivateKey.generate()
    good = signed(key)
    v = validator()
    tampered = {
        "value": dataclasses.replace(good, value=b"\x81\xa5stage\x02" + good.value[-ENVELOPE_BYTES:]),
        "value bit": dataclasses.replace(good, value=bytes([good.value[0] ^ 1]) + good.value[1:]),
        "later expiry": dataclasses.replace(good, expiration_time=good.expiration_time + 1),
        "another key (round)": dataclasses.replace(good, key=DHTID.generate(source="run/stage/0").to_bytes()),
        "signature bit": dataclasses.replace(good, value=good.value[:-1] + bytes([good.value[-1] ^ 1])),
    }
    for name, rec in tampered.items():
        assert not v.validate(rec), name


def test_a_record_for_another_peer_is_refused() -> None:
    honest, forger = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    # the forger's signer leaves a record under another peer's subkey unsigned...
    rec = record(forger, subkey=peer_id_of(honest))
    assert validator(forger).sign_value(rec) == rec.value
    assert "not signed" in validator().refusal(rec)
    # ...and a signature made with the forger's key does not verify against the subkey's peer id
    forged = dataclasses.replace(rec, value=rec.value + MAGIC + forger.sign(b"anything"))
    assert "signature" in validator().refusal(forged)
    from swarmgrad.peer.net.record_signing import signed_message
    forged = dataclasses.replace(rec, value=rec.value + MAGIC + forger.sign(signed_message(rec)))
    assert "signature" in validator().refusal(forged)
    # a valid record moved to another peer's subkey
    good = signed(honest)
    assert not validator().validate(dataclasses.replace(good, subkey=subkey_bytes(peer_id_of(forger))))


def test_expiry_is_capped() -> None:
    key = Ed25519PrivateKey.generate()
    cap = NOW + MAX_RECORD_TTL + MAX_CLOCK_SKEW
    assert validator().validate(signed(key, expiration=cap))
    assert "expires" in validator().refusal(signed(key, expiration=cap + 1))
    assert "expires" in validator().refusal(signed(key, expiration=NOW + 365 * 86400))
    for bad in (math.inf, math.nan, -math.inf):
        assert not validator().validate(signed(key, expiration=bad))
    with pytest.raises(ValueError, match="max_ttl"):
        SignedRecordValidator(max_ttl=math.inf)


def test_subkeys_that_are_not_ed25519_peer_ids_are_refused() -> None:
    key = Ed25519PrivateKey.generate()
    good = signed(key)
    peer_id = peer_id_of(key)
    rsa_id = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    subkeys = {
        "plain value (no subkey)": msgpack.packb(None),
        "dictionary tag": b"",
        "a word": msgpack.packb("hello"),
        "an int": msgpack.packb(7),
        "bytes": msgpack.packb(peer_id.encode(), use_bin_type=True),
        "RSA peer id": msgpack.packb(rsa_id),
        "str16 encoding of the id": b"\xda\x00\x34" + peer_id.encode(),
        "trailing bytes": subkey_bytes(peer_id) + b"\x00",
        "one char off": subkey_bytes(peer_id[:-1] + ("A" if peer_id[-1] != "A" else "B")),
        "huge": msgpack.packb("x" * 10_000),
    }
    for name, subkey in subkeys.items():
        assert not validator().validate(dataclasses.replace(good, subkey=subkey)), name
    assert not is_peer_id(rsa_id) and not is_peer_id(None) and is_peer_id(peer_id)


def test_garbage_never_raises_and_is_refused() -> None:
    key = Ed25519PrivateKey.generate()
    good = signed(key)
    v = validator()
    rng = random.Random(0)
    cases = [
        dataclasses.replace(good, value=b""),
        dataclasses.replace(good, value=MAGIC),
        dataclasses.replace(good, value=b"\x00" * ENVELOPE_BYTES),
        dataclasses.replace(good, value=MAGIC + b"\x00" * 64),
        dataclasses.replace(good, value=good.value[:-ENVELOPE_BYTES]),
        dataclasses.replace(good, value=None),
        dataclasses.replace(good, subkey=None),
        dataclasses.replace(good, key=None),
        dataclasses.replace(good, expiration_time="soon"),
        dataclasses.replace(good, expiration_time=None),
    ]
    for _ in range(300):
        n = rng.randrange(0, 200)
        cases.append(DHTRecord(rng.randbytes(20), rng.choice([rng.randbytes(rng.randrange(60)), good.subkey]),
                               rng.choice([rng.randbytes(n), good.value[:n] + rng.randbytes(3)]),
                               rng.choice([NOW, NOW + 10, -1.0, 1e308])))
    for rec in cases:
        assert v.validate(rec) is False
        v.strip_value(rec) if isinstance(rec.value, bytes) else None  # strip never raises on bytes


def test_validator_pickles_with_its_key() -> None:
    key = Ed25519PrivateKey.generate()
    copy = pickle.loads(pickle.dumps(SignedRecordValidator(key)))
    rec = record(key, expiration=NOW)
    out = dataclasses.replace(rec, value=copy.sign_value(rec))
    assert validator().validate(out) and copy.peer_id == peer_id_of(key)


# ---- pure: identities and the epoch rule -------------------------------------------------------

def test_identity_files(tmp_path: Path) -> None:
    key = load_or_create(tmp_path / "id.key")  # created: Ed25519, owner-only
    assert (tmp_path / "id.key").stat().st_mode & 0o077 == 0
    again = load_or_create(tmp_path / "id.key")
    assert peer_id_of(again) == peer_id_of(key) and peer_id_of(key).startswith("12D3KooW")
    assert public_key_of(peer_id_of(key)).public_bytes_raw() == key.public_key().public_bytes_raw()
    assert peer_id_of(key_from_file_bytes(key_file_bytes(key))) == peer_id_of(key)
    P2P.generate_identity(str(tmp_path / "rsa.key"))  # hivemind's own (RSA) key file
    with pytest.raises(IdentityError, match="RSA"):
        load_or_create(tmp_path / "rsa.key")
    (tmp_path / "junk").write_bytes(b"\xff" * 100)
    with pytest.raises(IdentityError):
        load_or_create(tmp_path / "junk")
    with pytest.raises(IdentityError, match="does not exist"):
        load_or_create(tmp_path / "missing" / "id.key")
    bad = bytearray(key_file_bytes(key))
    bad[-1] ^= 1  # public half does not match the seed
    with pytest.raises(IdentityError, match="match"):
        key_from_file_bytes(bytes(bad))


def test_agreed_epoch_is_the_plurality_then_the_earliest() -> None:
    assert agreed_epoch([]) is None
    assert agreed_epoch([100.0]) == 100.0
    assert agreed_epoch([100.0, 100.0, 5.0]) == 100.0  # one stranger with an earlier epoch is outvoted
    assert agreed_epoch([100.0, 90.0]) == 90.0  # two peers opening a swarm at once agree on the earlier


# ---- live: honest peers, a forger, and a read-only client --------------------------------------

class ForgingValidator(SignedRecordValidator):
    """A hostile peer's validator: signs every record with its own key (whatever the subkey),
    except under `unsigned` keys, and accepts everything itself."""

    def __init__(self, key: Ed25519PrivateKey, unsigned: set[bytes]):
        super().__init__(key)
        self.unsigned = unsigned

    def sign_value(self, record: DHTRecord) -> bytes:
        if record.key in self.unsigned:
            return record.value
        from swarmgrad.peer.net.record_signing import signed_message
        return record.value + MAGIC + self._private_key.sign(signed_message(record))

    def validate(self, record: DHTRecord) -> bool:
        return True


def honest_record(peer_id: str, stage: int = 0, throughput: float = 3.0) -> PeerRecord:
    return PeerRecord(peer_id=peer_id, stage=stage, state="online", throughput=throughput, round=0,
                      applied_rounds=0, digest="d", manifest_hash="h", driver=stage == 0)


@pytest.mark.timeout(90)
def test_forged_records_never_reach_honest_peers(p2p_daemons: None, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from hivemind.utils import get_dht_time

    from swarmgrad.peer.cli.peer import start_dht
    from swarmgrad.peer.net.dht_process import start_dht_process
    from swarmgrad.peer.cli.status import print_status
    run = "forge-run"
    loopback = ["/ip4/127.0.0.1/tcp/0"]
    dhts = []
    try:
        a = start_dht([], loopback, [], None, 30.0)  # a fresh key in a temp folder
        dhts.append(a)
        maddrs = [str(m) for m in a.get_visible_maddrs()]
        b = start_dht(maddrs, loopback, [], str(tmp_path / "b.key"), 30.0)  # --identity PATH, created
        dhts.append(b)
        assert str(b.peer_id) == peer_id_of(load_or_create(tmp_path / "b.key"))
        epoch_key_id = DHTID.generate(source=f"{run}/epoch").to_bytes()
        forger_key = Ed25519PrivateKey.generate()
        write_key_file(tmp_path / "f.key", forger_key)  # the forger's own signatures are its peer id's
        f = start_dht_process(initial_peers=maddrs, host_maddrs=loopback, identity_path=str(tmp_path / "f.key"),
                              check_if_identity_free=False, record_validators=[ForgingValidator(forger_key, {epoch_key_id})])
        dhts.append(f)
        id_a, id_b, id_f = str(a.peer_id), str(b.peer_id), str(f.peer_id)

        async def scenario() -> dict:
            view_a, view_b = (SwarmView(d, run, "h", 2, timeout=10.0, ttl=30.0) for d in (a, b))
            assert await view_a.announce(honest_record(id_a))
            epoch = await view_a.epoch()
            assert await view_b.epoch() == epoch
            assert await view_b.refresh_epoch(epoch)
            # a swarm resuming from round R writes an epoch R rounds back; the next one agrees
            resume_a, resume_b = (SwarmView(d, "resume-run", "h", 2, timeout=10.0, ttl=30.0) for d in (a, b))
            origin = get_dht_time() - 40.0
            assert await resume_a.epoch(origin=origin) == origin
            assert await resume_b.epoch(origin=get_dht_time() - 999.0) == origin
            assert [r.peer_id for r in await view_b.stage_records(0)] == [id_a]  # honest records travel
            assert await view_b.register_round(0, 3, id_b, {"digest": "d", "applied_rounds": 0, "weight": 8.0})
            with pytest.raises(ValueError, match="only its own"):
                await view_b.register_round(0, 3, id_a, {"digest": "d", "applied_rounds": 0, "weight": 8.0})

            exp = get_dht_time() + 30.0  # within the read cap: only the signature check stops these
            forged = honest_record(id_a, throughput=999.0).to_value()
            stores = [
                f.store(stage_key(run, 0), forged, exp, subkey=id_a, return_future=True),  # signed by f as a
                f.store(stage_key(run, 0), honest_record(id_b).to_value(), exp, subkey=id_b, return_future=True),
                f.store(round_key(run, 0, 3), {"digest": "evil", "applied_rounds": 0, "weight": 1e6}, exp,
                        subkey=id_b, return_future=True),
                f.store(round_key(run, 0, 3), {"digest": "evil", "applied_rounds": 0, "weight": 1.0}, exp,
                        subkey=id_a, return_future=True),
                f.store(f"{run}/epoch", 1.0, exp, return_future=True),  # unsigned, plain value (the old way)
                f.store(f"{run}/epoch", 2.0, exp, subkey=id_a, return_future=True),  # unsigned, a's subkey
            ]
            for store in stores:
                await asyncio.wait_for(store, 10)
            # f's own entries are signed by f and valid, but with an expiry beyond the cap: refused
            pinned = f.store(stage_key(run, 1), honest_record(id_f, stage=1).to_value(), get_dht_time() + 86400,
                             subkey=id_f, return_future=True)
            await asyncio.wait_for(pinned, 10)
            # an epoch of f's own: properly signed, but outvoted by a and b
            assert peer_id_of(forger_key) == id_f
            await asyncio.wait_for(f.store(f"{run}/epoch", epoch - 1000.0, get_dht_time() + 60, subkey=id_f,
                                           return_future=True), 10)
            out = {"epoch": epoch}
            for name, view in (("a", view_a), ("b", view_b)):
                out[name] = {"stage0": await view.stage_records(0), "stage1": await view.stage_records(1),
                             "regs": await view.round_registrations(0, 3), "epoch": await view.epoch(),
                             "raw_epoch": await asyncio.wait_for(view.dht.get(f"{run}/epoch", latest=True,
                                                                              return_future=True), 10)}
            return out

        out = asyncio.run(asyncio.wait_for(scenario(), 60))
        for name in ("a", "b"):
            seen = out[name]
            assert [(r.peer_id, r.throughput) for r in seen["stage0"]] == [(id_a, 3.0)], name
            assert seen["stage1"] == [], name
            assert list(seen["regs"]) == [id_b] and seen["regs"][id_b]["digest"] == "d", name
            assert seen["epoch"] == out["epoch"], name
            raw = seen["raw_epoch"].value
            assert isinstance(raw, dict) and set(raw) <= {id_a, id_b, id_f}, name
            assert all(item.value not in (1.0, 2.0) for item in raw.values()), name
        # the read-only client (swarmgrad status) verifies too, and shows the honest record alone
        assert print_status(maddrs, run, None, False, 20.0) == 0
        table = capsys.readouterr().out
        assert id_a in table and "999" not in table and id_b not in table and id_f not in table
    finally:
        for dht in reversed(dhts):
            dht.shutdown()
