"""Prometheus metrics of one peer (`swarmgrad peer --metrics-port PORT`), listed in docs/metrics.md.

`PeerMetrics` is fed by the peer's event log: it is the `EventLog`'s sink, so every event the
daemon emits (`round`, `eval`, `retry`, `lost`, `banned`, `moved`) updates it, no emit site knows
about metrics, and the metrics say what the JSON-lines events say. Bytes by kind are read from the
peer's `Traffic` when scraped, not copied on every message.

It owns its registry (never prometheus_client's global one: tests run several peers in one
process) and its HTTP server, which `serve` starts and `close` stops.
"""
from __future__ import annotations

import logging
import math
import threading
from typing import Any, Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from swarmgrad.peer.net.rpc import Traffic

logger = logging.getLogger(__name__)

ROUND_SECONDS_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Rounds last seconds (tests) to minutes (a WAN run)."""
AVERAGING_SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class TrafficCollector(Collector):
    """`swarmgrad_bytes_{sent,received}_total{kind}` from a Traffic's counts, read at scrape time
    (Traffic's dicts never change size, so reading them from the server thread is safe)."""

    def __init__(self, traffic: Traffic):
        self.traffic = traffic

    def collect(self) -> Iterator[CounterMetricFamily]:
        for name, counts, what in (("swarmgrad_bytes_sent", self.traffic.sent_by_kind, "sent"),
                                   ("swarmgrad_bytes_received", self.traffic.recv_by_kind, "received")):
            family = CounterMetricFamily(name, f"Bytes of swarmgrad messages {what} by this peer, by what they "
                                               "carry (payload, not libp2p overhead or DHT traffic)", labels=["kind"])
            for kind, n in list(counts.items()):
                family.add_metric([kind], n)
            yield family


class PeerMetrics:
    """The metrics of one peer, in a registry of its own.

    Args:
        traffic: the peer's byte counts, exposed by kind; None leaves the byte metrics out.
    """

    def __init__(self, traffic: Traffic | None = None):
        self.registry = r = CollectorRegistry()
        stage = ["stage"]
        self.round = Gauge("swarmgrad_round", "The last round this replica finished", stage, registry=r)
        self.rounds = Counter("swarmgrad_rounds", "Rounds this replica finished, by result (complete: averaged "
                              "and applied; incomplete: nothing applied)", ["stage", "result"], registry=r)
        self.train_loss = Gauge("swarmgrad_train_loss", "Mean training loss of the last round (nats; drivers and "
                                "the last stage)", stage, registry=r)
        self.val_loss = Gauge("swarmgrad_val_loss", "Validation loss of the last evaluation (bits per byte; "
                              "drivers)", stage, registry=r)
        self.val_nats = Gauge("swarmgrad_val_nats_per_token", "Validation loss of the last evaluation in nats per "
                              "token of the run's tokenizer (drivers)", stage, registry=r)
        self.val_ppl = Gauge("swarmgrad_val_perplexity", "Validation perplexity per token of the last evaluation "
                             "(drivers)", stage, registry=r)
        self.samples = Counter("swarmgrad_samples", "Samples this replica trained on", stage, registry=r)
        self.samples_per_s = Gauge("swarmgrad_samples_per_second", "Samples per second of the last round "
                                   "(its samples over its duration)", stage, registry=r)
        self.utilisation = Gauge("swarmgrad_compute_utilisation", "Fraction of the last round's wall time the "
                                 "worker spent computing (waits excluded)", stage, registry=r)
        self.group_size = Gauge("swarmgrad_group_size", "Members of the last round's averaging group", stage,
                                registry=r)
        self.round_seconds = Histogram("swarmgrad_round_duration_seconds", "Wall time of each round, from the "
                                       "end of the previous one", stage, buckets=ROUND_SECONDS_BUCKETS, registry=r)
        self.averaging_seconds = Histogram("swarmgrad_averaging_seconds", "Time from a round's boundary until "
                                           "its outer step (pause, matchmaking, all-reduce; in the background "
                                           "with rounds.overlap)", stage,
                                           buckets=AVERAGING_SECONDS_BUCKETS, registry=r)
        self.retries = Counter("swarmgrad_microbatch_retries", "Microbatches re-sent along another route "
                               "(drivers)", stage, registry=r)
        self.lost = Counter("swarmgrad_microbatches_lost", "Microbatches given up after pipeline.max_retries "
                            "attempts (drivers)", stage, registry=r)
        self.bans = Counter("swarmgrad_bans", "Bans of a next-stage replica that failed a microbatch", stage,
                            registry=r)
        self.moves = Counter("swarmgrad_moves", "Moves of this peer to another stage", registry=r)
        self.backups = Counter("swarmgrad_backup_pushes", "Pushes of this stage's committed state to peers of "
                               "other stages (each to one or more holders)", stage, registry=r)
        self.backup_seconds = Histogram("swarmgrad_backup_push_seconds", "Wall time of each backup push, all "
                                        "its holders (what averaging.backup_link_share paces)", stage,
                                        buckets=AVERAGING_SECONDS_BUCKETS, registry=r)
        if traffic is not None:
            r.register(TrafficCollector(traffic))
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ feeding

    def observe(self, record: dict[str, Any]) -> None:
        """An EventLog sink: update the metrics from one event record; other events are ignored."""
        handler = self._handlers.get(record.get("event", ""))
        if handler is not None:
            handler(self, record, _stage(record))

    def _on_round(self, e: dict[str, Any], stage: str) -> None:
        self.round.labels(stage).set(e["round"])
        self.rounds.labels(stage, "complete" if e.get("complete") else "incomplete").inc()
        if _finite(e.get("train_loss")):
            self.train_loss.labels(stage).set(e["train_loss"])
        self.samples.labels(stage).inc(max(0, e.get("samples", 0)))
        self.samples_per_s.labels(stage).set(e.get("samples_per_s", 0.0))
        self.group_size.labels(stage).set(e.get("group_size", 0))
        if _finite(e.get("utilisation")):
            self.utilisation.labels(stage).set(e["utilisation"])
        if _finite(e.get("round_s")):
            self.round_seconds.labels(stage).observe(e["round_s"])
        if _finite(e.get("averaging_s")):
            self.averaging_seconds.labels(stage).observe(e["averaging_s"])

    def _on_eval(self, e: dict[str, Any], stage: str) -> None:
        if _finite(e.get("val_loss")):
            self.val_loss.labels(stage).set(e["val_loss"])
        if _finite(e.get("val_nats")):
            self.val_nats.labels(stage).set(e["val_nats"])
        if _finite(e.get("val_ppl")):
            self.val_ppl.labels(stage).set(e["val_ppl"])

    def _on_retry(self, e: dict[str, Any], stage: str) -> None:
        self.retries.labels(stage).inc()

    def _on_lost(self, e: dict[str, Any], stage: str) -> None:
        self.lost.labels(stage).inc()

    def _on_banned(self, e: dict[str, Any], stage: str) -> None:
        self.bans.labels(stage).inc()

    def _on_moved(self, e: dict[str, Any], stage: str) -> None:
        self.moves.inc()

    def _on_backup(self, e: dict[str, Any], stage: str) -> None:
        self.backups.labels(stage).inc()
        if _finite(e.get("seconds")):
            self.backup_seconds.labels(stage).observe(e["seconds"])

    _handlers = {"round": _on_round, "eval": _on_eval, "retry": _on_retry, "lost": _on_lost,
                 "banned": _on_banned, "moved": _on_moved, "backup": _on_backup}

    # ------------------------------------------------------------------ serving

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics over HTTP on host:port (0: a free port) from a daemon thread; returns the
        bound port. Raises OSError if the address cannot be bound, RuntimeError if already serving."""
        if self._server is not None:
            raise RuntimeError("metrics are already served")
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        bound = int(self._server.server_port)
        logger.info("metrics at http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        """Stop the HTTP server (blocks for up to its poll interval, 0.5 s); idempotent."""
        server, thread, self._server, self._thread = self._server, self._thread, None, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5.0)


def _stage(record: dict[str, Any]) -> str:
    stage = record.get("stage")
    return "" if stage is None else str(stage)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
