"""A private run, end to end, with real processes: a coordinator, an admitted peer on each stage, an
outsider that knows every address, a revocation, the dashboard in Chromium, the metrics, the
coordinator killed mid-run, the whole swarm killed and resumed from its checkpoint, the export.

One peer per stage is all the security properties need (every RPC kind has a server, the
checkpoint has every stage); the outsider and the revocation run while the swarm trains towards
its first checkpoint, and rounds are 2 s, so the run waits for little but its own steps."""
from __future__ import annotations

import asyncio
import json
import os
import re
import time
import urllib.request
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarmgrad.peer.net.dht_process import remove_dead_sockets, start_dht_process
from swarmgrad.peer.cli.launcher import PrivateSwarm
from swarmgrad.peer.net.rpc import FramedRPC, Traffic, stage_namespace
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.validation import RunIdentity, envelope

from support.browser import SKIP_REASON, chromium_available, dump_dom, parse_dashboard, screenshot
from conftest import small_manifest


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _metric(text: str, name: str, labels: str = "") -> float:
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" ([0-9.e+-]+)"
    found = re.findall(pattern, text)
    return float(found[-1]) if found else 0.0


def _requests(m, stage: int) -> dict[str, tuple[object, type]]:
    """One well-formed request of every kind a peer serves (the content does not matter: an
    outsider must be refused before any of it is read)."""
    env = envelope(RunIdentity(m.run_id, m.hash), stage)
    out = {"average": (pb.AverageRequest(envelope=env), pb.AverageResponse),
           "state": (pb.StateRequest(envelope=env), pb.StateResponse)}
    if stage > 0:
        out["forward"] = (pb.ForwardRequest(envelope=env, microbatch_id=1, eval_only=True), pb.ForwardResponse)
        out["commit"] = (pb.CommitRequest(envelope=env, microbatch_ids=[1], attempts=[0]), pb.CommitResponse)
    return out


async def _outsider(m, peers: dict[str, tuple[int, list[str]]], coordinator_maddrs: list[str]) -> dict:
    """Everything an outsider without a certificate can try, with every address in hand."""
    from hivemind.p2p import P2P

    from swarmgrad.peer.net.identity import ephemeral_key_file
    from swarmgrad.peer.net.record_signing import SignedRecordValidator
    from swarmgrad.peer.records import PeerRecord, stage_key

    results: dict = {"accepted": [], "refused": [], "dht_join": None, "dht_store": None}
    maddrs = [a for _, addrs in peers.values() for a in addrs]
    p2p = await P2P.create(initial_peers=maddrs)
    try:
        for peer_id, (stage, _) in peers.items():
            calls = {f"stage{stage}/{name}": (stage_namespace(m.run_id, stage), name, req, resp)
                     for name, (req, resp) in _requests(m, stage).items()}
            backup_ns = f"swarmgrad/{m.run_id}/backup"
            calls["backup/put"] = (backup_ns, "put", pb.BackupPut(envelope=envelope(RunIdentity(m.run_id, m.hash),
                                                                                    stage)), pb.BackupAck)
            calls["backup/get"] = (backup_ns, "get", pb.BackupGet(envelope=envelope(RunIdentity(m.run_id, m.hash),
                                                                                    stage)), pb.StateResponse)
            for label, (namespace, method, request, response_type) in calls.items():
                rpc = FramedRPC(p2p, namespace, Traffic(), 1 << 20)
                try:
                    resp = await rpc.call(peer_id, method, request, response_type, timeout=20)
                except Exception as e:
                    results["refused"].append((label, f"failed: {e}"))
                    continue
                (results["refused"] if resp.status == pb.UNAUTHORIZED else results["accepted"]).append(
                    (label, pb.Status.Name(resp.status)))
    finally:
        await p2p.shutdown()
    # the DHT: an outsider's node cannot join, and what it stores reaches nobody
    began = time.time()
    try:
        dht = start_dht_process(initial_peers=coordinator_maddrs, startup_timeout=30)
        results["dht_join"] = "joined"
        dht.shutdown()
    except Exception as e:
        results["dht_join"] = f"refused: {type(e).__name__}"
    # a refused start stops its p2pd before the error is raised: no dead socket left in /tmp
    results["sockets_left"] = [p.name for p in remove_dead_sockets(began)]
    key = Ed25519PrivateKey.generate()
    with ephemeral_key_file(key) as (path, _):
        dht = start_dht_process(initial_peers=coordinator_maddrs, startup_timeout=30,
                                ensure_bootstrap_success=False, identity_path=str(path), check_if_identity_free=False,
                                record_validators=[SignedRecordValidator(key)])
    try:
        record = PeerRecord(peer_id=str(dht.peer_id), stage=0, state="online", throughput=1e5, round=999,
                            applied_rounds=999, digest="evil", manifest_hash=m.hash, driver=True)
        from hivemind.utils import get_dht_time
        results["outsider_id"] = str(dht.peer_id)
        results["dht_store"] = dht.store(stage_key(m.run_id, 0), record.to_value(), get_dht_time() + 60,
                                         subkey=str(dht.peer_id))
        results["stored_at"] = time.time()
    finally:
        dht.shutdown()
    return results


def _looks_after(url: str, since: float, looks: int, timeout: float) -> dict:
    """The coordinator's /api/swarm once it has published `looks` snapshots made after `since`
    (each look reads every stage record): the first may have begun its read before `since`."""
    deadline = time.monotonic() + timeout
    seen: list[float] = []
    while True:
        snapshot = json.loads(_get(url))
        if snapshot["time"] > since and snapshot["time"] not in seen:
            seen.append(snapshot["time"])
            if len(seen) >= looks:
                return snapshot
        if time.monotonic() > deadline:
            raise TimeoutError(f"the coordinator published {len(seen)} of {looks} looks within {timeout:.0f}s")
        time.sleep(0.1)


async def _admitted_caller_until_revoked(swarm: PrivateSwarm, m, target: str, heartbeat: float) -> dict:
    """An admitted peer (this test process) calls a replica; it is revoked; how long until the
    replica refuses it?"""
    from swarmgrad.peer.net.identity import ephemeral_key_file, peer_id_of
    from swarmgrad.peer.private.join import join
    from swarmgrad.peer.net.record_signing import SignedRecordValidator

    key = Ed25519PrivateKey.generate()
    loop = asyncio.get_running_loop()
    private = await loop.run_in_executor(None, lambda: join(key, invitation=swarm.invite()))
    with ephemeral_key_file(key) as (path, _):
        dht = start_dht_process(initial_peers=swarm.coordinator_maddrs, startup_timeout=30,
                                identity_path=str(path), check_if_identity_free=False,
                                record_validators=[SignedRecordValidator(key)], authorizer=private.authorizer())
    try:
        admission = private.admission(dht)
        await admission.step()  # publish our certificate
        p2p = await dht.replicate_p2p()
        rpc = FramedRPC(p2p, stage_namespace(m.run_id, 1), Traffic(), 1 << 24)
        request, response_type = _requests(m, 1)["state"]

        async def status() -> int:
            return (await rpc.call(target, "state", request, response_type, timeout=20)).status

        before = await status()
        await loop.run_in_executor(None, swarm.revoke, peer_id_of(key))
        revoked_at = time.monotonic()
        after = before
        while after != pb.UNAUTHORIZED and time.monotonic() - revoked_at < 60:
            await asyncio.sleep(0.1)
            after = await status()
        return {"before": before, "after": after, "lag": time.monotonic() - revoked_at}
    finally:
        dht.shutdown()
        private.close()


def _rounds(peer) -> int:
    return len(peer.events("round"))


@pytest.mark.timeout(600)
def test_private_run(private_swarm, tmp_path: Path) -> None:
    m = small_manifest(run_id="private-test", rounds={"round_seconds": 2.0})
    heartbeat = m.timeouts.heartbeat
    swarm: PrivateSwarm = private_swarm(m)
    swarm.start_coordinator("--http", "127.0.0.1:0", "--metrics-port", "0", "--checkpoint-every", "2")
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with grpc.insecure_channel(swarm.address) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="swarmgrad.coordinator.Coordinator"), timeout=10)
    assert check.status == health_pb2.HealthCheckResponse.SERVING
    identity = str(tmp_path / "peer-a.key")  # this one keeps its certificate and rejoins without invitation
    peers = [swarm.start(0, "--identity", identity), swarm.start(1)]
    driver = peers[0]
    started = {p.name: swarm.wait_for(p, lambda e: e["event"] == "started", 90, "started") for p in peers}
    for p in peers:  # serving: every handler is registered
        swarm.wait_for(p, lambda e: e["event"] == "online", 90, "online")
    ids = {p.name: started[p.name]["peer"] for p in peers}

    # ---- an outsider with every address and no certificate: nothing accepted, no DHT record
    targets = {ids[p.name]: (p.stage, started[p.name]["maddrs"]) for p in peers}
    outsider = asyncio.run(_outsider(m, targets, swarm.coordinator_maddrs))
    assert outsider["accepted"] == [], outsider["accepted"]
    kinds = {label.split("/")[-1] for label, _ in outsider["refused"]}
    assert kinds == {"forward", "commit", "average", "state", "put", "get"}, kinds
    assert all(status == "UNAUTHORIZED" for _, status in outsider["refused"]), outsider["refused"]
    assert outsider["dht_join"].startswith("refused"), outsider["dht_join"]
    assert outsider["sockets_left"] == [], outsider["sockets_left"]
    # its node keeps what it stored in its own storage (hivemind counts that a success); no admitted
    # node took it: the coordinator, which reads the stage records every heartbeat, never sees it
    snapshot = _looks_after(f"http://127.0.0.1:{swarm.http_port}/api/swarm", outsider["stored_at"], 2, 30)
    listed = {r["peer_id"] for s in snapshot["stages"] for r in s["replicas"]}
    assert outsider["outsider_id"] not in listed and listed <= set(ids.values())

    # ---- an admitted caller is served, then refused once revoked
    revocation = asyncio.run(_admitted_caller_until_revoked(swarm, m, ids[peers[1].name], heartbeat))
    assert revocation["before"] != pb.UNAUTHORIZED and revocation["after"] == pb.UNAUTHORIZED, revocation
    # one heartbeat to read the list, plus one DHT lookup (its deadline) and a call in flight
    assert revocation["lag"] <= heartbeat + m.timeouts.dht + 1.0, revocation
    print(f"revoked peer refused {revocation['lag']:.2f}s after `swarmgrad revoke` (heartbeat {heartbeat}s)")

    # ---- the dashboard in a real browser matches the JSON API, once both stages trained
    for p in peers:
        swarm.wait_for(p, lambda e: e["event"] == "round" and e["samples"] > 0, 120, "a trained round")
    if chromium_available():
        url = f"http://127.0.0.1:{swarm.http_port}/"
        # the page reads /api/swarm at some moment between these two reads; rounds are 2 s, and on a
        # loaded machine Chromium took longer than two of them (a check of ±1 round failed at load 20)
        before = json.loads(_get(url + "api/swarm"))
        view = parse_dashboard(dump_dom(url, budget_ms=6000))
        api = json.loads(_get(url + "api/swarm"))
        assert view.js_error is None and view.api_state == "ok", (view.js_error, view.api_state)
        assert sorted(view.stages) == [s["stage"] for s in api["stages"]]
        for stage in api["stages"]:
            assert set(view.stages[stage["stage"]]) == {r["peer_id"] for r in stage["replicas"]}
        assert before["latest_round"] <= int(view.latest_round) <= api["latest_round"], (before["latest_round"],
                                                                                          view.latest_round)
        # SWARMGRAD_SCREENSHOTS=docs/img keeps the picture the README shows
        shots = Path(os.environ.get("SWARMGRAD_SCREENSHOTS", tmp_path))
        screenshot(url, shots / "dashboard-live.png")
    else:
        print("dashboard check skipped:", SKIP_REASON)

    # ---- the coordinator's metrics move
    metrics_url = f"http://127.0.0.1:{swarm.metrics_port}/metrics"
    # every admission: each peer's and the revoked caller's (the page is rewritten once a heartbeat)
    admitted = len(peers) + 1
    deadline = time.monotonic() + 10 * heartbeat
    first = _get(metrics_url)
    while _metric(first, "swarmgrad_coordinator_grpc_calls_total", 'method="Admit"') < admitted \
            and time.monotonic() < deadline:
        time.sleep(0.1)
        first = _get(metrics_url)
    assert _metric(first, "swarmgrad_coordinator_grpc_calls_total", 'method="Admit"') >= admitted
    swarm.wait_for(swarm.coordinator, lambda e: e["event"] == "checkpoint", 120, "a checkpoint")
    deadline = time.monotonic() + 60
    second = _get(metrics_url)
    while (_metric(second, "swarmgrad_coordinator_latest_round") <= _metric(first, "swarmgrad_coordinator_latest_round")
           and time.monotonic() < deadline):
        time.sleep(heartbeat)  # a poll: the coordinator reads the records once a heartbeat
        second = _get(metrics_url)
    assert _metric(second, "swarmgrad_coordinator_latest_round") > _metric(first, "swarmgrad_coordinator_latest_round")
    assert _metric(second, "swarmgrad_coordinator_checkpoint_round") >= 2

    # ---- the coordinator dies: training goes on
    checkpoint = [e for e in swarm.coordinator.events("checkpoint")][-1]
    swarm.coordinator.kill_group()
    mark = _rounds(driver)
    swarm.wait_for(driver, lambda e: e["event"] == "round" and _rounds(driver) >= mark + 2 and e["complete"],
                   90, "two more rounds without the coordinator")
    # the driver's evaluations: at the start, then after each round
    last_val = [e["val_loss"] for e in sorted((e for e in driver.events("eval") if e["val_loss"] is not None),
                                              key=lambda e: e["time"])]
    first_val = last_val[0]

    # ---- everything dies; the swarm comes back from the newest checkpoint
    for p in peers:
        p.kill_group()
    swarm.start_coordinator("--checkpoint-every", "2")
    resumed = [swarm.start(0, "--identity", identity, "--coordinator", swarm.address, invitation=False),
               swarm.start(1)]
    for p, stage in zip(resumed, (0, 1)):
        restored = swarm.wait_for(p, lambda e: e["event"] in ("state_restored", "state_initialised",
                                                             "state_loaded"), 120, "state")
        assert restored["event"] == "state_restored" and restored["source"] == "coordinator", restored
        assert restored["applied_rounds"] >= checkpoint["round"]
        # the wall clock goes on at the checkpoint's round: a fresh epoch would keep every
        # restored replica in its first round for as many rounds as the checkpoint's number
        online = swarm.wait_for(p, lambda e: e["event"] == "online", 60, "online")
        assert (online["time"] - online["epoch"]) / m.rounds.round_seconds >= checkpoint["round"] - 1, online
    val = swarm.wait_for(resumed[0], lambda e: e["event"] == "eval" and e["val_loss"] is not None, 120, "eval")
    # the loss continues from the checkpoint: far from where a fresh start would be
    assert val["val_loss"] < first_val - 0.5 * (first_val - last_val[-1]), (first_val, last_val, val)
    assert resumed[0].events("started")[0]["peer"] == ids[peers[0].name]  # the same peer, recertified

    # ---- the whole model of the newest checkpoint in one file; the export reads only the state
    # dir (each checkpoint is written whole: temp file, rename), so the swarm is stopped first
    # rather than left to take the cores from it (the fixture's teardown would kill it anyway)
    for p in (swarm.coordinator, *resumed):
        p.kill_group()
    from safetensors import safe_open
    out = tmp_path / "model.safetensors"
    swarm._cli("export", "--state-dir", str(swarm.state_dir), "--out", str(out))
    with safe_open(str(out), framework="pt") as f:
        names = list(f.keys())
        assert f.metadata()["run_id"] == m.run_id
    assert any(n.startswith("stage0.") for n in names) and any(n.startswith("stage1.") for n in names)
    print(f"val bits/byte: first {first_val:.3f}, before the stop {last_val[-1]:.3f}, resumed "
          f"{val['val_loss']:.3f} (checkpoint of round {checkpoint['round']})")
