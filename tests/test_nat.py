"""Volunteers behind NAT (docs/nat.md): what `--reachability` decides, who a NATed peer dials, and a
swarm in network namespaces where one stage replica cannot be dialled at all.

The swarm test is skipped, with the reason, where namespaces cannot be made (not root, no
iproute2). Its NAT is a tc filter that drops every new inbound TCP connection to the peer
(benchmarks/harness/netns.py `drop_inbound_connections`); the peer's own connections work both ways."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from swarmgrad.peer.net.dial_out import dial_targets
from swarmgrad.peer.manifest import dumps
from swarmgrad.peer.net.reachability import plan
from swarmgrad.peer.records import JOINING, LEAVING, ONLINE, PeerRecord

from benchmarks.harness import netns
from conftest import small_manifest
from test_swarm import assert_replicas_agree, complete_rounds, round_history

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tiny-gpt.toml"
WHY = netns.why_unavailable()


# --- the pure decisions -------------------------------------------------------------------------
def test_each_mode_maps_to_its_libp2p_options() -> None:
    public = plan("public", ["/ip4/0.0.0.0/tcp/31337"], [])
    assert (public.mode, public.serves) == ("public", True)
    assert public.dht_kwargs["force_reachability"] == "public" and not public.dht_kwargs["use_auto_relay"]
    relay = plan("relay", ["/ip4/0.0.0.0/tcp/0"], [])
    assert (relay.mode, relay.serves) == ("relay", True)
    assert relay.dht_kwargs == dict(use_relay=True, use_auto_relay=True, force_reachability="private",
                                    client_mode=True)
    client = plan("client", ["/ip4/0.0.0.0/tcp/0"], [])
    assert (client.mode, client.serves) == ("client", False)
    assert client.dht_kwargs["client_mode"] and not client.dht_kwargs["use_auto_relay"]


@pytest.mark.parametrize("host, announce, mode", [
    (["/ip4/127.0.0.1/tcp/0"], [], "public"),            # a local swarm: nobody is behind NAT
    (["/ip6/::1/tcp/0", "/ip4/127.0.0.1/tcp/0"], [], "public"),
    (["/ip4/0.0.0.0/tcp/4000"], ["/ip4/203.0.113.7/tcp/4000"], "public"),  # the operator said where
    (["/ip4/0.0.0.0/tcp/0"], [], "auto"),                 # AutoNAT decides at run time
    (["/ip4/127.0.0.1/tcp/0", "/ip4/10.0.0.5/tcp/0"], [], "auto"),
    (["/dns4/example.org/tcp/0"], [], "auto"),
])
def test_auto_resolves_from_the_addresses(host: list[str], announce: list[str], mode: str) -> None:
    p = plan("auto", host, announce)
    assert p.mode == mode and p.serves, p
    assert p.reason.startswith("auto")
    if mode == "auto":
        assert p.dht_kwargs["use_auto_relay"] and "force_reachability" not in p.dht_kwargs


@pytest.mark.parametrize("mode", ["relay", "client"])
def test_a_natted_mode_with_an_announced_address_is_refused(mode: str) -> None:
    with pytest.raises(ValueError, match="--announce-maddrs"):
        plan(mode, ["/ip4/0.0.0.0/tcp/4000"], ["/ip4/203.0.113.7/tcp/4000"])
    with pytest.raises(ValueError, match="--reachability"):
        plan("nat", [], [])


def _rec(peer_id: str, stage: int, state: str = ONLINE, maddrs: tuple[str, ...] = ("/ip4/10.0.0.1/tcp/1",)
         ) -> PeerRecord:
    return PeerRecord(peer_id=peer_id, stage=stage, state=state, throughput=1.0, round=0, applied_rounds=0,
                      digest="d", manifest_hash="h", driver=stage == 0, maddrs=maddrs)


def test_dial_targets_own_stage_first_and_skips_what_cannot_or_need_not_be_dialled() -> None:
    records = {0: [_rec("d1", 0), _rec("d2", 0, LEAVING)],
               1: [_rec("me", 1), _rec("r1", 1), _rec("r2", 1, JOINING), _rec("r3", 1, maddrs=())],
               2: [_rec("n1", 2)], 3: [_rec("far", 3)]}
    got = [r.peer_id for r in dial_targets(records, connected=["r1"], me="me", my_stage=1)]
    # r1: already connected; d2: leaving; r3: no address; me: us. Own stage, then neighbours, then the rest
    assert got == ["r2", "d1", "n1", "far"]
    assert [r.peer_id for r in dial_targets(records, ["r1"], "me", 1, limit=3)] == ["r2", "d1"]  # r1 counts
    assert [r.peer_id for r in dial_targets(records, [], "me", None)][:1] == ["d1"]  # no stage yet: drivers
    everyone = ["d1", "d2", "r1", "r2", "r3", "n1", "far"]
    assert dial_targets(records, everyone, "me", 1) == []


def test_client_refuses_a_stage_other_than_0() -> None:
    out = subprocess.run([sys.executable, "-m", "swarmgrad.peer.cli", "peer", "--manifest", str(EXAMPLE),
                          "--reachability", "client", "--stage", "1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    assert "--reachability client" in out.stderr.strip().splitlines()[-1] and "Traceback" not in out.stderr


# --- a swarm in namespaces, one replica behind NAT ----------------------------------------------
PORT = 31330
"""Every peer listens on this port: each namespace has its own ports, so they cannot collide."""


def _connects(source: netns.Endpoint, host: str, port: int) -> bool:
    """Whether a new TCP connection from `source`'s namespace to host:port is accepted within 3 s."""
    probe = ("import socket,sys\ntry:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), 3).close()\n"
             "except OSError:\n sys.exit(1)")
    return subprocess.run([*source.exec_prefix(), sys.executable, "-c", probe, host, str(port)],
                          capture_output=True, timeout=30).returncode == 0


@pytest.fixture
def natted_net() -> Iterator[netns.WanNet]:
    """3 namespaces on a bridge; peer 2 cannot be dialled. Deleted whatever the test did.

    Public-looking addresses (11.77.x: the namespaces have no route out) so that libp2p treats the
    peers as it would on the internet: a peer whose reachability is private then announces no
    address at all, and is reached only over the connections it opens (or through a relay)."""
    netns.remove_stale()
    with netns.WanNet("nat", 3, subnet=240, prefix="11.77") as net:
        net.drop_inbound_connections(2)
        yield net


@pytest.mark.skipif(WHY is not None, reason=f"no network namespaces: {WHY}")
# Out of `make test` until more runs confirm the fix: in 1 run of ~7 the NATed replica did not see
# its partner's registration from round 2 on (its client-mode DHT had lost its routing table; now
# dial_out.keep_in_routing_table puts peers back); 7 of 7 passed after the fix (2026-12-01).
@pytest.mark.skipif(not os.environ.get("SWARMGRAD_SLOW_TESTS"),
                    reason="opt-in (~40 s, a flake fixed, to be confirmed): set SWARMGRAD_SLOW_TESTS=1 or run `make test-slow`")
@pytest.mark.timeout(150)
def test_a_replica_behind_nat_serves_and_averages(natted_net: netns.WanNet, tmp_path: Path) -> None:
    """A: public driver (stage 0, the swarm's entry); B: public replica of stage 1; C: replica of
    stage 1 behind NAT with --reachability relay. C must get microbatches from A and average with B
    in every round both complete, with the same θ_global as B."""
    manifest = tmp_path / "manifest.toml"
    manifest.write_text(dumps(small_manifest()))
    common = ("--max-rounds", "4", "--linger", "10")
    with netns.NetnsSwarm(manifest, tmp_path / "swarm", natted_net.endpoints, port=PORT) as swarm:
        swarm.start_first(0, "--reachability", "public", *common)
        b = swarm.start(1, "--reachability", "public", *common)
        c = swarm.start(1, "--reachability", "relay", *common)
        for p in (b, c):
            swarm.wait_for(p, lambda e: e["event"] == "started", 60, "started")
        # the NAT is real: from A's namespace, B's port takes a new connection and C's does not
        a_ns, b_ip, c_ip = natted_net.endpoints[0], natted_net.endpoints[1].address, natted_net.endpoints[2].address
        assert _connects(a_ns, b_ip, PORT) and not _connects(a_ns, c_ip, PORT)
        codes = swarm.wait_exit(100)
        history = round_history(swarm.peers, 1)
        logs = "\n".join(f"--- {p.name}\n{p.log_tail(15)}" for p in swarm.peers)
        assert codes == [0, 0, 0], logs
    started = c.events("started")[0]
    assert started["reachability"] == "relay", started
    assert_replicas_agree([b, c], 1)
    # rounds both replicas completed (the first one up completes its first rounds alone)
    both = {r: events for r, events in complete_rounds([b, c], 1).items() if len(events) == 2}
    assert len(both) >= 3, f"too few rounds completed by both replicas\n{history}"
    assert all(e["group_size"] == 2 for events in both.values() for e in events), \
        f"the replicas did not average together\n{history}"
    natted = [e for events in both.values() for e in events if e["peer"] == c.events("started")[0]["peer"]]
    assert sum(e["samples"] for e in natted) > 0, f"no driver reached the NATed replica\n{history}"


class _FixedSwarm:
    """A swarm view that always reads the same records (DialOut needs nothing else from it)."""

    def __init__(self, records: dict[int, list[PeerRecord]]):
        self.records = records

    async def swarm(self) -> dict[int, list[PeerRecord]]:
        return self.records


def test_dial_out_opens_a_connection_the_other_peer_can_call_back_over(p2p_daemons: None, tmp_path: Path) -> None:
    """Two real p2p daemons on loopback: X dials Y because Y's record says where it is; then Y sees
    X among its connections (what lets a NATed X be called back), the dial is reported as an
    event, and a second look dials nobody."""
    import asyncio

    from hivemind.p2p import P2P

    from swarmgrad.peer.net.dial_out import DialOut
    from swarmgrad.peer.events import EventLog, read_events

    async def scenario() -> str:
        x, y = await P2P.create(), await P2P.create()
        try:
            y_id = y.peer_id.to_base58()
            record = _rec(y_id, 1, maddrs=tuple(str(a) for a in await y.get_visible_maddrs()))
            events = EventLog(str(tmp_path / "x.jsonl"), peer="x")
            dial = DialOut(x, _FixedSwarm({1: [record]}), peer_id=x.peer_id.to_base58(), stage=lambda: 1,
                           interval=1.0, timeout=10.0, events=events)
            assert x.peer_id not in {p.peer_id for p in await y.list_peers()}
            assert await dial.step() == 1
            assert x.peer_id in {p.peer_id for p in await y.list_peers()}
            assert await dial.step() == 0  # already connected
            events.close()
            return y_id
        finally:
            await x.shutdown()
            await y.shutdown()

    y_id = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert [e["peers"] for e in read_events(tmp_path / "x.jsonl") if e["event"] == "dialled_out"] == [[y_id]]


@pytest.fixture
def two_natted_net() -> Iterator[netns.WanNet]:
    """6 namespaces on a bridge: peers 1 and 2 cannot be dialled; 3..5 host bare relays."""
    netns.remove_stale()
    with netns.WanNet("nn", 6, subnet=241, prefix="11.77") as net:
        net.drop_inbound_connections(1)
        net.drop_inbound_connections(2)
        yield net


@pytest.mark.skipif(WHY is not None, reason=f"no network namespaces: {WHY}")
@pytest.mark.skipif(not os.environ.get("SWARMGRAD_SLOW_TESTS"),
                    reason="slow (~80 s, 6 processes): set SWARMGRAD_SLOW_TESTS=1 or run `make test-slow`")
@pytest.mark.timeout(240)
def test_two_replicas_behind_nat_average_through_a_relay(two_natted_net: netns.WanNet, tmp_path: Path) -> None:
    """Both replicas of stage 1 behind NAT: they can only meet through a relay. Three `swarmgrad
    relay` peers beside the driver give p2pd the 4 relay candidates it needs to reserve at once
    (with fewer it waits 3 minutes, docs/nat.md)."""
    manifest = tmp_path / "manifest.toml"
    manifest.write_text(dumps(small_manifest()))
    # 10 rounds: the replica that finds stage 1 empty starts training at once, and the other's
    # download through a relay took 15-30 s (4-8 rounds), so 6 rounds left as few as 2 together
    common = ("--max-rounds", "10", "--linger", "10")
    relays: list[subprocess.Popen] = []
    # the relays' temp folders (multiprocessing's pymp-*), removed below: SIGKILLed, they cannot
    relay_tmp = tempfile.mkdtemp(prefix="swarmgrad-relays-")
    with netns.NetnsSwarm(manifest, tmp_path / "swarm", two_natted_net.endpoints, port=PORT) as swarm:
        try:
            swarm.start_first(0, "--reachability", "public", *common)
            for ep in two_natted_net.endpoints[3:]:
                relays.append(subprocess.Popen(
                    [*ep.exec_prefix(), sys.executable, "-m", "swarmgrad.peer.cli", "relay", "--host-maddrs",
                     f"/ip4/{ep.address}/tcp/{PORT}", "--initial-peers", *swarm.initial_peers],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                    env={**os.environ, "TMPDIR": relay_tmp}))
            b = swarm.start(1, "--reachability", "relay", *common)
            c = swarm.start(1, "--reachability", "relay", *common)
            codes = swarm.wait_exit(180)
            history = round_history(swarm.peers, 1)
            logs = "\n".join(f"--- {p.name}\n{p.log_tail(15)}" for p in swarm.peers)
            assert codes == [0, 0, 0], logs
        finally:
            for relay in relays:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(relay.pid, signal.SIGKILL)
                relay.wait(10)
            shutil.rmtree(relay_tmp, ignore_errors=True)
    assert_replicas_agree([b, c], 1)
    both = [r for r, events in complete_rounds([b, c], 1).items()
            if len(events) == 2 and all(e["group_size"] == 2 for e in events)]
    assert len(both) >= 3, f"the NATed replicas did not average together\n{history}"


async def _forget_every_peer(_dht, node) -> int:
    """In the DHT process: what unanswered requests do to a client-mode node's routing table."""
    table = node.protocol.routing_table
    for uid in list(table.uid_to_peer_id):
        del table[uid]
    return len(table.uid_to_peer_id)


def test_a_client_mode_dht_that_forgot_its_peers_is_put_back(p2p_daemons: None) -> None:
    """A client-mode DHT node (a NATed peer's) whose routing table lost its only peer reads
    nothing any more; DialOut's look pings the peers it knows back into the table, and reads work
    again. Two real DHT processes on loopback."""
    import asyncio
    import functools

    from hivemind.utils import get_dht_time

    from swarmgrad.peer.net.dht_process import start_dht_process
    from swarmgrad.peer.net.dial_out import DialOut, keep_in_routing_table

    public = start_dht_process(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    natted = None
    try:
        natted = start_dht_process(client_mode=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                   initial_peers=[str(a) for a in public.get_visible_maddrs()])
        assert public.store("k", "v", get_dht_time() + 60)
        assert natted.get("k", latest=True).value == "v"
        assert natted.run_coroutine(_forget_every_peer) == 0
        assert public.store("k2", "v2", get_dht_time() + 60)
        assert natted.get("k2", latest=True) is None  # isolated: the failure seen in the NAT test

        async def look() -> int:
            p2p = await natted.replicate_p2p()
            dial = DialOut(p2p, _FixedSwarm({}), peer_id=str(natted.peer_id), stage=lambda: 0, interval=1.0,
                           timeout=10.0, dht=natted, initial_peers=[str(public.peer_id)])
            await dial.step()
            return dial.rejoined
        assert asyncio.run(asyncio.wait_for(look(), 60)) == 1
        assert natted.get("k2", latest=True).value == "v2"
        # nothing missing: nobody is pinged
        assert natted.run_coroutine(functools.partial(keep_in_routing_table, peer_ids=(str(public.peer_id),))) == 0
    finally:
        if natted is not None:
            natted.shutdown()
        public.shutdown()
