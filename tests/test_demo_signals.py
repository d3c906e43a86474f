"""`swarmgrad demo` stopped as users stop programs (`kill PID`, a closed terminal) stops its swarm
too. Its peers run in sessions of their own, so a signal to the demo alone never reaches them:
before, a SIGTERM ended the demo at once and left its peers training, with their DHT processes
and p2pd."""
from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from swarmgrad.peer.manifest import dumps

from conftest import small_manifest

pytestmark = pytest.mark.timeout(180)


def _processes_of(workdir: Path) -> list[psutil.Process]:
    """Processes whose command line names the demo's folder (its peers; their DHT processes and
    p2pd are killed with the peers' process groups)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        with_dir = any(str(workdir) in part for part in (p.info["cmdline"] or []))
        if with_dir and p.pid != psutil.Process().pid:
            found.append(p)
    return found


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_the_demo_stops_its_peers(tmp_path: Path, signum: signal.Signals) -> None:
    manifest = tmp_path / "manifest.toml"
    manifest.write_text(dumps(small_manifest()))
    workdir = tmp_path / "demo"
    demo = subprocess.Popen([sys.executable, "-m", "swarmgrad.peer.cli", "demo", "--manifest", str(manifest),
                             "--rounds", "50", "--replicas", "1", "--workdir", str(workdir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # both peers serving
            logs = [workdir / f"peer{i}.events.jsonl" for i in (0, 1)]
            if all(p.exists() and '"online"' in p.read_text() for p in logs):
                break
            assert demo.poll() is None, demo.communicate()[0]
            time.sleep(0.5)
        else:
            pytest.fail("the demo's peers did not come online")
        peers = _processes_of(workdir)
        assert len(peers) >= 2
        demo.send_signal(signum)  # the demo alone, not its group: `kill PID`
        out, _ = demo.communicate(timeout=60)
        assert f"stopped by {signum.name}; stopping the swarm" in out, out
        _, alive = psutil.wait_procs(peers, timeout=10)
        assert not alive, [p.cmdline() for p in alive]
        assert not _processes_of(workdir)
    finally:
        if demo.poll() is None:
            demo.kill()
        for p in _processes_of(workdir):
            with contextlib.suppress(psutil.Error):
                p.kill()
