"""Prometheus metrics (peer/node/metrics.py): fed from events, bytes by kind, served over HTTP. A live
peer's /metrics moving while it trains is checked on the shared swarm of tests/test_swarm.py."""
from __future__ import annotations

import math
import urllib.error

import pytest

from swarmgrad.peer.events import EventLog, read_events
from swarmgrad.peer.node.metrics import PeerMetrics
from swarmgrad.peer.net.rpc import TRAFFIC_KINDS, Traffic, traffic_kind

from support.metrics_page import scrape, value


def test_traffic_kind_of_each_method() -> None:
    assert traffic_kind("forward", response=False) == "activations"
    assert traffic_kind("forward", response=True) == "gradients"
    for method in ("average",):
        assert {traffic_kind(method, r) for r in (False, True)} == {"averaging"}
    for method in ("state", "put", "get"):
        assert {traffic_kind(method, r) for r in (False, True)} == {"state"}
    assert traffic_kind("something-new", response=False) == "other"
    assert all(traffic_kind(m, r) in TRAFFIC_KINDS for m in ("forward", "average", "x") for r in (False, True))


def test_traffic_keeps_totals_and_kinds() -> None:
    t = Traffic()
    t.add_sent("activations", 100)
    t.add_sent("averaging", 10)
    t.add_recv("gradients", 7)
    assert (t.sent, t.recv) == (110, 7)
    assert t.sent_by_kind == {"activations": 100, "gradients": 0, "averaging": 10, "state": 0, "other": 0}
    assert t.recv_by_kind["gradients"] == 7 and sum(t.recv_by_kind.values()) == t.recv


def test_event_sink_sees_events_without_a_file_and_cannot_break_emit(tmp_path) -> None:
    seen: list[dict] = []
    log = EventLog(None, sink=seen.append, peer="p")
    log.view(stage=1).emit("round", round=3)
    assert seen == [{"event": "round", "time": seen[0]["time"], "peer": "p", "stage": 1, "round": 3}]

    def broken(record: dict) -> None:
        raise ValueError("a bug in a sink")

    path = tmp_path / "events.jsonl"
    log = EventLog(path, sink=broken, peer="p")
    log.emit("retry", microbatch=1)  # logged, not raised; the line is still written
    log.close()
    assert [e["event"] for e in read_events(path)] == ["retry"]


def test_peer_metrics_follow_events() -> None:
    traffic = Traffic()
    metrics = PeerMetrics(traffic)
    events = EventLog(None, sink=metrics.observe, peer="p").view(stage=0)
    reg = metrics.registry

    def get(name: str, **labels: str) -> float | None:
        return reg.get_sample_value(name, labels)

    assert get("swarmgrad_round", stage="0") is None  # nothing until the first round
    events.emit("round", round=4, train_loss=2.5, samples=64, complete=True, group_size=2, samples_per_s=16.0,
                round_s=4.0, averaging_s=0.3, utilisation=0.9)
    events.emit("round", round=5, train_loss=math.nan, samples=32, complete=False, group_size=1,
                samples_per_s=8.0, round_s=4.5, averaging_s=3.0, utilisation=0.5)
    assert get("swarmgrad_round", stage="0") == 5
    assert get("swarmgrad_rounds_total", stage="0", result="complete") == 1
    assert get("swarmgrad_rounds_total", stage="0", result="incomplete") == 1
    assert get("swarmgrad_train_loss", stage="0") == 2.5  # a round with no loss leaves the last one
    assert get("swarmgrad_samples_total", stage="0") == 96
    assert get("swarmgrad_samples_per_second", stage="0") == 8.0
    assert get("swarmgrad_group_size", stage="0") == 1
    assert get("swarmgrad_compute_utilisation", stage="0") == 0.5
    assert get("swarmgrad_round_duration_seconds_count", stage="0") == 2
    assert get("swarmgrad_round_duration_seconds_sum", stage="0") == 8.5
    assert get("swarmgrad_averaging_seconds_bucket", stage="0", le="0.5") == 1
    assert get("swarmgrad_averaging_seconds_count", stage="0") == 2

    events.emit("eval", round=5, val_loss=math.nan)
    assert get("swarmgrad_val_loss", stage="0") is None
    events.emit("eval", round=5, val_loss=6.25)
    events.emit("retry", microbatch=1, attempt=1, reason="x", failed_peer="q")
    events.emit("retry", microbatch=1, attempt=2, reason="x", failed_peer="q")
    events.emit("lost", microbatch=1, attempts=5)
    events.emit("banned", failed_peer="q", seconds=2.0, failures=1)
    events.emit("moved", stage=1, from_stage=0, to_stage=1)
    events.emit("backup", applied_rounds=3, holders=["q"], bytes=100, seconds=2.4, next_in_s=9.6, paced=0)
    events.emit("online", round=6)  # not a metric: ignored
    assert get("swarmgrad_val_loss", stage="0") == 6.25
    assert get("swarmgrad_microbatch_retries_total", stage="0") == 2
    assert get("swarmgrad_microbatches_lost_total", stage="0") == 1
    assert get("swarmgrad_bans_total", stage="0") == 1
    assert get("swarmgrad_moves_total") == 1
    assert get("swarmgrad_backup_pushes_total", stage="0") == 1
    assert get("swarmgrad_backup_push_seconds_bucket", stage="0", le="2.5") == 1
    assert get("swarmgrad_backup_push_seconds_bucket", stage="0", le="1.0") == 0

    traffic.add_sent("activations", 1000)
    traffic.add_recv("averaging", 50)
    assert get("swarmgrad_bytes_sent_total", kind="activations") == 1000
    assert get("swarmgrad_bytes_received_total", kind="averaging") == 50
    assert get("swarmgrad_bytes_received_total", kind="state") == 0


def test_two_peer_metrics_do_not_share_a_registry() -> None:
    a, b = PeerMetrics(), PeerMetrics()
    a.observe({"event": "retry", "stage": 0})
    assert a.registry.get_sample_value("swarmgrad_microbatch_retries_total", {"stage": "0"}) == 1
    assert b.registry.get_sample_value("swarmgrad_microbatch_retries_total", {"stage": "0"}) is None


def test_serve_on_port_zero_and_close() -> None:
    metrics = PeerMetrics(Traffic())
    port = metrics.serve("127.0.0.1", 0)
    try:
        assert port > 0
        metrics.observe({"event": "round", "stage": 1, "round": 2, "samples": 8, "complete": True})
        samples = scrape(port)
        assert value(samples, "swarmgrad_round", stage="1") == 2
        assert value(samples, "swarmgrad_bytes_sent_total", kind="gradients") == 0
        with pytest.raises(RuntimeError):
            metrics.serve("127.0.0.1", 0)
    finally:
        metrics.close()
    metrics.close()  # idempotent
    with pytest.raises(urllib.error.URLError):
        scrape(port)


def test_the_coordinators_metrics_listen_on_loopback_unless_told(tmp_path) -> None:
    """They name every admitted peer: on main they listened on 0.0.0.0 with no flag to change it
    (issue 43, point 8). Now `--metrics-host` (default 127.0.0.1) says where."""
    from pathlib import Path
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from swarmgrad.peer.cli.main import build_parser
    from swarmgrad.peer.coordinator.coordinator import Coordinator
    from swarmgrad.peer.manifest import load

    args = build_parser().parse_args(["coordinator", "--manifest", "m.toml", "--key", "k", "--metrics-port", "0"])
    assert args.metrics_host == "127.0.0.1" and args.http_allow_host == []
    path = Path("peer/defaults/tiny-gpt.toml")
    coordinator = Coordinator(load(str(path)), path.read_text(), Ed25519PrivateKey.generate(), tmp_path / "key",
                              tmp_path / "state", metrics_port=0, metrics_host=args.metrics_host)
    coordinator.serve_metrics()
    try:
        assert coordinator.metrics._server.server_address[0] == "127.0.0.1"
        assert scrape(coordinator.metrics_port) is not None
    finally:
        coordinator.metrics.close()
