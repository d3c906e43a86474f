"""The coordinator's dashboard: a small HTTP server (stdlib only) for the page in `dashboard/`
and the two JSON documents the page polls every 2 s.

Routes (GET only; anything else is 404, other methods 501):

    /                 the page (dashboard/index.html)
    /static/<file>    a file of the package folder dashboard/ (only names that exist there)
    /api/swarm        json of snapshot()   (Cache-Control: no-store)
    /api/history      json of history()    (Cache-Control: no-store)
    /api/contributors json of contributors() (Cache-Control: no-store)
    /healthz          "ok"

The page is self-contained: no CDN, no font, no external URL, and the server says so to the
browser with a Content-Security-Policy that allows this origin only.

Every request's Host header must name localhost, an IP address, the bound host or one of
`allowed_hosts` (`--http-allow-host`), else 403 (`host_allowed`): a page of another site whose
name the attacker re-points at this machine (DNS rebinding) reads nothing, since its requests
carry the attacker's name. At most `max_connections` requests are handled at once, each on its
own thread; one more is answered 503 at once rather than given another thread (a client that
opens connections and sends nothing holds a slot for the handler's timeout at most).

The JSON schema (the coordinator produces exactly this; any list may be empty and any value
marked |null may be null; NaN and infinities are sent as null):

/api/swarm
    {"run_id": str, "time": float (unix s), "latest_round": int, "n_stages": int,
     "swarm_rate": float (samples/s of the slowest stage), "bottleneck": int|null,
     "stages": [{"stage": int, "rate": float, "majority_digest": str|null,
                 "replicas": [{"peer_id": str, "state": "joining"|"online"|"leaving"|...,
                               "rate": float, "round": int, "digest": str, "agrees": bool,
                               "moving": bool, "pinned": bool, "train_loss": float|null}]}],
     "peers": {"admitted": [{"peer_id": str, "role": str, "stage": int|null,
                             "admitted_at": float, "expires": float}],
               "revoked": [{"peer_id": str, "revoked_at": float}]},
     "checkpoints": [{"round": int, "time": float, "stages": [int]}],
     "coordinator": {"peer_id": str, "grpc": str, "uptime_s": float}}

/api/history
    {"loss": [{"time": float, "samples": int, "train_loss": float|null, "val_loss": float|null,
              "val_nats": float|null, "val_ppl": float|null}],
     "rounds": [{"stage": int, "round": int, "time": float, "duration_s": float|null,
                 "group_size": int|null, "train_loss": float|null, "samples_per_s": float|null}],
     "bytes_per_sample": {"activations": float, "gradients": float, "averaging": float,
                          "state": float}}

/api/contributors (peer/coordinator/contributors.py; credit counted from completed rounds only)
    {"run_id": str, "time": float, "since": float (unix s the ledger started counting),
     "tokens_per_sample": int|null, "totals": {"samples": float, "tokens": int|null,
                                              "contributors": int, "rounds": int},
     "contributors": [{"rank": int, "peer_id": str, "samples": float, "tokens": int|null,
                       "rounds": int, "stages": [int], "uptime_s": float,
                       "first_seen": float|null, "last_seen": float|null, "last_round": int|null}]}

A monitor (`swarmgrad monitor`, no coordinator) serves the same documents with "peers",
"checkpoints" and "coordinator" null in /api/swarm, and "monitor": {"peer_id": str,
"uptime_s": float} instead.

docs/dashboard.md describes what the page shows.
"""
from __future__ import annotations

import http.server
import ipaddress
import json
import logging
import math
import re
import threading
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

DASHBOARD_DIR = Path(__file__).resolve().parent / "dashboard"

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
    ".json": "application/json",
    ".txt": "text/plain; charset=utf-8",
}

# A static name is one path segment of plain characters: no "/", no "%", no leading dot. It
# must also be a regular file listed in DASHBOARD_DIR, so nothing outside the folder is served.
_STATIC_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*$")

# The page and its files come from this origin only; inline scripts and styles are refused.
_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


MAX_CONNECTIONS = 32
"""Requests the dashboard handles at once: a few open pages poll two documents every 2 s."""
LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain"})


def host_allowed(header: str | None, bound: str, allowed: frozenset[str] = frozenset()) -> bool:
    """Whether a request's Host header (None: absent, as an HTTP/1.0 client may send) names this
    server: localhost, an IP literal (a rebinding attack always carries the attacker's host
    name), the host the server is bound to, or a name in `allowed` (compared without case and
    port). Pure."""
    if header is None:
        return True  # no browser omits it; a script without one is not a rebinding page
    host = header.strip().lower()
    if host.startswith("["):  # [v6]:port
        host = host[1:host.find("]")] if "]" in host else host
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    host = host.rstrip(".")
    if not host:
        return False
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    names = LOCAL_NAMES | {bound.lower()} | {name.lower().rstrip(".") for name in allowed}
    return host in names or host.endswith(".localhost")


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float replaced by None: the browser's JSON.parse refuses
    NaN and Infinity, and a diverged loss must not blank the page."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


class DashboardServer:
    """Serves the dashboard on `host:port` from a daemon thread that this object owns.

    `snapshot` and `history` are called on the server's request threads, possibly several at
    once, each time the page polls: they must be thread-safe and quick (return a copy built
    under the caller's lock). A callback that raises, or returns something that is not JSON,
    gets a 500 with {"error": ...} for that request; the server keeps serving.
    """

    def __init__(self, host: str, port: int, snapshot: Callable[[], dict],
                 history: Callable[[], dict], contributors: Callable[[], dict] | None = None, *,
                 allowed_hosts: tuple[str, ...] = (), max_connections: int = MAX_CONNECTIONS) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1 (got {max_connections})")
        self.host = host
        self.port = port
        self.allowed_hosts = frozenset(allowed_hosts)
        self.max_connections = max_connections
        self.busy = 0
        """Requests refused 503 because every slot was taken (for tests and logs)."""
        self.snapshot = snapshot
        self.history = history
        self.contributors = contributors or _no_contributors
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        # the last failure of each callback: logged once as a warning, its repeats (every
        # poll of every open page) at debug level until the callback succeeds again
        self._failing: dict[str, str] = {}
        self._lock = threading.Lock()

    def start(self) -> int:
        """Bind and start serving; returns the bound port (port 0 picks a free one). Raises
        OSError when the address cannot be bound, and RuntimeError when already started."""
        if self._server is not None:
            raise RuntimeError("DashboardServer already started")
        server = _Server((self.host, self.port), _Handler)
        server.dashboard = self
        server.slots = threading.BoundedSemaphore(self.max_connections)
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=f"dashboard-http:{server.server_address[1]}",
                                        daemon=True)
        self._thread.start()
        bound = int(server.server_address[1])
        logger.info("dashboard at http://%s:%d/", self.host, bound)
        return bound

    def close(self) -> None:
        """Stop serving, close the socket and join the thread. Idempotent; requests in flight
        run on daemon threads and are not waited for."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=5.0)

    def call(self, what: str, callback: Callable[[], dict]) -> bytes:
        """JSON of callback(), non-finite floats as null; raises what the callback raised or
        TypeError/ValueError for something JSON cannot hold. Logs a failure once per change."""
        try:
            body = json.dumps(json_safe(callback()), allow_nan=False).encode()
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
            with self._lock:
                repeated = self._failing.get(what) == message
                self._failing[what] = message
            logger.log(logging.DEBUG if repeated else logging.WARNING,
                       "dashboard %s failed: %s", what, message,
                       exc_info=logger.isEnabledFor(logging.DEBUG))
            raise
        with self._lock:
            if self._failing.pop(what, None) is not None:
                logger.info("dashboard %s works again", what)
        return body

    def __enter__(self) -> "DashboardServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _no_contributors() -> dict:
    return {"totals": {}, "contributors": []}


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    dashboard: DashboardServer
    slots: threading.BoundedSemaphore

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread per request while a slot is free; else 503 at once, on the accepting thread."""
        if not self.slots.acquire(blocking=False):
            self.dashboard.busy += 1
            try:
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
                                b"Retry-After: 1\r\nConnection: close\r\n\r\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server
    server_version = "swarmgrad-dashboard"
    sys_version = ""
    timeout = 10.0  # a client that stops sending frees its thread

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path = urlsplit(self.path).path
        dashboard = self.server.dashboard
        if not host_allowed(self.headers.get("Host"), dashboard.host, dashboard.allowed_hosts):
            self._send_json(403, {"error": "this Host is not the dashboard's (start it with --http-allow-host NAME)"})
        elif path in ("/", "/index.html"):
            self._send_file("index.html")
        elif path.startswith("/static/"):
            self._send_file(path[len("/static/"):])
        elif path == "/api/swarm":
            self._send_api("snapshot", self.server.dashboard.snapshot)
        elif path == "/api/history":
            self._send_api("history", self.server.dashboard.history)
        elif path == "/api/contributors":
            self._send_api("contributors", self.server.dashboard.contributors)
        elif path == "/healthz":
            self._send(200, b"ok", "text/plain; charset=utf-8")
        else:
            self._send_json(404, {"error": f"not found: {path}"})

    def _send_file(self, name: str) -> None:
        file = DASHBOARD_DIR / name
        if not _STATIC_NAME.match(name) or not file.is_file() or file.parent != DASHBOARD_DIR:
            self._send_json(404, {"error": f"not found: {name}"})
            return
        content_type = CONTENT_TYPES.get(file.suffix, "application/octet-stream")
        self._send(200, file.read_bytes(), content_type, {"Cache-Control": "no-cache"})

    def _send_api(self, what: str, callback: Callable[[], dict]) -> None:
        try:
            body = self.server.dashboard.call(what, callback)
        except Exception as exc:  # the callback's failure is this request's, not the server's
            self._send_json(500, {"error": f"{what} failed: {type(exc).__name__}: {exc}"})
            return
        self._send(200, body, "application/json")

    def _send_json(self, status: int, payload: dict) -> None:
        self._send(status, json.dumps(payload).encode(), "application/json")

    def _send(self, status: int, body: bytes, content_type: str,
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy", _CSP)
        for key, value in ({"Cache-Control": "no-store"} | (headers or {})).items():
            self.send_header(key, value)
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            logger.debug("dashboard client went away before %s", self.path)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
        logger.debug("dashboard %s: " + format, self.address_string(), *args)
