"""A peer stopped the way users stop programs leaves cleanly, and nothing of it keeps running.

Ctrl-C in a terminal is SIGINT to the whole foreground process group; supervisors and
`kill -TERM -PGID` send SIGTERM to the group. The peer's DHT process and its p2pd run in a group
of their own (peer/net/dht_process.py), so only the peer gets the signal: it announces LEAVING (a
`leaving` event with `announced`, and a LEAVING record others read), shuts the DHT down and exits 0.
A SIGKILL to the group, or to the peer alone, reaches the DHT process through its parent-death
signal: it stops p2pd and exits. Before, a group SIGTERM killed p2pd at once (no LEAVING), and a
peer SIGKILLed alone left its DHT process and p2pd running.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Callable, Iterator

import psutil
import pytest

from swarmgrad.peer.cli.launcher import LocalSwarm, PeerProcess, _daemon_sockets

from conftest import small_manifest

pytestmark = pytest.mark.timeout(240)


def _tree(pid: int) -> list[psutil.Process]:
    """The process and everything it started (the DHT process, p2pd, torch's shm manager)."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _running(procs: list[psutil.Process], within: float) -> list[str]:
    """Those of `procs` still running (zombies count as gone) after up to `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{p.pid} {p.name()}")
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _dht_side(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The DHT process (forked: the peer's command line) and p2pd among a peer's `_tree`."""
    peer = procs[0].cmdline()
    return [p for p in procs[1:] if p.name() == "p2pd" or p.cmdline() == peer]


@contextlib.contextmanager
def _reader(maddrs: list[str], m) -> Iterator[Callable[[], dict[str, str]]]:
    """A client DHT in this test process; yields a function: peer id -> state of the stage-0
    records, as the remaining drivers and any newcomer read them."""
    from swarmgrad.peer.net.dht_process import start_dht_process
    from swarmgrad.peer.net.record_signing import SignedRecordValidator
    from swarmgrad.peer.net.dht_view import SwarmView
    dht = start_dht_process(initial_peers=maddrs, client_mode=True, startup_timeout=30,
                            record_validators=[SignedRecordValidator()])
    try:
        view = SwarmView(dht, m.run_id, m.hash, m.stages.count, m.timeouts.dht, m.timeouts.announce_ttl)
        yield lambda: {r.peer_id: r.state for r in asyncio.run(view.stage_records(0))}
    finally:
        dht.shutdown()


def test_group_signals_leave_cleanly_and_leave_nothing(local_swarm) -> None:
    m = small_manifest(stages={"count": 1})
    swarm: LocalSwarm = local_swarm(m)
    first = swarm.start_first(0, timeout=120)
    peers = [first, swarm.start(0), swarm.start(0), swarm.start(0)]
    for p in peers:
        swarm.wait_for(p, lambda e: e["event"] == "online", 120, "online")
    trees = {p.name: _tree(p.proc.pid) for p in peers}
    for p in peers:  # the design under test: the DHT process and p2pd are out of the peer's group
        dht_side = _dht_side(trees[p.name])
        assert sorted(q.name() for q in dht_side) == ["p2pd", "python"], trees[p.name]
        assert all(os.getpgid(q.pid) != p.proc.pid for q in dht_side), "DHT process or p2pd in the peer's group"
    witness = peers[3].events("started")[0]["maddrs"]

    def signal_and_announce(peer: PeerProcess, sig: int, records: Callable[[], dict[str, str]]) -> None:
        os.killpg(peer.proc.pid, sig)  # the whole group, as a terminal or supervisor does
        leaving = swarm.wait_for(peer, lambda e: e["event"] == "leaving", m.timeouts.shutdown + 10,
                                 "leaving")
        assert leaving["announced"] is True, peer.log_tail()
        # read at once: the record expires timeouts.announce_ttl after the announce
        assert records().get(leaving["peer"]) == "leaving"

    def left_cleanly(peer: PeerProcess, sig: int) -> None:
        assert peer.proc.wait(m.timeouts.shutdown + 20) == 0, peer.log_tail()
        log = peer.log_path.read_text()
        assert "could not announce that it is leaving" not in log
        # a clean stop says nothing alarming: streams open at shutdown end quietly (asyncio on 3.11
        # logged an ERROR with a traceback for each cancelled one)
        assert "Traceback" not in log and " ERROR " not in log, peer.log_tail(80)
        assert peer.events("stopped")
        assert not _running(trees[peer.name], 15), f"{signal.Signals(sig).name} left processes running"

    # one peer after the other announces that it leaves; their shutdowns then overlap
    stops = [(peers[0], signal.SIGINT),   # Ctrl-C
             (peers[1], signal.SIGTERM),  # kill -TERM -PGID, a supervisor
             (peers[2], signal.SIGHUP)]   # its terminal closed
    with _reader(witness, m) as records:
        for peer, sig in stops:
            signal_and_announce(peer, sig, records)
    for peer, sig in stops:
        left_cleanly(peer, sig)

    sockets = _daemon_sockets(peers[3].proc.pid)  # a SIGKILLed process cannot remove its own
    os.killpg(peers[3].proc.pid, signal.SIGKILL)  # a group SIGKILL (the tests' own teardown)
    assert peers[3].proc.wait(20) == -signal.SIGKILL
    assert not _running(trees[peers[3].name], 15), "a group SIGKILL left processes running"
    for path in sockets:
        with contextlib.suppress(OSError):
            os.unlink(path)


_HOLDER = textwrap.dedent("""
    import sys, threading, time
    from swarmgrad.peer.net.dht_process import start_dht_process
    box = []
    def create():
        box.append(start_dht_process(host_maddrs=["/ip4/127.0.0.1/tcp/0"], startup_timeout=60))
    if sys.argv[1] == "thread":  # no PR_SET_PDEATHSIG from another thread: the getppid() watchdog
        t = threading.Thread(target=create); t.start(); t.join()
    else:
        create()
    print(box[0].pid, flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("created_in", ["main", "thread"])
def test_dht_process_dies_with_a_killed_parent(p2p_daemons: None, created_in: str) -> None:
    """SIGKILL to the process that created the DHT, alone (its group untouched): the DHT process
    and its p2pd stop within seconds instead of running on as orphans."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, created_in], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    tree: list[psutil.Process] = []
    try:
        dht_pid = int(proc.stdout.readline())
        tree = _tree(proc.pid)
        assert sorted(p.name() for p in _dht_side(tree)) == ["p2pd", "python"], tree
        assert os.getpgid(dht_pid) == dht_pid != proc.pid
        proc.kill()  # the parent alone
        proc.wait(10)
        assert not _running(tree[1:], 15), f"the DHT process or p2pd outlived its parent ({created_in})"
    finally:
        proc.kill()
        for p in tree:  # whatever a failed run left
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait(10)
