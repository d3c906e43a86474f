"""`swarmgrad demo` stopped as users stop programs (`kill PID`, a closed terminal) stops its swarm
too. Its peers run in sessions of their own, so a signal to the demo alone never reaches them:
before, a SIGTERM ended the demo at once and left its peers training, with their DHT processes
and p2pd.

Both signals take one path: `stop_on_signals` turns each into KeyboardInterrupt inside the demo's
block (checked here in this process, for each), and the demo stops its swarm on that interrupt
(checked once, with a real demo and SIGTERM)."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from swarmgrad.peer.cli.launcher import stop_on_signals
from swarmgrad.peer.manifest import dumps

from conftest import processes_naming, small_manifest

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_each_stop_signal_interrupts_the_block_once(signum: signal.Signals) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    with stop_on_signals():
        with pytest.raises(KeyboardInterrupt) as interrupt:
            signal.raise_signal(signum)
        # the swarm's shutdown runs next: a second signal of either kind must not cut it short
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGHUP)
    assert str(interrupt.value) == f"stopped by {signum.name}"
    assert {s: signal.getsignal(s) for s in before} == before  # the program's own handlers are back


def test_a_signal_to_the_demo_stops_its_peers(spawned_peers: Path) -> None:
    signum = signal.SIGTERM
    manifest = spawned_peers / "manifest.toml"
    manifest.write_text(dumps(small_manifest()))
    workdir = spawned_peers / "demo"
    demo = subprocess.Popen([sys.executable, "-m", "swarmgrad.peer.cli", "demo", "--manifest", str(manifest),
                             "--rounds", "50", "--replicas", "1", "--workdir", str(workdir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # both peers serving (a poll of their event logs)
            logs = [workdir / f"peer{i}.events.jsonl" for i in (0, 1)]
            if all(p.exists() and '"online"' in p.read_text() for p in logs):
                break
            assert demo.poll() is None, demo.communicate()[0]
            time.sleep(0.5)
        else:
            pytest.fail("the demo's peers did not come online")
        peers = processes_naming(workdir)
        assert len(peers) >= 2
        demo.send_signal(signum)  # the demo alone, not its group: `kill PID`
        out, _ = demo.communicate(timeout=60)
        assert f"stopped by {signum.name}; stopping the swarm" in out, out
        _, alive = psutil.wait_procs(peers, timeout=10)
        assert not alive, [p.cmdline() for p in alive]
        assert not processes_naming(workdir)
    finally:
        if demo.poll() is None:
            demo.kill()
