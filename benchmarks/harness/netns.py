"""Network namespaces for WAN benchmarks: one namespace per process, joined by veth pairs, egress
optionally limited with `tc qdisc ... tbf` (netem is not available here).

- 2 namespaces: one veth pair, `wan0` in each, 10.77.N.1 and 10.77.N.2, tbf on both ends (each
  end's egress is that peer's upload);
- more: a bridge in its own namespace (`...-br`, so the host's network is never touched), one veth
  pair per peer (`wan0` in the peer's namespace, `pI` on the bridge), tbf on every peer's `wan0`.

Every namespace is named `sgwan-<pid>-<tag>-...`; `WanNet` is a context manager that deletes its
namespaces (and with them the veths and qdiscs) whatever happens, and `remove_stale()` deletes those
of dead benchmark processes. Bytes are read from the interface counters (`tx_bytes` of each `wan0`):
everything a peer sent, headers and DHT traffic included.
"""
from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from swarmgrad.peer.cli.launcher import LocalSwarm

PREFIX = "sgwan-"
TBF = ("burst", "32kb", "latency", "50ms")


class NetnsUnavailable(RuntimeError):
    """Not root, no `ip`/`tc`, or the kernel refused a namespace: the benchmark skips."""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr.strip()}")
    return proc


def why_unavailable() -> str | None:
    """None if namespaces can be made here, else the reason (for a clean skip)."""
    if os.geteuid() != 0:
        return "not root: network namespaces need CAP_NET_ADMIN"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    proc = _run("ip", "netns", "add", probe, check=False)
    if proc.returncode != 0:
        return f"`ip netns add` failed: {proc.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def remove_stale() -> list[str]:
    """Delete `sgwan-<pid>-...` namespaces whose benchmark process is gone; returns their names."""
    removed = []
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed


@dataclass(frozen=True)
class Endpoint:
    netns: str
    ifname: str
    address: str

    def exec_prefix(self) -> list[str]:
        """Prepend to a command line to run it in this namespace (`ip` execs it: same pid)."""
        return ["ip", "netns", "exec", self.netns]


@dataclass
class WanNet:
    """`n` namespaces, each with one interface `wan0` at <prefix>.<subnet>.<i+1>/24.

    Args:
        tag: short label in the namespace names (letters, digits, '-').
        n: how many peer namespaces (>= 2).
        rate: tbf rate (e.g. "20mbit") on every peer's egress, or None for an unshaped link.
        subnet: third octet of the addresses, so concurrent nets never share an address.
        prefix: first two octets. libp2p treats private addresses (10/8, ...) differently from
            public ones: hole punching waits for a public address and a relay hands out no relayed
            address for a private one. A public prefix (e.g. "11.77") makes the isolated net look
            like the internet to it; the namespaces have no route out, so nothing leaves.
        name_prefix: start of the namespace names (PREFIX, which `remove_stale` knows, unless a
            caller wants its namespaces told apart from other benchmarks' at a glance).
    """
    tag: str
    n: int
    rate: str | None = None
    subnet: int = 0
    prefix: str = "10.77"
    name_prefix: str = PREFIX
    endpoints: list[Endpoint] = field(default_factory=list)
    _namespaces: list[str] = field(default_factory=list)

    def __enter__(self) -> "WanNet":
        if self.n < 2:
            raise ValueError(f"WanNet.n must be >= 2, got {self.n}")
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ns(self, suffix: str) -> str:
        name = f"{self.name_prefix}{os.getpid()}-{self.tag}-{suffix}"
        _run("ip", "netns", "add", name)
        self._namespaces.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")
        return name

    def _build(self) -> None:
        peers = [self._ns(str(i)) for i in range(self.n)]
        addrs = [f"{self.prefix}.{self.subnet}.{i + 1}" for i in range(self.n)]
        if self.n == 2:
            _run("ip", "-n", peers[0], "link", "add", "wan0", "type", "veth", "peer", "name", "wan0",
                 "netns", peers[1])
        else:
            br = self._ns("br")
            _run("ip", "-n", br, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", br, "link", "set", "br0", "up")
            for i, ns in enumerate(peers):
                _run("ip", "-n", br, "link", "add", f"p{i}", "type", "veth", "peer", "name", "wan0", "netns", ns)
                _run("ip", "-n", br, "link", "set", f"p{i}", "master", "br0")
                _run("ip", "-n", br, "link", "set", f"p{i}", "up")
        for ns, addr in zip(peers, addrs):
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "wan0")
            _run("ip", "-n", ns, "link", "set", "wan0", "up")
            if self.rate:
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "wan0", "root", "tbf",
                     "rate", self.rate, *TBF)
            self.endpoints.append(Endpoint(ns, "wan0", addr))

    def drop_inbound_connections(self, index: int) -> None:
        """Make peer `index` a host behind NAT: nobody can open a TCP connection to it, while the
        connections it opens work both ways. Every TCP segment towards it with SYN set and ACK
        clear (a new inbound connection) is dropped at the bridge port that leads to it; replies to
        its own connections (SYN-ACK) pass. This kernel has no netfilter tables and no tc actions,
        so it is an htb root (one class for all traffic, one whose leaf is `blackhole`) and a u32
        filter on the TCP flags byte (IPv4 without options: byte 33). Needs the bridge (n >= 3)."""
        if self.n < 3:
            raise ValueError("drop_inbound_connections needs the bridge (n >= 3)")
        br, port = f"{PREFIX}{os.getpid()}-{self.tag}-br", f"p{index}"
        for cmd in (("qdisc", "add", "dev", port, "root", "handle", "1:", "htb", "default", "1", "r2q", "100000"),
                    ("class", "add", "dev", port, "parent", "1:", "classid", "1:1", "htb", "rate", "10gbit"),
                    ("class", "add", "dev", port, "parent", "1:", "classid", "1:2", "htb", "rate", "10gbit"),
                    ("qdisc", "add", "dev", port, "parent", "1:2", "handle", "20:", "blackhole"),
                    ("filter", "add", "dev", port, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                     "match", "ip", "protocol", "6", "0xff", "match", "u8", "0x02", "0x12", "at", "33",
                     "flowid", "1:2")):
            _run("ip", "netns", "exec", br, "tc", *cmd)

    def inbound_connections_dropped(self, index: int) -> int:
        """How many new inbound connections (SYNs) to peer `index` the NAT emulation dropped."""
        br = f"{PREFIX}{os.getpid()}-{self.tag}-br"
        out = _run("ip", "netns", "exec", br, "tc", "-s", "qdisc", "show", "dev", f"p{index}").stdout
        for block in out.split("qdisc ")[1:]:
            if block.startswith("blackhole"):
                return int(block.split("dropped ")[1].split(",")[0])
        return 0

    def tx_bytes(self) -> list[int]:
        """Bytes each peer's `wan0` has sent so far (all traffic)."""
        return [int(_run("ip", "netns", "exec", e.netns, "cat",
                         f"/sys/class/net/{e.ifname}/statistics/tx_bytes").stdout) for e in self.endpoints]

    def qdiscs(self) -> Sequence[str]:
        return [_run("ip", "netns", "exec", e.netns, "tc", "qdisc", "show", "dev", e.ifname).stdout.strip()
                for e in self.endpoints]

    def close(self) -> None:
        """Delete every namespace made here (their veths, bridge and qdiscs go with them)."""
        while self._namespaces:
            _run("ip", "netns", "del", self._namespaces.pop(), check=False)
        self.endpoints.clear()


_READER = "import sys\nfor _ in sys.stdin:\n    print(open(sys.argv[1]).read().strip(), flush=True)\n"


class TxSampler(threading.Thread):
    """Every peer's `wan0` tx_bytes each `period_s` seconds, as (clock(), [tx per peer]), through one
    long-lived reader per namespace (an `ip netns exec cat` ten times a second would cost a core).
    `clock`: time.monotonic, or time.time to line the samples up with the peers' events."""

    def __init__(self, net: WanNet, period_s: float, clock: Callable[[], float] = time.monotonic):
        super().__init__(daemon=True)
        self.net, self.period_s, self.clock = net, period_s, clock
        self.samples: list[tuple[float, list[int]]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        readers = [subprocess.Popen([*e.exec_prefix(), sys.executable, "-u", "-c", _READER,
                                     f"/sys/class/net/{e.ifname}/statistics/tx_bytes"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                   for e in self.net.endpoints]
        try:
            while not self.stop.is_set():
                values = []
                for r in readers:
                    assert r.stdin is not None and r.stdout is not None
                    r.stdin.write("\n")
                    r.stdin.flush()
                    values.append(int(r.stdout.readline()))
                self.samples.append((self.clock(), values))
                self.stop.wait(self.period_s)
        except (OSError, ValueError):  # a namespace went away under us: the samples so far stand
            pass
        finally:
            for r in readers:
                r.kill()
                r.wait()

    def at(self, t: float, peer: int) -> float:
        """tx_bytes of `peer` at time t (the sampler's clock), linear between samples."""
        s = self.samples
        for (t0, v0), (t1, v1) in zip(s, s[1:]):
            if t0 <= t <= t1:
                return v0[peer] + (v1[peer] - v0[peer]) * (t - t0) / max(1e-9, t1 - t0)
        return float(s[-1][1][peer] if t > s[-1][0] else s[0][1][peer])

    def between(self, peer: int, t0: float, t1: float) -> float:
        """Bytes `peer` sent between t0 and t1 (nan before two samples)."""
        return self.at(t1, peer) - self.at(t0, peer) if len(self.samples) >= 2 else math.nan

    def idle_share(self, t0: float, t1: float, peer: int, rate: float) -> float:
        """Share of sampling intervals in [t0, t1] in which `peer` sent under 10 % of `rate`."""
        quiet = total = 0
        for (a, va), (b, vb) in zip(self.samples, self.samples[1:]):
            if a >= t0 and b <= t1:
                total += 1
                quiet += (vb[peer] - va[peer]) / max(1e-9, b - a) < 0.1 * rate
        return quiet / total if total else math.nan


class NetnsSwarm(LocalSwarm):
    """A LocalSwarm whose i-th peer runs in namespace i and listens on its address there, on `port`
    (0: any; each namespace has its own ports, so a fixed one cannot collide), with data seed i;
    `save` also has each peer save θ_global every round into WORKDIR/NAME.ckpt (the WAN benchmarks
    score those)."""

    def __init__(self, manifest: Path, workdir: Path, endpoints: list[Endpoint], *, port: int = 0,
                 save: bool = False):
        super().__init__(manifest, workdir)
        self.endpoints = endpoints
        self.port = port
        self.save = save

    def command_prefix(self, index: int) -> list[str]:
        return self.endpoints[index].exec_prefix()

    def peer_args(self, index: int, name: str) -> list[str]:
        args = ["--host-maddrs", f"/ip4/{self.endpoints[index].address}/tcp/{self.port}", "--data-seed", str(index)]
        return args + (["--save-dir", str(self.workdir / f"{name}.ckpt")] if self.save else [])
