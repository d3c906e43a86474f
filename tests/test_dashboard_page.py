"""The coordinator's dashboard: the HTTP server of peer/coordinator/web.py (urllib) and the page
in a real headless Chromium (tests/support/browser.py), over a 2-peer and a 200-peer swarm snapshot.

The browser tests check that the stages, the replicas of each stage (with their rounds) and the
latest round shown are those of the JSON the server serves. With SWARMGRAD_SCREENSHOTS=DIR they
also save their screenshots there (docs/img holds the README's).
"""
from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from support.browser import dump_dom, parse_dashboard, png_size, screenshot
from swarmgrad.peer.coordinator.web import DASHBOARD_DIR, DashboardServer

_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def fake_peer_id(rng: random.Random) -> str:
    return "12D3KooW" + "".join(rng.choice(_B58) for _ in range(44))


def swarm_fixture(n_stages: int, replicas_per_stage: int, seed: int = 0) -> tuple[dict, dict]:
    """A snapshot and a history as the coordinator would serve them, for a swarm of
    n_stages × replicas_per_stage peers, with some joining, leaving, moving and disagreeing
    replicas once the swarm is large enough to have them."""
    rng = random.Random(seed)
    now = time.time()
    latest = 37 if replicas_per_stage > 2 else 12
    stages, admitted = [], []
    for s in range(n_stages):
        digest = f"{rng.getrandbits(64):016x}"
        replicas = []
        for i in range(replicas_per_stage):
            peer_id = fake_peer_id(rng)
            state, round_, agrees = "online", latest, True
            if replicas_per_stage > 10 and i % 17 == 3:
                state, round_ = "joining", latest - 1
            elif replicas_per_stage > 10 and i % 23 == 5:
                state = "leaving"
            if replicas_per_stage > 10 and i % 19 == 7:
                agrees, round_ = False, latest - 2
            replicas.append({
                "peer_id": peer_id, "state": state, "rate": round(rng.uniform(2.0, 12.0), 2),
                "round": round_, "digest": digest if agrees else f"{rng.getrandbits(64):016x}",
                "agrees": agrees, "moving": replicas_per_stage > 10 and i == 11 + s, "pinned": i == 2,
                "train_loss": round(3.2 + rng.uniform(-0.1, 0.1), 3) if s == n_stages - 1 else None})
            admitted.append({"peer_id": peer_id, "role": "driver" if s == 0 else "peer", "stage": s,
                             "admitted_at": now - rng.uniform(60, 3600), "expires": now + 3600})
        rate = sum(r["rate"] for r in replicas if r["state"] == "online")
        stages.append({"stage": s, "rate": round(rate, 2), "majority_digest": digest,
                       "replicas": replicas})
    bottleneck = min(stages, key=lambda st: st["rate"])["stage"]
    revoked = [{"peer_id": fake_peer_id(rng), "revoked_at": now - 100 * k}
               for k in range(3 if replicas_per_stage > 10 else 0)]
    snapshot = {
        "run_id": "tiny-gpt-3f9c2a1b", "time": now, "latest_round": latest, "n_stages": n_stages,
        "swarm_rate": min(st["rate"] for st in stages), "bottleneck": bottleneck, "stages": stages,
        "peers": {"admitted": admitted, "revoked": revoked},
        "checkpoints": [{"round": r, "time": now - 20 * (latest - r), "stages": list(range(n_stages))}
                        for r in range(max(1, latest - 5), latest + 1)],
        "coordinator": {"peer_id": fake_peer_id(rng), "grpc": "127.0.0.1:31400", "uptime_s": 20.0 * latest + 42},
    }
    loss, samples = [], 0
    for k in range(160):
        samples += int(snapshot["swarm_rate"] * 5)
        train = 8.0 * (1 + samples / 4000) ** -0.35 + rng.uniform(-0.08, 0.08) + 1.2
        val = train + 0.1 if k % 16 == 15 else None
        loss.append({"time": now - 5 * (160 - k), "samples": samples, "train_loss": round(train, 4),
                     "val_loss": None if val is None else round(val, 4),
                     "val_nats": None if val is None else round(val * 0.6, 4),
                     "val_ppl": None if val is None else round(math.exp(val * 0.6), 2)})
    rounds = [{"stage": s, "round": r, "time": now - 20 * (latest - r) + s, "duration_s": round(rng.uniform(1.2, 4.0), 2),
               "group_size": replicas_per_stage - (1 if r % 5 == 0 and replicas_per_stage > 2 else 0),
               "train_loss": loss[min(len(loss) - 1, r * 4)]["train_loss"] if s == n_stages - 1 else None,
               "samples_per_s": stages[s]["rate"]}
              for r in range(1, latest + 1) for s in range(n_stages)]
    history = {"loss": loss, "rounds": rounds,
               "bytes_per_sample": {"activations": 20480.0, "gradients": 10240.0,
                                    "averaging": 14000.0 * n_stages / max(1, replicas_per_stage), "state": 3100.0}}
    return snapshot, history


def empty_fixture() -> tuple[dict, dict]:
    """A run that has just started: nothing reported yet, every nullable value null."""
    snapshot = {"run_id": "fresh", "time": time.time(), "latest_round": 0, "n_stages": 2,
                "swarm_rate": 0.0, "bottleneck": None, "stages": [],
                "peers": {"admitted": [], "revoked": []}, "checkpoints": [],
                "coordinator": {"peer_id": "12D3KooWcoordinator", "grpc": "127.0.0.1:1", "uptime_s": 1.0}}
    history = {"loss": [{"time": time.time(), "samples": 0, "train_loss": None, "val_loss": None}],
               "rounds": [{"stage": 0, "round": 0, "time": time.time(), "duration_s": None,
                           "group_size": None, "train_loss": None, "samples_per_s": None}],
               "bytes_per_sample": {"activations": 0.0, "gradients": 0.0, "averaging": 0.0, "state": 0.0}}
    return snapshot, history


@pytest.fixture
def serve() -> Iterator[Callable[..., str]]:
    """serve(snapshot, history) -> base URL of a DashboardServer on 127.0.0.1 port 0, closed
    at the end of the test whatever happened."""
    servers: list[DashboardServer] = []

    def start(snapshot: Callable[[], dict], history: Callable[[], dict]) -> str:
        server = DashboardServer("127.0.0.1", 0, snapshot, history)
        servers.append(server)
        return f"http://127.0.0.1:{server.start()}/"

    yield start
    for server in servers:
        server.close()


def get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


# ---- the server ---------------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_routes_serve_page_static_files_and_api(serve: Callable[..., str]) -> None:
    snapshot, history = swarm_fixture(2, 1)
    base = serve(lambda: snapshot, lambda: history)
    status, headers, body = get(base)
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert b'id="stages"' in body and b"static/app.js" in body
    for name, content_type in [("app.js", "text/javascript"), ("style.css", "text/css"),
                               ("favicon.svg", "image/svg+xml")]:
        status, headers, body = get(base + "static/" + name)
        assert status == 200 and headers["Content-Type"].startswith(content_type), name
        assert body == (DASHBOARD_DIR / name).read_bytes()
    for path, expected in [("api/swarm", snapshot), ("api/history", history)]:
        status, headers, body = get(base + path + "?t=1")
        assert status == 200 and headers["Content-Type"] == "application/json"
        assert headers["Cache-Control"] == "no-store"
        assert json.loads(body) == expected
    assert get(base + "healthz")[::2] == (200, b"ok")


@pytest.mark.timeout(30)
def test_unknown_paths_and_traversal_are_404(serve: Callable[..., str]) -> None:
    base = serve(dict, dict)
    for path in ["nope", "api/other", "static/", "static/missing.js", "static/../web.py",
                 "static/..%2fweb.py", "static/%2e%2e/web.py", "static/.hidden",
                 "static/..", "static/dashboard/app.js", "static//etc/passwd", "static/__init__.py"]:
        status, headers, body = get(base + path)
        assert status == 404, path
        assert "error" in json.loads(body)
    # http.client would normalise nothing, but be explicit: a raw request line with "..".
    import http.client
    host, port = base[len("http://"):-1].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    connection.request("GET", "/static/../../../../etc/passwd")
    assert connection.getresponse().status == 404
    connection.close()


@pytest.mark.timeout(30)
def test_callback_error_is_500_and_the_server_keeps_serving(serve: Callable[..., str]) -> None:
    calls = {"n": 0}

    def flaky() -> dict:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("coordinator lost its DHT")
        return {"ok": calls["n"]}

    base = serve(flaky, lambda: {"not json": object()})
    status, headers, body = get(base + "api/swarm")
    assert status == 500 and "coordinator lost its DHT" in json.loads(body)["error"]
    assert get(base + "api/swarm")[::2] == (200, b'{"ok": 2}')
    status, _, body = get(base + "api/history")
    assert status == 500 and "TypeError" in json.loads(body)["error"]
    assert get(base + "healthz")[0] == 200


@pytest.mark.timeout(30)
def test_a_failing_callback_is_logged_once_until_it_recovers(serve: Callable[..., str],
                                                             caplog: pytest.LogCaptureFixture) -> None:
    state = {"fail": True}

    def snapshot() -> dict:
        if state["fail"]:
            raise RuntimeError("no DHT")
        return {}

    base = serve(snapshot, dict)
    with caplog.at_level(logging.INFO, logger="swarmgrad.peer.coordinator.web"):
        for _ in range(3):
            assert get(base + "api/swarm")[0] == 500
        state["fail"] = False
        assert get(base + "api/swarm")[0] == 200
        state["fail"] = True
        assert get(base + "api/swarm")[0] == 500
    # levels by number: hivemind, once imported, renames WARNING to WARN
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert messages == [(logging.WARNING, "dashboard snapshot failed: RuntimeError: no DHT"),
                        (logging.INFO, "dashboard snapshot works again"),
                        (logging.WARNING, "dashboard snapshot failed: RuntimeError: no DHT")]


@pytest.mark.timeout(30)
def test_non_finite_floats_become_null(serve: Callable[..., str]) -> None:
    base = serve(lambda: {"swarm_rate": float("nan"), "x": [float("inf"), 1.5]}, dict)
    assert json.loads(get(base + "api/swarm")[2]) == {"swarm_rate": None, "x": [None, 1.5]}


@pytest.mark.timeout(30)
def test_close_frees_the_port_and_is_idempotent() -> None:
    server = DashboardServer("127.0.0.1", 0, dict, dict)
    port = server.start()
    assert get(f"http://127.0.0.1:{port}/healthz")[0] == 200
    server.close()
    server.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2)
    again = DashboardServer("127.0.0.1", port, dict, dict)  # the same port binds again
    assert again.start() == port
    again.close()


def test_page_has_no_external_url() -> None:
    """No CDN, font or any other URL: the page must work offline. The SVG namespace is a name."""
    for file in DASHBOARD_DIR.iterdir():
        text = file.read_text().replace("http://www.w3.org/2000/svg", "")
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.I), file.name
        assert "@import" not in text and "url(" not in text, file.name


# ---- the page in Chromium -------------------------------------------------------------------

def check_page_matches_api(base: str, dom: str) -> None:
    view = parse_dashboard(dom)
    assert view.js_error is None, view.js_error
    assert view.api_state == "ok", view.api_text
    swarm = json.loads(get(base + "api/swarm")[2])
    assert view.latest_round == str(swarm["latest_round"])
    assert view.stage_order == sorted(stage["stage"] for stage in swarm["stages"])
    for stage in swarm["stages"]:
        shown = view.stages[stage["stage"]]
        assert set(shown) == {r["peer_id"] for r in stage["replicas"]}, stage["stage"]
        for replica in stage["replicas"]:
            attrs = shown[replica["peer_id"]]
            assert attrs["round"] == str(replica["round"])
            assert attrs["state"] == replica["state"]
            assert attrs["agrees"] == str(replica["agrees"]).lower()
    assert view.texts["run-id"] == swarm["run_id"]
    assert view.texts["peer-count"] == str(sum(len(s["replicas"]) for s in swarm["stages"]))


def live(snapshot: dict) -> Callable[[], dict[str, Any]]:
    """The snapshot with the time of the request, as the coordinator serves it."""
    return lambda: dict(snapshot, time=time.time())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n_stages,replicas,name", [(2, 1, "2peers"), (4, 50, "200peers")])
def test_page_shows_the_swarm_of_the_api(chromium: Path, serve: Callable[..., str], tmp_path: Path,
                                         n_stages: int, replicas: int, name: str) -> None:
    snapshot, history = swarm_fixture(n_stages, replicas)
    base = serve(live(snapshot), lambda: history)
    dom = dump_dom(base)
    check_page_matches_api(base, dom)
    view = parse_dashboard(dom)
    assert sum(len(r) for r in view.stages.values()) == n_stages * replicas
    # the round history shows the last 20 rounds, newest first
    rows = re.findall(r'<tr data-stage="(\d+)" data-round="(\d+)"', dom)
    assert len(rows) == min(20, len(history["rounds"]))
    assert rows[0][1] == str(snapshot["latest_round"])
    assert 'data-series="train_loss"' in dom and 'data-series="val_loss"' in dom
    last_val = [row for row in history["loss"] if row["val_loss"] is not None][-1]  # in every unit (peer/text/units.py)
    assert f'{last_val["val_nats"]:.3f} nats/token, perplexity' in dom

    out = Path(os.environ.get("SWARMGRAD_SCREENSHOTS") or tmp_path)
    png = screenshot(base, out / f"dashboard-{name}.png")
    assert png_size(png) == (1366, 768)


@pytest.mark.timeout(120)
def test_page_survives_a_fresh_run_with_nothing_reported(chromium: Path, serve: Callable[..., str]) -> None:
    snapshot, history = empty_fixture()
    base = serve(live(snapshot), lambda: history)
    view = parse_dashboard(dump_dom(base))
    assert view.js_error is None, view.js_error
    assert view.api_state == "ok", view.api_text
    assert view.stages == {} and view.latest_round == "0"
    assert "no loss reported yet" in view.texts["loss-chart"]
    assert view.texts["rounds-body"].endswith("————")  # the one round so far: nulls as dashes
    assert "no peer admitted yet" in view.texts["admitted-body"]
    assert "nothing sent yet" in view.texts["bytes-bars"]


@pytest.mark.timeout(120)
def test_page_survives_empty_documents(chromium: Path, serve: Callable[..., str]) -> None:
    """Not the schema at all ({}): the page shows dashes, not a broken script."""
    base = serve(dict, dict)
    view = parse_dashboard(dump_dom(base))
    assert view.js_error is None, view.js_error
    assert view.api_state == "ok", view.api_text
    assert view.stages == {} and view.latest_round == "—"
    assert "no round finished yet" in view.texts["rounds-body"]


@pytest.mark.timeout(120)
def test_page_says_when_the_api_fails(chromium: Path, serve: Callable[..., str]) -> None:
    def broken() -> dict:
        raise RuntimeError("no snapshot yet")

    snapshot, history = swarm_fixture(2, 1)
    base = serve(broken, lambda: history)
    view = parse_dashboard(dump_dom(base, budget_ms=3000))
    assert view.js_error is None, view.js_error
    assert view.api_state == "error"
    assert "HTTP 500" in view.api_text and "no snapshot yet" in view.api_text


@pytest.mark.timeout(120)
def test_page_says_when_the_coordinator_goes_away(chromium: Path) -> None:
    """Good answers first, then the server closes: the page keeps the last data and says the
    API is unreachable."""
    snapshot, history = swarm_fixture(2, 1)
    servers: list[DashboardServer] = []
    calls = {"n": 0}

    def then_gone() -> dict:
        calls["n"] += 1
        if calls["n"] == 2:  # close from another thread: this one is answering a request
            threading.Thread(target=servers[0].close, daemon=True).start()
        return dict(snapshot, time=time.time())

    server = DashboardServer("127.0.0.1", 0, then_gone, lambda: history)
    servers.append(server)
    try:
        base = f"http://127.0.0.1:{server.start()}/"
        view = parse_dashboard(dump_dom(base, budget_ms=8000))
    finally:
        server.close()
    assert view.js_error is None, view.js_error
    assert view.api_state == "error", view.api_text
    assert "unreachable" in view.api_text and "last good data" in view.api_text
    assert view.latest_round == str(snapshot["latest_round"]) and len(view.stages) == 2


@pytest.mark.timeout(120)
def test_page_says_when_the_snapshot_is_old(chromium: Path, serve: Callable[..., str]) -> None:
    snapshot, history = swarm_fixture(2, 1)
    base = serve(lambda: dict(snapshot, time=time.time() - 600), lambda: history)
    view = parse_dashboard(dump_dom(base, budget_ms=3000))
    assert view.api_state == "stale", view.api_text
    assert "10 min old" in view.api_text


# ---- DNS rebinding and connection bounds (issue 43, point 8) --------------------------------

def get_with_host(base: str, host: str, path: str = "api/swarm") -> int:
    """The status of GET `path` sent with Host: `host` (what a rebinding page's browser sends)."""
    import http.client
    parts = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request("GET", "/" + path, headers={"Host": host})
        return conn.getresponse().status
    finally:
        conn.close()


@pytest.mark.timeout(30)
def test_a_host_that_is_not_the_dashboards_is_refused() -> None:
    """A page on evil.example whose name is re-pointed at 127.0.0.1 (DNS rebinding) sends
    Host: evil.example: refused 403. On main every Host was served."""
    from swarmgrad.peer.coordinator.web import host_allowed
    snapshot, history = swarm_fixture(1, 1)
    server = DashboardServer("127.0.0.1", 0, lambda: snapshot, lambda: history, allowed_hosts=("dash.lan",))
    port = server.start()
    try:
        base = f"http://127.0.0.1:{port}/"
        assert get_with_host(base, f"evil.example:{port}") == 403
        assert get_with_host(base, "evil.example", "") == 403
        for ok in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", f"[::1]:{port}", f"10.1.2.3:{port}",
                   f"dash.lan:{port}", "Dash.Lan."):
            assert get_with_host(base, ok) == 200, ok
    finally:
        server.close()
    assert host_allowed("gpu-box:8080", "gpu-box") and not host_allowed("gpu-box:8080", "0.0.0.0")
    assert not host_allowed(":8080", "127.0.0.1") and host_allowed(None, "127.0.0.1")


@pytest.mark.timeout(30)
def test_connections_beyond_the_bound_get_503_not_a_thread() -> None:
    """Clients that open connections and send nothing each held a thread for the handler's
    timeout, without bound (one thread per connection). Now at most max_connections are handled;
    the next is answered 503 at once, and the server serves again as slots free."""
    import socket
    import threading
    snapshot, history = swarm_fixture(1, 1)
    server = DashboardServer("127.0.0.1", 0, lambda: snapshot, lambda: history, max_connections=3)
    port = server.start()
    idle = []
    try:
        before = threading.active_count()
        for _ in range(3):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        deadline = time.time() + 5
        while threading.active_count() < before + 3 and time.time() < deadline:
            time.sleep(0.02)
        extra = socket.create_connection(("127.0.0.1", port), timeout=5)
        assert extra.recv(64).startswith(b"HTTP/1.1 503")
        extra.close()
        assert server.busy == 1 and threading.active_count() <= before + 3
        for s in idle:
            s.close()
        deadline = time.time() + 5
        status = None
        while time.time() < deadline:
            status = get_with_host(f"http://127.0.0.1:{port}/", "localhost")
            if status == 200:
                break
            time.sleep(0.05)
        assert status == 200
    finally:
        for s in idle:
            s.close()
        server.close()
