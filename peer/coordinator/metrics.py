"""The coordinator's Prometheus metrics, on a registry of its own (no process-wide state).

Gauges are refreshed from the coordinator's last look at the swarm; counters count what the
coordinator itself did (admissions, refusals, revocations, checkpoints).
"""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server


class CoordinatorMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.round = Gauge("swarmgrad_coordinator_latest_round", "Newest round any replica announces", registry=r)
        self.replicas = Gauge("swarmgrad_coordinator_replicas", "Replicas per stage and state", ["stage", "state"],
                              registry=r)
        self.stage_rate = Gauge("swarmgrad_coordinator_stage_samples_per_second",
                                "Sum of the online replicas' rates per stage", ["stage"], registry=r)
        self.swarm_rate = Gauge("swarmgrad_coordinator_swarm_samples_per_second",
                                "Rate of the slowest stage (the swarm's throughput)", registry=r)
        self.train_loss = Gauge("swarmgrad_coordinator_train_loss", "Last train loss of the last stage's replicas "
                                "(mean)", registry=r)
        self.val_loss = Gauge("swarmgrad_coordinator_val_bits_per_byte", "Last validation loss a driver announced",
                              registry=r)
        self.val_nats = Gauge("swarmgrad_coordinator_val_nats_per_token", "Last validation loss a driver announced, "
                              "in nats per token", registry=r)
        self.val_ppl = Gauge("swarmgrad_coordinator_val_perplexity", "Last validation perplexity per token a "
                             "driver announced", registry=r)
        self.admitted = Gauge("swarmgrad_coordinator_admitted_peers", "Peers holding a certificate", registry=r)
        self.revoked = Gauge("swarmgrad_coordinator_revoked_peers", "Peers revoked", registry=r)
        self.checkpoint_round = Gauge("swarmgrad_coordinator_checkpoint_round", "Round of the newest checkpoint",
                                      registry=r)
        self.calls = Counter("swarmgrad_coordinator_grpc_calls", "gRPC calls served", ["method"], registry=r)
        self.refusals = Counter("swarmgrad_coordinator_grpc_refusals", "gRPC calls refused", ["method"], registry=r)
        self._counted: dict[tuple[str, str], int] = {}
        self._server: Any = None

    def serve(self, host: str, port: int) -> int:
        self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _count(self, counter: Counter, kind: str, totals: dict[str, int]) -> None:
        for method, total in totals.items():
            seen = self._counted.get((kind, method), 0)
            if total > seen:
                counter.labels(method=method).inc(total - seen)
                self._counted[(kind, method)] = total

    def update(self, snapshot: dict[str, Any], history: dict[str, Any], calls: dict[str, int],
               refusals: dict[str, int]) -> None:
        self.round.set(snapshot["latest_round"])
        self.swarm_rate.set(snapshot["swarm_rate"])
        self.replicas.clear()
        for stage in snapshot["stages"]:
            self.stage_rate.labels(stage=str(stage["stage"])).set(stage["rate"])
            states: dict[str, int] = {}
            for replica in stage["replicas"]:
                states[replica["state"]] = states.get(replica["state"], 0) + 1
            for state, n in states.items():
                self.replicas.labels(stage=str(stage["stage"]), state=state).set(n)
        self.admitted.set(len(snapshot["peers"]["admitted"]))
        self.revoked.set(len(snapshot["peers"]["revoked"]))
        if snapshot["checkpoints"]:
            self.checkpoint_round.set(snapshot["checkpoints"][0]["round"])
        losses = [row for row in history["loss"]]
        train = [row["train_loss"] for row in losses if row.get("train_loss") is not None]
        val = [row for row in losses if row.get("val_loss") is not None]
        if train:
            self.train_loss.set(train[-1])
        if val:
            self.val_loss.set(val[-1]["val_loss"])
            if val[-1].get("val_nats") is not None:
                self.val_nats.set(val[-1]["val_nats"])
            if val[-1].get("val_ppl") is not None:
                self.val_ppl.set(val[-1]["val_ppl"])
        self._count(self.calls, "calls", calls)
        self._count(self.refusals, "refusals", refusals)
