"""An in-process swarm: real peers (peer/node/peer.py's `Peer`, with its replicas, workers, round
runners, state sync and RPC handlers) in one event loop, over an in-memory DHT
(tests/support/dht.py) and a loopback transport with per-link delay and bandwidth
(tests/support/transport.py). No processes, no sockets, no p2pd: a swarm starts in milliseconds
(once torch has built its first model in the process), and a test waits for the events it needs
instead of sleeping.

    async with InProcessSwarm(step_manifest(2)) as swarm:
        driver, server = swarm.start(0), swarm.start(1)
        await swarm.wait_round(server, 20, "a complete round", complete=True)

Use manifests with step-count rounds (`rounds.round_seconds = 0`, `rounds.inner_steps = H`, as
`step_manifest` makes): rounds end after H inner steps at the drivers, not by the wall clock.
Every peer runs until its rounds are done (`max_rounds`), `stop` (a signal's clean exit) or
`kill` (SIGKILL: nothing more is announced, its records stay until they expire, its streams
reset). Leaving the block stops every peer still running and fails if one of them failed.
"""
from __future__ import annotations

import asyncio
import hashlib
import itertools
from pathlib import Path
from typing import Any, Callable

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarmgrad.peer.cli.launcher import small_manifest
from swarmgrad.peer.manifest import Manifest
from swarmgrad.peer.model import from_manifest
from swarmgrad.peer.net.identity import peer_id_of
from swarmgrad.peer.node.peer import Peer, PeerNetwork, PeerOptions

from support.dht import MemoryDHT
from support.transport import LinkSpec, LoopbackNet, LoopbackP2P

Event = dict[str, Any]


def peer_keys(n: int, seed: str = "swarm") -> list[Ed25519PrivateKey]:
    """`n` distinct Ed25519 keys, fixed by `seed` (a peer's id is its key's public half)."""
    return [Ed25519PrivateKey.from_private_bytes(hashlib.sha256(f"{seed}/{i}".encode()).digest()) for i in range(n)]


def peer_ids(n: int, seed: str = "swarm") -> list[str]:
    """`n` distinct Ed25519 peer ids (the swarm's records accept no other kind), fixed by `seed`."""
    return [peer_id_of(key) for key in peer_keys(n, seed)]


def step_manifest(inner_steps: int = 2, **sections: Any) -> Manifest:
    """small_manifest with rounds of `inner_steps` inner steps (no wall clock) and the default
    timeouts of small_manifest; `sections` override fields as in small_manifest."""
    rounds = {"round_seconds": 0.0, "inner_steps": inner_steps, **sections.pop("rounds", {})}
    return small_manifest(rounds=rounds, **sections)


class InProcessPeer:
    """One peer of the swarm: its events (as its --events file would hold them), its task."""

    def __init__(self, swarm: "InProcessSwarm", name: str, peer_id: str, stage: int):
        self.swarm = swarm
        self.name = name
        self.peer_id = peer_id
        self.stage = stage
        self.peer: Peer | None = None
        self.task: asyncio.Task | None = None
        self.key: Ed25519PrivateKey | None = None
        """Its identity key (a test signs as this peer with it)."""
        self.stop = asyncio.Event()
        self.killed = False
        self._events: list[Event] = []

    def events(self, kind: str | None = None) -> list[Event]:
        return [e for e in self._events if kind is None or e["event"] == kind]

    @property
    def alive(self) -> bool:
        return self.task is not None and not self.task.done()

    def _record(self, event: Event) -> None:
        """The peer's event sink: any thread (the compute thread emits too)."""
        if not self.killed:
            self._events.append(event)
            if not self.swarm._loop.is_closed():
                self.swarm._loop.call_soon_threadsafe(self.swarm._changed.set)


class InProcessSwarm:
    """N real peers in this event loop. `link` is every link's default; `set_link` changes one.
    `tmp_path`, if given, holds save dirs (`start(..., save=True)`)."""

    def __init__(self, manifest: Manifest, *, link: LinkSpec = LinkSpec(), tmp_path: Path | None = None,
                 seed: str = "swarm"):
        self.manifest = manifest
        self.dht = MemoryDHT()
        self.net = LoopbackNet(link)
        self.tmp_path = tmp_path
        self.peers: list[InProcessPeer] = []
        self._keys = (peer_keys(1, f"{seed}/{i}")[0] for i in itertools.count())
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()

    async def __aenter__(self) -> "InProcessSwarm":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        failures = await self.close()
        if exc[0] is None and failures:
            raise failures[0]

    # peers ------------------------------------------------------------------------------------------
    def start(self, stage: int, *, max_rounds: int | None = None, linger: float = 5.0, save: bool = False,
              **options: Any) -> InProcessPeer:
        """Start a peer pinned to `stage` (as `swarmgrad peer --stage N`); `options` are PeerOptions fields."""
        name = f"peer{len(self.peers)}"
        key = next(self._keys)
        peer_id = peer_id_of(key)
        handle = InProcessPeer(self, name, peer_id, stage)
        handle.key = key
        if save:
            assert self.tmp_path is not None, "save needs the swarm's tmp_path"
            options["save_dir"] = str(self.tmp_path / name)
        node, p2p = self.dht.node(peer_id), self.net.node(peer_id)

        async def the_p2p() -> Any:
            return p2p

        opts = PeerOptions(stage=stage, max_rounds=max_rounds, linger=linger, event_sink=handle._record, **options)
        handle.peer = Peer(self.manifest, from_manifest(self.manifest), PeerNetwork(node, the_p2p, lambda: (), key=key), opts)
        handle.task = asyncio.create_task(handle.peer.run(handle.stop), name=f"in-process-{name}")
        handle.task.add_done_callback(lambda _: self._changed.set())
        self.peers.append(handle)
        return handle

    async def stop(self, peer: InProcessPeer, timeout: float | None = None) -> None:
        """A clean stop, as SIGTERM gives one: the peer leaves within timeouts.shutdown."""
        peer.stop.set()
        assert peer.task is not None
        await asyncio.wait_for(asyncio.shield(peer.task), timeout or self.manifest.timeouts.shutdown)

    async def kill(self, peer: InProcessPeer) -> None:
        """As SIGKILL: from now on the peer reaches nobody and says nothing (no LEAVING record, no
        more events); its streams reset and its records stay in the DHT until they expire."""
        peer.killed = True
        self.dht.unreachable.add(peer.peer_id)
        self.net.kill(peer.peer_id)
        assert peer.task is not None
        peer.task.cancel()
        await asyncio.gather(peer.task, return_exceptions=True)

    def client(self, seed: str = "client") -> LoopbackP2P:
        """A bare node on the swarm's transport that is no peer (a probe, a stranger's client)."""
        return self.net.node(peer_ids(1, seed)[0])

    def set_link(self, a: InProcessPeer, b: InProcessPeer, spec: LinkSpec) -> None:
        self.net.set_link(a.peer_id, b.peer_id, spec)

    # waiting ------------------------------------------------------------------------------------------
    async def until(self, condition: Callable[[], Any], timeout: float, what: str) -> Any:
        """Wait until `condition()` is truthy (checked at every event and peer exit); returns its value.
        Fails with each peer's history if it is not within `timeout` seconds, or if a peer failed."""
        deadline = self._loop.time() + timeout
        while True:
            self._changed.clear()
            self._raise_failures()
            value = condition()
            if value:
                return value
            left = deadline - self._loop.time()
            if left <= 0:
                raise AssertionError(f"timed out after {timeout:g}s waiting for {what}\n{self.history()}")
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                pass

    async def wait_for(self, peer: InProcessPeer, predicate: Callable[[Event], bool], timeout: float,
                       what: str) -> Event:
        """The first event of `peer` that satisfies `predicate` (as LocalSwarm.wait_for)."""
        return await self.until(lambda: next((e for e in peer.events() if predicate(e)), None), timeout, what)

    async def wait_round(self, peer: InProcessPeer, timeout: float, what: str = "a round", **fields: Any) -> Event:
        """The first round event of `peer` whose fields have the given values (e.g. complete=True)."""
        return await self.wait_for(peer, lambda e: e["event"] == "round" and all(e[k] == v for k, v in fields.items()),
                                   timeout, what)

    def digests(self, stage: int) -> dict[int, set[str]]:
        """The θ_global digests the replicas of `stage` reported after each round they completed."""
        return {r: {e["digest"] for e in events} for r, events in complete_rounds(self.peers, stage).items()}

    async def wait_exit(self, timeout: float, peers: list[InProcessPeer] | None = None) -> None:
        """Wait until the peers (default: all) have ended; fails if one raised."""
        peers = self.peers if peers is None else peers
        await self.until(lambda: all(p.task is not None and p.task.done() for p in peers), timeout,
                         f"{', '.join(p.name for p in peers)} to end")

    async def run_two_by_two(self, max_rounds: int, timeout: float) -> None:
        """2 stages × 2 replicas, each running `max_rounds` rounds: the first driver comes online
        alone (it initialises the run), then the other three start; waits until all have ended."""
        first = self.start(0, max_rounds=max_rounds, linger=60.0)
        await self.wait_for(first, lambda e: e["event"] == "online", 30, "the first driver online")
        for stage in (1, 0, 1):
            self.start(stage, max_rounds=max_rounds, linger=60.0)
        await self.wait_exit(timeout)

    def _raise_failures(self) -> None:
        for p in self.peers:
            if p.task is not None and p.task.done() and not p.killed and not p.task.cancelled() \
                    and p.task.exception() is not None:
                raise AssertionError(f"{p.name} failed\n{self.history()}") from p.task.exception()

    def history(self) -> str:
        """Each peer's life and rounds, for a failure message."""
        lines = []
        for p in self.peers:
            life = [f"{e['event']}@{e['time'] % 1000:.2f}" for e in p.events()
                    if e["event"] in ("started", "state_initialised", "state_loaded", "state_restored", "online",
                                      "join_hold", "resynced", "stopped")]
            rounds = [f"r{e['round']}:{'ok' if e['complete'] else 'INCOMPLETE ' + e['reason']}/g{e['group_size']}"
                      f"@{e['time'] % 1000:.2f}" for e in p.events("round")]
            lines.append(f"  {p.name} (stage {p.stage}{', killed' if p.killed else ''}): {' '.join(life)}\n"
                         f"    {' '.join(rounds)}")
        return "\n".join(lines)

    async def close(self) -> list[BaseException]:
        """Stop every peer still running (cleanly, then by cancel), end the transport; the peers'
        failures, if any."""
        for p in self.peers:
            p.stop.set()
        tasks = [p.task for p in self.peers if p.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.manifest.timeouts.shutdown)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await self.net.close()
        return [t.exception() for p, t in ((p, p.task) for p in self.peers)
                if t is not None and not p.killed and not t.cancelled() and t.exception() is not None]


def complete_rounds(peers: list[InProcessPeer], stage: int) -> dict[int, list[Event]]:
    """Complete round events of `stage` by round."""
    out: dict[int, list[Event]] = {}
    for p in peers:
        for e in p.events("round"):
            if e["stage"] == stage and e["complete"]:
                out.setdefault(e["round"], []).append(e)
    return out


def assert_replicas_agree(peers: list[InProcessPeer], stage: int) -> None:
    """Every replica that completed a round holds the same θ_global after it."""
    for rnd, events in complete_rounds(peers, stage).items():
        digests = {e["digest"] for e in events}
        assert len(digests) == 1, f"stage {stage} round {rnd}: replicas disagree: {digests}"


def exact_round_manifest(tmp_path: Path, **sections: dict[str, Any]) -> Manifest:
    """The manifest of a one-round exactness test: fp32 on every wire, one inner step per round, a
    plain-mean outer step (lr 1, no momentum), no gradient clipping, evaluations off, trained on a
    corpus of torch's own sources written under `tmp_path`; so one round of the swarm is one AdamW
    step of the whole model. `sections` extend each section (small_manifest's keyword arguments)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"".join(p.read_bytes() for p in sorted(Path(torch.__file__).parent.glob("*.py"))[:20]))
    raw: dict[str, dict[str, Any]] = {
        "model": {},
        "inner": {"lr": 1e-3, "grad_clip": 0.0, "weight_decay": 0.1, "microbatch_size": 4, "microbatches_per_step": 2},
        "outer": {"lr": 1.0, "momentum": 0.0, "nesterov": False},
        "rounds": {"inner_steps": 1, "round_seconds": 0.0},
        "averaging": {"codec": "fp32"},
        "pipeline": {"activation_codec": "fp32", "gradient_codec": "fp32", "max_in_flight": 2},
        "data": {"source": "files", "paths": [str(corpus)], "max_bytes": 0, "eval_batches": 1, "eval_every": 0},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return small_manifest(**raw)


def saved_round(save_dir: Path, stage: int) -> dict[str, torch.Tensor]:
    """The parameters of the one round `one_saved_round` saved for `stage` under `save_dir`."""
    from swarmgrad.peer.state.stage_state import load_checkpoint
    files = list(save_dir.glob(f"stage{stage}-*.safetensors"))
    assert len(files) == 1, files
    params, _, meta = load_checkpoint(files[0])
    assert meta["applied_rounds"] == "1"
    return params


async def one_saved_round(m: Manifest, tmp_path: Path, data_seed: int) -> list[Path]:
    """Stage 0 and stage 1, one peer each, train one round and save it: their save dirs."""
    async with InProcessSwarm(m, tmp_path=tmp_path) as swarm:
        peers = [swarm.start(s, max_rounds=1, data_seed=data_seed, save=True, linger=5.0) for s in (0, 1)]
        await swarm.wait_exit(60)
        return [Path(p.peer.opt.save_dir) for p in peers]  # type: ignore[union-attr,arg-type]
