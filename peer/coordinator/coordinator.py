"""`swarmgrad coordinator`: the process that hosts a private run.

It owns a hivemind DHT node (the run's bootstrap peer, with the coordinator key as its libp2p
identity and a certificate it issues itself), the gRPC service (peer/coordinator/service.py,
with gRPC health checking), the state dir, the checkpoint collector, the swarm watch behind the
dashboard, and the dashboard's HTTP server. `run()` returns when `stop` is set, after closing
all of them; the caller shuts the DHT down.

It is not on the data path: peers train, average and download state from each other. If the
coordinator is down, only admission, renewal, checkpoints and the dashboard wait.
"""
from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from hivemind import DHT
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from swarmgrad.peer.private.admission import Admission, revocations_key
from swarmgrad.peer.coordinator.checkpoints import CheckpointCollector
from swarmgrad.peer.private.coordinator_client import channel_options
from swarmgrad.peer.private.credentials import Issuer
from swarmgrad.peer.coordinator.service import CoordinatorService
from swarmgrad.peer.coordinator.store import StateDir
from swarmgrad.peer.averaging.credit import manifest_bounds, tokens_per_sample
from swarmgrad.peer.coordinator.contributors import Contributors
from swarmgrad.peer.coordinator.watch import History, checkpoint_rows, swarm_snapshot
from swarmgrad.peer.private.dht_auth import AuthFiles, CertificateAuthorizer
from swarmgrad.peer.net.dht_process import start_dht_process
from swarmgrad.peer.events import EventLog
from swarmgrad.peer.manifest import Manifest
from swarmgrad.peer.net.record_signing import MAX_RECORD_TTL, SignedRecordValidator
from swarmgrad.peer.net.rpc import FramedRPC, Traffic, stage_namespace
from swarmgrad.peer.net.dht_view import DATA_TTL, SwarmView
from swarmgrad.peer.net.errors import LoopSteps, dht_call
from swarmgrad.protocol import coordinator_pb2_grpc as cgrpc
from swarmgrad.protocol.validation import RunIdentity

logger = logging.getLogger(__name__)

SERVICE_NAME = "swarmgrad.coordinator.Coordinator"


class Coordinator:
    """Args:
        manifest, manifest_toml: the run (the text is what peers get, signed).
        key, key_path: the coordinator key (its file is p2pd's identity too).
        state_dir: admitted peers, revocations, checkpoints; recovered on restart.
        listen: HOST:PORT of the gRPC service (port 0: any free port; `grpc_port` tells).
        http: HOST:PORT of the dashboard, or None for none.
        checkpoint_every, keep_checkpoints: a checkpoint every N rounds, the newest K kept.
        certificate_ttl: seconds a certificate lives.
        metrics_port, metrics_host: where Prometheus metrics are served (None: nowhere); the
            host is loopback unless told: the metrics name every admitted peer.
        http_allowed_hosts: host names (besides localhost, IP literals and the bound name) the
            dashboard answers to (web.py: a browser's Host header, against DNS rebinding).
    """

    def __init__(self, manifest: Manifest, manifest_toml: str, key: Ed25519PrivateKey, key_path: Path,
                 state_dir: Path, *, listen: str = "127.0.0.1:0", http: str | None = None,
                 host_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",), announce_maddrs: tuple[str, ...] = (),
                 initial_peers: tuple[str, ...] = (), checkpoint_every: int = 5, keep_checkpoints: int = 3,
                 certificate_ttl: float = 12 * 3600, events_path: str | None = None, metrics_port: int | None = None,
                 metrics_host: str = "127.0.0.1", http_allowed_hosts: tuple[str, ...] = ()):
        self.m = manifest
        self.manifest_toml = manifest_toml
        self.key = key
        self.key_path = key_path
        self.issuer = Issuer(key, manifest.run_id)
        self.peer_id = self.issuer.coordinator_id
        self.store = StateDir(state_dir, manifest.run_id, keep_checkpoints)
        self.listen = listen
        self.http = http
        self.host_maddrs = host_maddrs
        self.announce_maddrs = announce_maddrs
        self.initial_peers = initial_peers
        self.checkpoint_every = checkpoint_every
        self.certificate_ttl = certificate_ttl
        self.events = EventLog(events_path, peer=self.peer_id, role="coordinator")
        self.files = AuthFiles(Path(state_dir) / "auth")
        self.rsa = RSAPrivateKey()
        self.dht: DHT | None = None
        self.grpc_port: int | None = None
        self.http_port: int | None = None
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self.http_allowed_hosts = http_allowed_hosts
        self.metrics = None
        self.started = time.time()
        self.history = History()
        self.contributors = Contributors(manifest.run_id, manifest_bounds(manifest), tokens_per_sample(manifest),
                                         path=Path(state_dir) / "contributors.json")
        self._view: dict[int, list] = {}
        self._published: tuple[dict[str, Any], dict[str, Any]] | None = None
        self._data_published = float("-inf")
        """When the newest checkpoint's data position was last published (monotonic; _resume_data)."""
        """The dashboard's two documents, rebuilt by the event loop at each look and only read by
        the HTTP server's threads (a reference swap: they never see a half-built one)."""
        self._tasks: list[asyncio.Task] = []
        self._steps = LoopSteps("coordinator", logger)
        """One per step of the heartbeat loop, named after it (and the revocation list published at
        once after a revoke order shares its step's)."""

    def serve_metrics(self) -> None:
        """Start the Prometheus endpoint on `metrics_host:metrics_port` (nothing when no port)."""
        if self.metrics_port is not None and self.metrics is None:
            from swarmgrad.peer.coordinator.metrics import CoordinatorMetrics
            self.metrics = CoordinatorMetrics()
            self.metrics_port = self.metrics.serve(self.metrics_host, self.metrics_port)

    # DHT (before any event loop or torch thread: hivemind forks) ----------------------------------
    def _self_certificate(self):
        signed = self.issuer.certificate(self.peer_id, role="coordinator", ttl=self.certificate_ttl, serial=0,
                                         dht_public_key=self.rsa.get_public_key().to_bytes())
        self.files.write_certificate(signed)
        return self.issuer.authority.certificate(signed)

    def start_dht(self, timeout: float = 60.0) -> DHT:
        self.certificate = self._self_certificate()
        revoked = self.store.state.revoked
        self.files.write_revoked(revoked)
        kwargs: dict[str, Any] = dict(
            initial_peers=list(self.initial_peers) or None, host_maddrs=list(self.host_maddrs),
            startup_timeout=timeout, identity_path=str(self.key_path), check_if_identity_free=False,
            record_validators=[SignedRecordValidator(self.key)],
            authorizer=CertificateAuthorizer(self.peer_id, self.m.run_id, self.files.folder, self.rsa))
        if self.announce_maddrs:
            kwargs["announce_maddrs"] = list(self.announce_maddrs)
        self.dht = start_dht_process(**kwargs)  # its own process group: peer/net/dht_process.py
        self.maddrs = [str(a) for a in self.dht.get_visible_maddrs()]
        return self.dht

    # run ------------------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        assert self.dht is not None, "start_dht() first"
        m, t = self.m, self.m.timeouts
        self.swarm = SwarmView(self.dht, m.run_id, m.hash, m.stages.count, t.dht, t.announce_ttl)
        self.service = CoordinatorService(self.issuer, self.store, self.manifest_toml, m.hash,
                                          certificate_ttl=self.certificate_ttl, initial_peers=lambda: self.maddrs,
                                          on_revoke=self._revoked)
        self.admission = Admission(authority=self.issuer.authority, certificate=self.certificate, dht=self.dht,
                                   files=self.files, client=None, dht_public_key=b"", heartbeat=t.heartbeat,
                                   dht_timeout=t.dht)
        self.admission.adopt_revocations(self.issuer.authority.revocations(self.service.revocations()))
        self.swarm.admitted = self.admission.admitted
        server = grpc.aio.server(options=channel_options())
        cgrpc.add_CoordinatorServicer_to_server(self.service, server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self.grpc_port = server.add_insecure_port(self.listen)
        if not self.grpc_port:
            raise RuntimeError(f"--listen {self.listen}: could not bind")
        await server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        host = self.listen.rsplit(":", 1)[0]
        self.address = f"{host}:{self.grpc_port}"
        p2p = await self.dht.replicate_p2p()
        traffic = Traffic()
        max_message = int(m.pipeline.max_message_mb * 2**20)
        rpcs = {s: FramedRPC(p2p, stage_namespace(m.run_id, s), traffic, max_message) for s in range(m.stages.count)}
        shapes_cache: dict[int, dict[str, tuple[int, ...]]] = {}
        from swarmgrad.peer.model import from_manifest
        # only the shapes are needed here: a coordinator need not hold a model.init_from checkpoint
        model = from_manifest(m.replace(model={"init_from": ""}) if m.model.init_from else m)

        def shapes(stage: int) -> dict[str, tuple[int, ...]]:
            if stage not in shapes_cache:
                shapes_cache[stage] = {n: tuple(p.shape) for n, p in model.build_stage(stage).named_parameters()}
            return shapes_cache[stage]

        self.collector = CheckpointCollector(
            store=self.store, rpc_for_stage=rpcs.__getitem__, identity=RunIdentity(m.run_id, m.hash), shapes=shapes,
            n_stages=m.stages.count, max_numel=max_message, timeout=t.state_download, every=self.checkpoint_every,
            manifest_toml=self.manifest_toml, manifest_hash=m.hash, events=self.events,
            data_position=self._data_position if m.data.shards else None)
        web = None
        if self.http:
            from swarmgrad.peer.coordinator.web import DashboardServer
            http_host, http_port = self.http.rsplit(":", 1)
            web = DashboardServer(http_host, int(http_port), lambda: self._documents()[0],
                                  lambda: self._documents()[1], contributors=self.contributors.document,
                                  allowed_hosts=self.http_allowed_hosts)
            self.http_port = web.start()
        self.serve_metrics()
        self.events.emit("coordinator_started", run_id=m.run_id, grpc=self.address, grpc_port=self.grpc_port,
                         http_port=self.http_port, metrics_port=self.metrics_port, maddrs=self.maddrs,
                         manifest_hash=m.hash)
        logger.info("coordinator of run %s: gRPC at %s, dashboard at %s, DHT at %s", m.run_id, self.address,
                    f"http://{self.http.rsplit(':', 1)[0]}:{self.http_port}/" if web else "-", ", ".join(self.maddrs))
        self._tasks = [asyncio.create_task(self._loop(), name="coordinator-loop")]
        try:
            await stop.wait()
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self.health.enter_graceful_shutdown()
            await server.stop(grace=1.0)
            if web is not None:
                web.close()
            if self.metrics is not None:
                self.metrics.close()
            self.events.emit("coordinator_stopped")
            self.events.close()

    def _revoked(self, signed) -> None:
        """A revoke order went through: take it ourselves at once and publish it now, not at the
        next heartbeat, so peers see it within one of theirs."""
        self.admission.adopt_revocations(self.issuer.authority.revocations(signed))
        self.events.emit("revoked", revoked=sorted(self.store.state.revoked))
        task = asyncio.create_task(self._step(self._publish_revocations), name="publish-revocations")
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    async def _publish_revocations(self) -> None:
        """Store the newest revocation list in the DHT; raises SwarmUnavailable when the network
        fails the write."""
        dht = self.dht
        assert dht is not None
        key, value = revocations_key(self.m.run_id), self.service.revocations().SerializeToString()
        await dht_call(f"publishing the revocation list under {key}", lambda: dht.store(
            key, value, get_dht_time() + MAX_RECORD_TTL, subkey=self.peer_id, return_future=True),
            self.m.timeouts.dht)

    async def _step(self, step: Callable[[], Awaitable[None]]) -> None:
        """Run one step of the loop. The network's failures are logged (`LoopSteps`), anything else
        with its traceback: the coordinator keeps serving, and the next heartbeat tries again."""
        await self._steps.run(getattr(step, "__name__", str(step)), step)

    async def _loop(self) -> None:
        while True:
            if self.certificate.remaining() < self.certificate_ttl / 2:
                self.certificate = self._self_certificate()
                self.admission.certificate = self.certificate
            for step in (self._publish_revocations, self.admission.step, self._look, self._resume_data):
                await self._step(step)
            await asyncio.sleep(self.m.timeouts.heartbeat)

    async def _data_position(self) -> dict[str, Any] | None:
        """The drivers' data position now (for a checkpoint); None when none publishes one."""
        from swarmgrad.peer.shards.leases import swarm_position
        position = swarm_position(await self.swarm.data_records())
        return position.to_json() if position is not None else None

    async def _resume_data(self) -> None:
        """Publish the newest checkpoint's data position as our own data record (no lease), about
        every third of its lifetime: drivers of a swarm restarted from that checkpoint merge it and
        go on from there (peer/shards/leases.py merges positions by epoch, union and highest claim,
        so a swarm that is further along is not set back)."""
        if not self.m.data.shards or time.monotonic() - self._data_published < DATA_TTL / 3:
            return
        from swarmgrad.peer.shards.leases import DataPosition, DriverRecord
        try:
            saved = self.store.data_position()
            if saved is None:
                return
            shards = saved[1].get("shards") if isinstance(saved[1], dict) else None
            if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
                raise ValueError(f"no shard count in it ({shards!r})")
            position = DataPosition.from_json(saved[1], shards)
        except ValueError as e:  # a corrupt file, or one of another data.shards: nothing to resume from
            logger.warning("the newest checkpoint's data position is not usable: %s", e)
            self._data_published = time.monotonic()
            return
        if await self.swarm.publish_data(DriverRecord(self.peer_id, position, None).to_value()):
            self._data_published = time.monotonic()

    async def _look(self) -> None:
        self._view = await self.swarm.swarm()
        self.history.observe(self._view)
        await self.contributors.look(self.swarm, self._view)
        await self.collector.maybe_collect(self._view)
        self._published = (self.snapshot(), self.history_json())
        if self.metrics is not None:
            self.metrics.update(*self._published, self.service.calls, self.service.refusals)

    # dashboard -----------------------------------------------------------------------------------
    def _documents(self) -> tuple[dict[str, Any], dict[str, Any]]:
        published = self._published
        if published is None:  # before the first look: an empty swarm, from plain data
            return swarm_snapshot(self.m.run_id, {}, self.store.state, [], {"peer_id": self.peer_id}), \
                {"loss": [], "rounds": [], "bytes_per_sample": {}}
        return published

    def snapshot(self) -> dict[str, Any]:
        rounds = self.store.checkpoint_rounds()
        index = {r: self.store.checkpoint(r) for r in rounds}
        return swarm_snapshot(self.m.run_id, dict(self._view), self.store.state, checkpoint_rows(rounds, index),
                              {"peer_id": self.peer_id, "grpc": getattr(self, "address", ""),
                               "uptime_s": round(time.time() - self.started, 1)})

    def history_json(self) -> dict[str, Any]:
        return self.history.to_json(dict(self._view))
