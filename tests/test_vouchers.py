"""Vouchers (peer/net/vouchers.py): the owner key of a public run vouching for a peer id, checked at
the boundary by every reader; carried in the peer's own stage record and marked `vouched` by the
reader's SwarmView (docs/trust.md, "Anchors: voices the owner vouches for")."""
from __future__ import annotations

import random
import re
import time
from pathlib import Path

import msgpack
import pytest

from swarmgrad.peer.net.identity import fingerprint, peer_id_of
from swarmgrad.peer.net.vouchers import (DOMAIN, MAX_VOUCHER_BYTES, OwnVoucher, VoucherBook, VoucherRefused,
                                         check_voucher, read_voucher, sign_voucher, voucher_from_text,
                                         voucher_text)
from swarmgrad.peer.records import ONLINE, PeerRecord

from support.swarm import peer_keys

OWNER, STRANGER = peer_keys(2, "voucher-owner")
PEER, OTHER = (peer_id_of(k) for k in peer_keys(2, "voucher-peers"))
RUN = f"tiny@{fingerprint(OWNER)}"
NOW = 1_000_000.0


def test_a_voucher_holds_for_its_run_and_peer_until_it_expires() -> None:
    blob = sign_voucher(OWNER, RUN, PEER, NOW + 60, manifest_hash="ab" * 32)
    assert len(blob) <= MAX_VOUCHER_BYTES
    v = check_voucher(blob, RUN, PEER, NOW, "ab" * 32)
    assert (v.owner_id, v.run_id, v.peer_id, v.expires_at) == (peer_id_of(OWNER), RUN, PEER, NOW + 60)
    assert check_voucher(sign_voucher(OWNER, RUN, PEER, NOW + 60), RUN, PEER, NOW, "cd" * 32)  # "": any manifest
    assert voucher_from_text(voucher_text(blob)) == blob


@pytest.mark.parametrize("case, reason", [
    ("expired", "expired"), ("other peer", "for peer"), ("other run", "for run"),
    ("other manifest", "for manifest"), ("forged", "not signed by the owner key"),
    ("altered", "forged or altered"), ("malformed", "not a voucher"), ("oversize", "not a voucher"),
    ("private run", "not a public run"),
])
def test_a_voucher_is_refused_with_a_reason(case: str, reason: str) -> None:
    good = sign_voucher(OWNER, RUN, PEER, NOW + 60, manifest_hash="ab" * 32)
    run, peer, manifest = RUN, PEER, "ab" * 32
    blob: object = good
    if case == "expired":
        blob = sign_voucher(OWNER, RUN, PEER, NOW - 1)
    elif case == "other peer":
        peer = OTHER
    elif case == "other run":
        run = f"other@{fingerprint(OWNER)}"
    elif case == "other manifest":
        manifest = "cd" * 32
    elif case == "forged":  # a stranger's key signing for the run: its fingerprint is not the run id's
        body = msgpack.packb([peer_id_of(STRANGER), RUN, "", PEER, NOW + 60], use_bin_type=True)
        blob = msgpack.packb([1, body, STRANGER.sign(DOMAIN + body)], use_bin_type=True)
    elif case == "altered":  # the owner's signature over other fields (a later expiry)
        _, body, signature = read_voucher(good)
        fields = msgpack.unpackb(body)
        fields[4] = NOW + 10 ** 6
        blob = msgpack.packb([1, msgpack.packb(fields, use_bin_type=True), signature], use_bin_type=True)
    elif case == "malformed":
        blob = b"\x93\x01\xc4\x03abc\xc4\x02no"
    elif case == "oversize":
        blob = good + b"\0" * MAX_VOUCHER_BYTES
    elif case == "private run":
        run = "tiny"
    with pytest.raises(VoucherRefused, match=reason):
        check_voucher(blob, run, peer, NOW, manifest)


def test_any_bytes_are_a_voucher_or_a_refusal() -> None:
    rng = random.Random(7)
    good = sign_voucher(OWNER, RUN, PEER, NOW + 60)
    samples = [bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 300))) for _ in range(300)]
    samples += [good[:n] + bytes([good[n] ^ 0x55]) + good[n + 1:] for n in range(0, len(good), 7)]
    samples.append(bytearray(good))  # type: ignore[arg-type]
    samples += [msgpack.packb(v) for v in ([1, {(1, 2): 3}, b"x" * 64], [1, msgpack.packb([1] * 5), b"s" * 64],
                                          [1, msgpack.packb(["a", "b", "c", "d", float("nan")]), b"s" * 64])]
    for blob in samples:
        try:
            check_voucher(blob, RUN, PEER, NOW)
        except VoucherRefused:
            continue
        assert blob == good


def test_only_the_owner_key_signs_vouchers_of_its_run() -> None:
    with pytest.raises(ValueError, match="not the owner key"):
        sign_voucher(STRANGER, RUN, PEER, NOW + 60)
    with pytest.raises(VoucherRefused, match="not a voucher file"):
        voucher_from_text("hello")


def test_an_owner_peer_signs_its_own_voucher_again_before_it_expires() -> None:
    own = OwnVoucher(owner_key=OWNER, run_id=RUN, peer_id=PEER, lifetime=100.0)
    first = own.current(NOW)
    assert check_voucher(first, RUN, PEER, NOW + 99).expires_at == NOW + 100
    assert own.current(NOW + 40) == first
    assert check_voucher(own.current(NOW + 60), RUN, PEER, NOW + 150).expires_at == NOW + 160
    given = OwnVoucher(sign_voucher(OWNER, RUN, PEER, NOW + 10))
    assert given.current(NOW) and given.current(NOW + 11) == b""  # expired: announced without one


def test_the_book_verifies_each_voucher_once_and_a_flood_within_a_budget() -> None:
    book = VoucherBook(RUN, budget=4, rng=random.Random(0))
    anchor = (PEER, sign_voucher(OWNER, RUN, PEER, NOW + 60))
    flood = [(peer_id_of(k), sign_voucher(OWNER, RUN, PEER, NOW + 60)) for k in peer_keys(20, "flood")]  # copied
    reads = 0
    while PEER not in book.vouched([anchor] + flood, NOW):
        reads += 1
        assert reads < 20
    assert book.verified <= 4 * (reads + 1)
    checked = book.verified
    assert book.vouched([anchor], NOW) == {PEER} and book.verified == checked  # remembered
    assert book.vouched([anchor], NOW + 61) == set()  # expired since
    assert all("for peer" in why for why in book.refusals.values())


def test_a_record_carries_its_voucher_and_the_reader_marks_it(inprocess) -> None:
    from support.dht import MemoryDHT
    from swarmgrad.peer.net.dht_view import SwarmView

    blob = sign_voucher(OWNER, RUN, PEER, 2 ** 40)

    def record(peer: str) -> PeerRecord:
        return PeerRecord(peer_id=peer, stage=0, state=ONLINE, throughput=1.0, round=0, applied_rounds=0,
                          digest="d", manifest_hash="m", driver=True)

    assert "voucher" not in record(PEER).to_value() and "vouched" not in record(PEER).to_value()

    async def main() -> list[PeerRecord]:
        dht = MemoryDHT()
        views = {p: SwarmView(dht.node(p), RUN, "m", 1, 5.0, 30.0) for p in (PEER, OTHER)}
        views[PEER].own_voucher = OwnVoucher(blob)
        views[OTHER].own_voucher = OwnVoucher(blob)  # another peer's voucher in its own record: refused
        for p, view in views.items():
            await view.announce(record(p))
        return await views[OTHER].stage_records(0)

    records = inprocess(main)
    assert [(r.peer_id, r.vouched) for r in records] == sorted([(PEER, True), (OTHER, False)])


# ------------------------------------------------------------------------------ the command line
def _owner_files(tmp_path: Path) -> tuple[Path, Path, Path]:
    from swarmgrad.peer.cli.launcher import small_manifest
    from swarmgrad.peer.manifest import dumps
    from swarmgrad.peer.net.identity import write_key_file
    manifest, owner, peer = tmp_path / "run.toml", tmp_path / "owner.key", tmp_path / "peer.key"
    manifest.write_text(dumps(small_manifest(run_id="anchored")))
    write_key_file(owner, OWNER)
    write_key_file(peer, peer_keys(1, "voucher-peers")[0])
    return manifest, owner, peer


def test_vouch_writes_a_voucher_that_the_owners_run_accepts(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from swarmgrad.peer.cli import main
    from swarmgrad.peer.cli.public import sign_own_run
    manifest, owner, peer = _owner_files(tmp_path)
    out = tmp_path / "peer.voucher"
    assert main.main(["vouch", "--owner-key", str(owner), "--identity", str(peer), "--manifest", str(manifest),
                      "--days", "2", "--out", str(out)]) == 0
    assert "anchor of run anchored@" in capsys.readouterr().out
    run = sign_own_run(str(manifest), str(owner)).manifest  # what the owner's peers train with
    v = check_voucher(voucher_from_text(out.read_text()), run.run_id, PEER, time.time(), run.hash)
    assert v.manifest_hash == run.hash and 1.9 * 86400 < v.expires_at - time.time() <= 2 * 86400
    # by name: any manifest of the run
    assert main.main(["vouch", "--owner-key", str(owner), "--peer-id", OTHER, "--run", "anchored", "--out", str(out)]) == 0
    assert check_voucher(voucher_from_text(out.read_text()), run.run_id, OTHER, time.time(), "ff" * 32)


def test_vouchs_mistakes_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from swarmgrad.peer.cli import main
    manifest, owner, peer = _owner_files(tmp_path)
    out = str(tmp_path / "v")
    for argv, why in (([f"--run=anchored@{fingerprint(STRANGER)}", "--peer-id", PEER], "owner key has fingerprint"),
                      (["--run", "anchored", "--peer-id", "12D3KooWnope"], "not an Ed25519 peer id"),
                      (["--run", "anchored", "--identity", str(tmp_path / "missing")], "--identity"),
                      (["--run", "a b", "--peer-id", PEER], "--run"),
                      (["--run", "anchored", "--peer-id", PEER, "--days", "0"], "--days")):
        assert main.main(["vouch", "--owner-key", str(owner), "--out", out, *argv]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0], (argv, err)


def test_a_peer_with_a_voucher_that_does_not_hold_stops_with_one_line(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    import signal
    from types import SimpleNamespace

    from swarmgrad.peer.cli import main
    from swarmgrad.peer.cli.peer import _anchor_options
    from swarmgrad.peer.cli.public import sign_own_run
    manifest, owner, peer = _owner_files(tmp_path)
    run = sign_own_run(str(manifest), str(owner)).manifest
    files = {}
    for name, blob in (("good", sign_voucher(OWNER, run.run_id, PEER, time.time() + 60, run.hash)),
                       ("other-peer", sign_voucher(OWNER, run.run_id, OTHER, time.time() + 60)),
                       ("expired", sign_voucher(OWNER, run.run_id, PEER, time.time() - 1))):
        files[name] = tmp_path / name
        files[name].write_text(voucher_text(blob))
    files["garbage"] = tmp_path / "garbage"
    files["garbage"].write_text("not a voucher")
    key = peer_keys(1, "voucher-peers")[0]

    def options(voucher: Path | None = None, owner_key: Path | None = None) -> dict | str:
        return _anchor_options(SimpleNamespace(voucher=voucher and str(voucher), owner_key=owner_key and str(owner_key)),
                               run, key)

    assert options(files["good"]) == {"voucher": voucher_from_text(files["good"].read_text())}
    assert "owner_key" in options(owner_key=owner)  # type: ignore[operator]
    assert options() == {}
    for name, why in (("other-peer", "for peer .* --identity FILE"), ("expired", "expired"),
                      ("garbage", "not a voucher file"), ("missing", "No such file")):
        line = options(tmp_path / name)
        assert isinstance(line, str) and "\n" not in line and re.search(why, line), (name, line)
    # end to end: a manifest of no public run (no --owner-key) has no owner to vouch
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert main.main(["peer", "--manifest", str(manifest), "--voucher", str(files["good"])]) == 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a public run" in err[0], err
    assert main.main(["peer", "--manifest", str(manifest), "--owner-key", str(owner), "--voucher", "v"]) == 2
    assert "leave --voucher out" in capsys.readouterr().err


def test_a_peer_refuses_a_voucher_that_is_not_its_own() -> None:
    from swarmgrad.peer.cli.launcher import small_manifest
    from swarmgrad.peer.node.peer import PeerOptions, own_voucher
    from swarmgrad.peer.public.signed_manifest import public_manifest
    m = public_manifest(small_manifest(run_id="anchored"), fingerprint(OWNER))
    with pytest.raises(VoucherRefused, match="for peer"):
        own_voucher(PeerOptions(voucher=sign_voucher(OWNER, m.run_id, OTHER, time.time() + 60)), m, PEER)
    with pytest.raises(ValueError, match="not the owner key"):
        own_voucher(PeerOptions(owner_key=STRANGER), m, PEER)
    assert own_voucher(PeerOptions(owner_key=OWNER), m, PEER) is not None
    assert own_voucher(PeerOptions(), m, PEER) is None
