"""`swarmgrad monitor` (peer/coordinator/monitor.py): a run's dashboard read from the DHT with no
coordinator. In process over the in-memory DHT under the real SwarmView: the documents it serves
(stages, history, contributors credited from completed rounds only), then the coordinator's own page
over them in headless Chromium (tests/support/browser.py), with the coordinator's panels left out."""
from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

from conftest import small_manifest
from support.browser import dump_dom, parse_dashboard
from support.dht import MemoryDHT, swarm_view
from support.swarm import peer_ids
from swarmgrad.peer.averaging.credit import manifest_bounds, tokens_per_sample
from swarmgrad.peer.averaging.group import group_hash
from swarmgrad.peer.averaging.outcome import vote
from swarmgrad.peer.coordinator.contributors import Contributors
from swarmgrad.peer.coordinator.monitor import Monitor
from swarmgrad.peer.coordinator.web import DashboardServer
from swarmgrad.peer.net.dht_view import SwarmView
from swarmgrad.peer.records import ONLINE, PeerRecord

A, B, C, D, WATCHER = peer_ids(5, "monitor")
STAGES = {0: (A, B), 1: (C, D)}


async def _round(dht: MemoryDHT, m, round_no: int, stats: bool = True) -> None:  # type: ignore[no-untyped-def]
    """Every replica announces `round_no`; the round before it completed at stage 0 (A and B voted
    one digest) and failed at stage 1 (D voted failed)."""
    for stage, members in STAGES.items():
        h = group_hash(tuple(sorted(members)))
        for i, peer in enumerate(members):
            view = swarm_view(dht, peer, m)
            await view.announce(PeerRecord(
                peer_id=peer, stage=stage, state=ONLINE, throughput=5.0 + i, round=round_no, applied_rounds=round_no,
                digest="theta", manifest_hash=m.hash, driver=stage == 0,
                stats={"train_loss": 3.0 - 0.1 * round_no, "samples": 64 * round_no, "round_s": 2.0,
                       "group_size": 2, "samples_per_s": 16.0} if stats else None))
            await view.register_round(stage, round_no - 1, peer, {"digest": "theta-prev", "applied_rounds": round_no - 1,
                                                                  "weight": 1e9 if peer == B else 32.0})
            failed = stage == 1 and peer == D
            await view.post_check(stage, round_no - 1, peer, vote(h, None if failed else f"mean{round_no}"))


def m_seq_len() -> int:
    return small_manifest().model.seq_len


def _monitor(dht: MemoryDHT, m) -> Monitor:  # type: ignore[no-untyped-def]
    # as `swarmgrad monitor --run NAME` without a manifest's hash: any record of the run
    view = SwarmView(dht.node(WATCHER), m.run_id, "", 0, m.timeouts.dht, m.timeouts.announce_ttl)
    return Monitor(view, m.run_id, None, Contributors(m.run_id, manifest_bounds(m), tokens_per_sample(m)),
                   WATCHER, interval=1.0)


async def _watched_swarm() -> Monitor:
    m, dht = small_manifest(), MemoryDHT()
    monitor = _monitor(dht, m)
    for round_no in (1, 2, 3):
        await _round(dht, m, round_no)
        await monitor.look()
    return monitor


def test_monitor_serves_the_swarm_and_credits_only_completed_rounds(inprocess) -> None:
    monitor = inprocess(_watched_swarm)
    swarm, history, contributors = monitor.documents()
    assert swarm["run_id"] == "test-run" and swarm["n_stages"] == 2 and swarm["latest_round"] == 3
    assert [len(s["replicas"]) for s in swarm["stages"]] == [2, 2]
    assert swarm["peers"] is None and swarm["coordinator"] is None and swarm["monitor"]["peer_id"] == WATCHER
    assert [r["round"] for r in history["rounds"] if r["stage"] == 0] == [1, 1, 2, 2]
    assert any(p["train_loss"] is not None for p in history["loss"])
    rows = {r["peer_id"]: r for r in contributors["contributors"]}
    assert set(rows) == {A, B}  # stage 1's rounds failed: C and D get nothing
    assert rows[A]["rounds"] == 3 and rows[A]["samples"] == 3 * 32
    assert rows[B]["samples"] == 3 * 8 * 32  # its claim of 10^9, bounded by its partner's weight
    assert rows[A]["tokens"] == 3 * 32 * m_seq_len()
    assert contributors["totals"]["rounds"] == 3


@pytest.mark.timeout(120)
def test_monitor_page_in_chromium(chromium: Path, inprocess) -> None:
    monitor = inprocess(_watched_swarm)
    server = DashboardServer("127.0.0.1", 0, lambda: monitor.documents()[0], lambda: monitor.documents()[1],
                             contributors=lambda: monitor.documents()[2])
    try:
        base = f"http://127.0.0.1:{server.start()}/"
        with urllib.request.urlopen(base + "api/contributors", timeout=10) as response:
            served = json.loads(response.read())
        dom = dump_dom(base)
    finally:
        server.close()
    view = parse_dashboard(dom)
    assert view.js_error is None, view.js_error
    assert view.api_state == "ok", view.api_text
    assert view.latest_round == "3" and set(view.stages) == {0, 1}
    assert set(view.stages[0]) == {A, B} and set(view.stages[1]) == {C, D}
    shown = re.findall(r'data-contributor="([^"]+)"[^>]*data-samples="([^"]+)"', dom)
    assert [p for p, _ in shown] == [r["peer_id"] for r in served["contributors"]] == [B, A]
    assert 'data-series="train_loss"' in dom
    assert re.search(r'<body[^>]*data-mode="monitor"', dom)
    for hidden in ("peers", "checkpoints", "coordinator"):  # a coordinator's panels: no coordinator here
        assert re.search(rf'id="{hidden}"[^>]*hidden', dom), hidden
    assert "no coordinator" in view.texts["monitor"] and "…" + WATCHER[-8:] in view.texts["monitor-id"]


def test_a_saved_ledger_goes_on_counting_after_a_restart(inprocess, tmp_path: Path) -> None:
    """--ledger FILE (and the coordinator's STATE_DIR/contributors.json): a restarted watcher
    reading the same rounds again credits none of them twice."""
    m, dht = small_manifest(), MemoryDHT()
    path = tmp_path / "contributors.json"

    async def scenario() -> tuple[dict, dict]:
        first = Contributors(m.run_id, manifest_bounds(m), tokens_per_sample(m), path=path)
        view = SwarmView(dht.node(WATCHER), m.run_id, m.hash, m.stages.count, m.timeouts.dht, m.timeouts.announce_ttl)
        await _round(dht, m, 1)
        await first.look(view, await view.swarm())
        again = Contributors(m.run_id, manifest_bounds(m), tokens_per_sample(m), path=path)
        await again.look(view, await view.swarm())  # the same round, read again
        await _round(dht, m, 2)
        await again.look(view, await view.swarm())
        return first.document(), again.document()

    first, again = inprocess(scenario)
    assert first["totals"]["rounds"] == 1 and again["totals"]["rounds"] == 2
    assert {r["peer_id"]: r["rounds"] for r in again["contributors"]} == {A: 2, B: 2}
    assert again["since"] == first["since"]
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a contributors ledger"):
        Contributors(m.run_id, manifest_bounds(m), tokens_per_sample(m), path=path)
