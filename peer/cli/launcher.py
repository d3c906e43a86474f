"""Local swarms of real peer processes, for the demo, the tests and the benchmarks.

Each peer is `python -m swarmgrad.peer.cli.main peer ...` in its own session. Its DHT process and
p2pd run in a process group of their own inside that session (peer/net/dht_process.py), stop when
the peer dies, and `kill_group` SIGKILLs them with the peer. `LocalSwarm` is a context manager
that always reaps.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from swarmgrad.peer.events import read_events
from swarmgrad.peer.manifest import Manifest, from_dict


@dataclass
class PeerProcess:
    """A process a LocalSwarm started (a peer, a coordinator, or a benchmark's other process)."""
    name: str
    proc: subprocess.Popen
    events_path: Path
    log_path: Path
    stage: int | None

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [e for e in read_events(self.events_path) if kind is None or e.get("event") == kind]

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        """Signal the peer process alone, as `kill PID` would; it stops its own children."""
        if self.alive:
            self.proc.send_signal(sig)

    def kill_group(self, sig: int = 9) -> None:  # SIGKILL (the method `signal` shadows the module here)
        """Signal the peer's process group. With SIGKILL, a machine that vanished: its DHT process
        and p2pd (a group of their own in the peer's session, peer/net/dht_process.py) are SIGKILLed at
        the same moment rather than left to follow the peer, and the unix sockets hivemind leaves
        behind are removed."""
        import psutil
        session = _session_processes(self.proc.pid)
        sockets = _daemon_sockets(self.proc.pid)
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        if sig != signal.SIGKILL:
            return
        for p in session:
            with contextlib.suppress(psutil.Error):
                p.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        psutil.wait_procs(session, timeout=5)
        for path in sockets:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""


@dataclass
class LocalSwarm:
    manifest: Path
    workdir: Path
    env: dict[str, str] = field(default_factory=dict)
    peers: list[PeerProcess] = field(default_factory=list)
    initial_peers: list[str] = field(default_factory=list)
    verbose: bool = False
    """Start peers with `swarmgrad -v` (DEBUG logs, e.g. rpc.serve's stream endings)."""
    bootstrap_wait: float | None = None
    """--bootstrap-wait of the peers after the first (set by `start_first_at`; None: the default)."""
    _tmp: Path | None = field(default=None, init=False, repr=False)

    def __enter__(self) -> "LocalSwarm":
        self.workdir.mkdir(parents=True, exist_ok=True)
        return self

    def _private_tmp(self) -> None:
        """The peers' temp folders (multiprocessing's pymp-* with its listener socket, the DHT
        process's certificate) in one folder of this swarm that `close` removes: a SIGKILLed peer
        cannot remove its own, and /tmp kept them. Short, in /tmp rather than the workdir: the
        sockets inside must fit AF_UNIX's 107 bytes."""
        if self._tmp is None and "TMPDIR" not in self.env:
            self._tmp = Path(tempfile.mkdtemp(prefix="swarmgrad-peers-"))
            self.env["TMPDIR"] = str(self._tmp)

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self, stage: int | str | None = "auto", *extra: str, name: str | None = None) -> PeerProcess:
        index = len(self.peers)
        name = name or f"peer{index}"
        events = self.workdir / f"{name}.events.jsonl"
        cmd = [*self.command_prefix(index), sys.executable, "-m", "swarmgrad.peer.cli",
               *(["-v"] if self.verbose else []), "peer", "--manifest", str(self.manifest), "--events", str(events), "--stage", str(stage),
               *self.peer_args(index, name)]
        if self.initial_peers:
            cmd += ["--initial-peers", *self.initial_peers]
            if self.bootstrap_wait is not None:
                cmd += ["--bootstrap-wait", f"{self.bootstrap_wait:g}"]
        cmd += list(extra)
        return self.spawn(name, cmd, stage if isinstance(stage, int) else None)

    def spawn(self, name: str, cmd: list[str], stage: int | None = None) -> PeerProcess:
        """Start `cmd` as a process of this swarm: in a session of its own, its output in
        WORKDIR/NAME.log, its events expected in WORKDIR/NAME.events.jsonl, stopped by `close`
        with the peers. `start` runs a peer through it; a benchmark runs its other processes
        (a baseline's ranks, bare DHT nodes) through it too, so that one owner reaps them all."""
        self._private_tmp()
        log = self.workdir / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **self.env}
        if "SWARMGRAD_INITIAL_PEERS" not in self.env:  # the user's would make the first peer join another swarm
            env.pop("SWARMGRAD_INITIAL_PEERS", None)
        with open(log, "w") as log_file:
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
        process = PeerProcess(name, proc, self.workdir / f"{name}.events.jsonl", log, stage)
        self.peers.append(process)
        return process

    def start_swarm(self, stages: int, replicas: int, *extra: str) -> list[PeerProcess]:
        """`stages` x `replicas` peers, as `swarmgrad demo` starts them: the first on stage 0
        (the others join through it once it is up), then one per stage in turn; `extra` are
        every peer's flags (e.g. ``--max-rounds N``)."""
        self.start_first(0, *extra)
        for i in range(1, stages * replicas):
            self.start(i % stages, *extra)
        return list(self.peers)

    def command_prefix(self, index: int) -> list[str]:
        """What the `index`-th peer's command runs under (e.g. `ip netns exec NS`); none here."""
        return []

    def peer_args(self, index: int, name: str) -> list[str]:
        """Extra `swarmgrad peer` flags of the `index`-th peer: here its listen address, loopback (a
        peer's default is every interface; a local swarm stays on this machine)."""
        return ["--host-maddrs", "/ip4/127.0.0.1/tcp/0"]

    def start_first(self, stage: int | str = "auto", *extra: str, timeout: float = 60.0) -> PeerProcess:
        """Start the peer that opens the swarm and remember its addresses for the others."""
        peer = self.start(stage, *extra)
        started = self.wait_for(peer, lambda e: e["event"] == "started", timeout)
        self.initial_peers = [a for a in started["maddrs"] if "/127.0.0.1/" in a] or started["maddrs"]
        return peer

    def start_first_at(self, address: str, stage: int | str = "auto", *extra: str,
                       bootstrap_wait: float = 60.0) -> PeerProcess:
        """Start the peer that opens the swarm under a key made here, listening on `address` (a
        fixed `/ip4/HOST/tcp/PORT`, which `peer_args` must give it), and hand the others its
        multiaddr at once: they start while it is still coming up and wait for it
        (`--bootstrap-wait`), as a script that launches a whole swarm together would."""
        from swarmgrad.peer.net.identity import load_or_create, peer_id_of
        key = self.workdir / f"peer{len(self.peers)}.key"
        peer_id = peer_id_of(load_or_create(key))
        peer = self.start(stage, "--identity", str(key), *extra)
        self.initial_peers = [f"{address}/p2p/{peer_id}"]
        self.bootstrap_wait = bootstrap_wait
        return peer

    def wait_for(self, peer: PeerProcess, predicate: Callable[[dict[str, Any]], bool], timeout: float,
                 what: str = "event") -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in peer.events():
                if predicate(event):
                    return event
            if not peer.alive:
                raise RuntimeError(f"{peer.name} exited (code {peer.proc.returncode}) before {what}:\n{peer.log_tail()}")
            time.sleep(0.2)
        raise TimeoutError(f"{peer.name}: no {what} within {timeout:.0f}s:\n{peer.log_tail()}")

    def wait_exit(self, timeout: float) -> list[int | None]:
        """Each peer's exit code once all exited or `timeout` passed (None: still running)."""
        deadline = time.monotonic() + timeout
        for peer in self.peers:
            try:
                peer.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [p.proc.poll() for p in self.peers]

    def close(self, grace: float = 15.0) -> None:
        """SIGTERM every peer, wait, then SIGKILL each process group (which also removes the unix
        sockets of p2p daemons that could not remove their own)."""
        for peer in self.peers:
            if peer.alive:
                peer.signal(signal.SIGTERM)
        self.wait_exit(grace)
        for peer in self.peers:
            peer.kill_group(signal.SIGKILL)  # also any DHT process or p2pd still running after the peer exited
            try:
                peer.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self.env.pop("TMPDIR", None)
            self._tmp = None


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise KeyboardInterrupt, as Ctrl-C does, in the block, so that a
    LocalSwarm's close runs (off the main thread, where handlers cannot be set, it does nothing).
    Its peers run in sessions of their own (each is stopped as a process group), so no signal to
    the program that started them reaches them: without this, `kill PID` or a closed terminal
    ended `swarmgrad demo` at once and left its peers training."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, _frame: object) -> None:
        for s in previous:  # a second signal must not cut the swarm's shutdown short
            signal.signal(s, signal.SIG_IGN)
        raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")
    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@dataclass
class PrivateSwarm(LocalSwarm):
    """A LocalSwarm of a private run: a coordinator (`start_coordinator`), and peers that each join
    with an invitation of their own (their --manifest must be the coordinator's)."""
    key: Path | None = None
    state_dir: Path | None = None
    coordinator: PeerProcess | None = None
    address: str = ""
    coordinator_maddrs: list[str] = field(default_factory=list)
    http_port: int | None = None
    metrics_port: int | None = None

    def _cli(self, *args: str, timeout: float = 60.0) -> str:
        env = {**os.environ, "OMP_NUM_THREADS": "1", **self.env}
        done = subprocess.run([sys.executable, "-m", "swarmgrad.peer.cli", *args], capture_output=True, text=True,
                              env=env, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"swarmgrad {args[0]} failed ({done.returncode}): {done.stderr[-2000:]}")
        return done.stdout

    def start_coordinator(self, *extra: str, timeout: float = 90.0, name: str = "coordinator") -> PeerProcess:
        """Start (or restart: same key and state dir) the coordinator; returns once it serves."""
        if self.key is None:
            self.key = self.workdir / "coordinator.key"
            self._cli("keygen", "--out", str(self.key))
        self.state_dir = self.state_dir or self.workdir / "coordinator-state"
        n = sum(p.name.startswith(name) for p in self.peers)
        label = name if n == 0 else f"{name}{n}"
        events = self.workdir / f"{label}.events.jsonl"
        cmd = [sys.executable, "-m", "swarmgrad.peer.cli", "coordinator", "--manifest", str(self.manifest),
               "--key", str(self.key), "--state-dir", str(self.state_dir), "--listen", "127.0.0.1:0",
               "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--events", str(events), *extra]
        self.coordinator = self.spawn(label, cmd)
        started = self.wait_for(self.coordinator, lambda e: e["event"] == "coordinator_started", timeout,
                                "coordinator_started")
        self.address = started["grpc"]
        self.coordinator_maddrs = started["maddrs"]
        self.http_port, self.metrics_port = started.get("http_port"), started.get("metrics_port")
        return self.coordinator

    def invite(self, stage: int | None = None, expires: str = "1h") -> str:
        args = ["invite", "--key", str(self.key), "--coordinator", self.address, "--expires", expires]
        if stage is not None:
            args += ["--stage", str(stage)]
        return self._cli(*args).strip()

    def revoke(self, peer_id: str) -> str:
        return self._cli("revoke", "--key", str(self.key), "--coordinator", self.address, peer_id)

    _invite_next: bool = True

    def start(self, stage: int | str | None = "auto", *extra: str, name: str | None = None,
              invitation: bool = True) -> PeerProcess:
        """A peer that joins with a new invitation, or (invitation=False) one that rejoins with the
        certificate saved beside its --identity, given in `extra` with --coordinator."""
        self._invite_next = invitation
        return super().start(stage, *extra, name=name)

    def peer_args(self, index: int, name: str) -> list[str]:
        return super().peer_args(index, name) + (["--join", self.invite()] if self.address and self._invite_next else [])


def _session_processes(pid: int) -> list:
    """The processes under a peer that share its session: its DHT process and p2pd; not torch's
    shm manager (a session of its own; it exits when its clients are gone)."""
    import psutil
    with contextlib.suppress(psutil.Error, OSError):  # OSError: the peer is gone (getsid)
        sid = os.getsid(pid)
        out = []
        for child in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.Error, OSError):
                if os.getsid(child.pid) == sid:
                    out.append(child)
        return out
    return []


def _daemon_sockets(pid: int) -> list[str]:
    """The -listen unix sockets of the p2pd daemons under a peer process and hivemind's client
    sockets of the peer and its DHT process (a SIGKILLed process cannot remove its own)."""
    import psutil

    from swarmgrad.peer.net.dht_process import p2pd_sockets

    def client_sockets(proc: psutil.Process) -> list[str]:
        return [c.laddr for c in proc.net_connections(kind="unix") if isinstance(c.laddr, str)
                and os.path.basename(c.laddr).startswith("hivemind-") and c.laddr.endswith(".sock")]
    out = []
    with contextlib.suppress(psutil.Error):
        peer = psutil.Process(pid)
        out += client_sockets(peer)
        for child in peer.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                out += client_sockets(child)
                out += p2pd_sockets(child)
    return out


def small_manifest(**sections: Any) -> Manifest:
    """A run small enough for tests and soak benchmarks on 2 cores: a 2-layer d=32 GPT, 2 stages,
    4 s wall-clock rounds, short timeouts. `sections` override fields, e.g. ``rounds={"round_seconds": 2}``."""
    raw: dict[str, Any] = {
        "run_id": "test-run",
        "seed": 1,
        "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32},
        "stages": {"count": 2},
        "inner": {"lr": 3e-3, "microbatch_size": 4, "microbatches_per_step": 2},
        "rounds": {"round_seconds": 4.0},
        "pipeline": {"max_in_flight": 2},
        "data": {"max_bytes": 300_000, "eval_every": 1, "eval_batches": 2},
        "timeouts": {"matchmaking": 3.0, "allreduce": 8.0, "announce_ttl": 8.0, "heartbeat": 1.0,
                     "microbatch": 10.0, "min_microbatch": 3.0, "ban_base": 2.0},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values} if isinstance(values, dict) else values
    return from_dict(raw)
