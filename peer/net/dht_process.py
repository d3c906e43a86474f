"""hivemind's DHT process (forked; it runs the Go daemon p2pd) in a process group of its own,
stopped by the peer that started it and dying with it.

Why: users stop programs with Ctrl-C (SIGINT to the terminal's foreground process group) or a
SIGTERM to the process group (`kill -TERM -PGID`, supervisors). In the peer's group, the DHT child
and p2pd would get that SIGTERM too and die at once, so the peer's own shutdown could not announce
LEAVING. Measured with hivemind 1.1.12 (docs/architecture.md, "Stopping a peer"): both already
ignore SIGINT, but p2pd exits on SIGTERM whatever it inherits (its Go runtime traps SIGTERM even
when started with it ignored or blocked), so only keeping the signal away from p2pd helps. In a
group of their own no group signal reaches them; the peer stops them (`shutdown`).

Outside the peer's group a group SIGKILL does not reach them either, so the child
watches its parent: prctl(PR_SET_PDEATHSIG) on Linux when the DHT is created from the main thread
(the signal follows the creating *thread*), otherwise a thread polling getppid(). Either way it
gets SIGTERM, and SIGTERM in the child (also hivemind's own `terminate()` fallback) ends its
descendants (p2pd, which then removes its control socket) and the child. A SIGKILLed peer, alone
or with its group, leaves nothing running.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from hivemind import DHT

logger = logging.getLogger(__name__)

CHILDREN_GRACE_S = 2.0
"""How long the DHT process gives p2pd to exit on SIGTERM (it closes its host and removes its
control socket, well under a second here) before it SIGKILLs it. Not a network wait."""
STOP_GRACE_S = 3.0
"""After hivemind's own shutdown (a message, then SIGTERM after `shutdown_timeout`), how long the
peer waits for the DHT process before it SIGKILLs it and its descendants."""
PARENT_POLL_S = 0.5
"""Period of the getppid() watchdog (used only where PR_SET_PDEATHSIG cannot be)."""

_PR_SET_PDEATHSIG = 1


class PeerDHT(DHT):
    """A `hivemind.DHT` whose process leaves the creator's process group at once and stops when
    the creator dies. Create it with `start_dht_process`; `shutdown()` always ends the process and
    its descendants (SIGKILL after `STOP_GRACE_S` if it does not stop by itself)."""

    def __init__(self, *args: Any, **kwargs: Any):
        # set before hivemind's __init__: with start=True it forks from there
        self._owner_pid = os.getpid()
        self._owner_is_main_thread = threading.current_thread() is threading.main_thread()
        super().__init__(*args, **kwargs)

    # the child process --------------------------------------------------------------------------
    def run(self) -> None:
        with contextlib.suppress(OSError):  # also done by the parent; whichever runs first wins
            os.setpgid(0, 0)
        signal.signal(signal.SIGTERM, _stop_descendants_and_exit)
        _watch_parent(self._owner_pid, self._owner_is_main_thread)
        began = time.time()
        try:
            super().run()
        finally:
            if getattr(self, "_node", None) is None:
                # the start failed (no initial peer answered): hivemind returns here without
                # stopping its p2pd, which dies soon after and leaves its control socket in /tmp
                _kill_all(psutil.Process().children(recursive=True), grace=CHILDREN_GRACE_S, term_first=True)
                remove_dead_sockets(began)

    # the peer's process -------------------------------------------------------------------------
    def start(self) -> None:
        super().start()
        with contextlib.suppress(OSError):  # the child may have done it (EACCES after it did is fine too)
            os.setpgid(self.pid, self.pid)

    def shutdown(self) -> None:
        """hivemind's shutdown (ask the process to stop; SIGTERM after `shutdown_timeout`), then
        SIGKILL for whatever of the process and its descendants is still running after
        `STOP_GRACE_S`."""
        if os.getpid() != self._owner_pid or self.pid is None:
            return super().shutdown()
        descendants = _descendants(self.pid)  # while it runs: after its exit they are orphans
        super().shutdown()
        self.join(STOP_GRACE_S)
        if self.exitcode is None:
            logger.warning("the DHT process did not stop within %.0fs of shutdown; killing it", STOP_GRACE_S)
            self.kill()
            self.join(STOP_GRACE_S)
        _end_daemons(descendants, grace=CHILDREN_GRACE_S)  # p2pd got SIGTERM from it or from hivemind


def start_dht_process(**kwargs: Any) -> PeerDHT:
    """`hivemind.DHT(**kwargs)` in its own process group, started and ready (same errors as
    hivemind's: P2PDaemonError, a failed bootstrap). Call it before torch starts threads (hivemind
    forks), from the main thread: the process then learns of the caller's death at once
    (PR_SET_PDEATHSIG); from another thread, within `PARENT_POLL_S`. When the start fails, the
    error is raised once the process has stopped its p2pd and removed the daemon's socket."""
    start = kwargs.pop("start", True)
    dht = PeerDHT(start=False, **kwargs)
    if start:
        try:
            dht.run_in_background(await_ready=kwargs.get("await_ready", True))
        except BaseException:
            dht.join(2 * CHILDREN_GRACE_S + STOP_GRACE_S)
            if dht.exitcode is None:
                dht.kill()
                dht.join(STOP_GRACE_S)
            raise
    return dht


# helpers (the DHT's process) --------------------------------------------------------------------
def _watch_parent(owner: int, main_thread: bool) -> None:
    """Deliver SIGTERM to this process when `owner` dies."""
    armed = False
    if main_thread and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if not armed:
        threading.Thread(target=_poll_parent, args=(owner,), name="parent-watchdog", daemon=True).start()
    if os.getppid() != owner:  # it died before the watch was armed
        os.kill(os.getpid(), signal.SIGTERM)


def _poll_parent(owner: int) -> None:
    while os.getppid() == owner:
        time.sleep(PARENT_POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)


def _stop_descendants_and_exit(signum: int, frame: object) -> None:
    """SIGTERM in the DHT's process: its parent died, hivemind's shutdown fell back to
    `terminate()`, or someone signals it. p2pd gets SIGTERM (it closes its host and removes its
    control socket), what is left after `CHILDREN_GRACE_S` SIGKILL; then exit."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        _end_daemons(psutil.Process().children(recursive=True), grace=CHILDREN_GRACE_S)
    finally:
        os._exit(128 + signum)


# helpers (either process) -----------------------------------------------------------------------
def _end_daemons(procs: list, grace: float) -> None:
    """`_kill_all(procs)` with SIGTERM first, then unlink the control sockets of the p2pd daemons
    among them: p2pd removes its own on SIGTERM, not when SIGKILLed or when it dies orphaned."""
    sockets = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            sockets += p2pd_sockets(p)
    _kill_all(procs, grace=grace, term_first=True)
    for path in sockets:
        with contextlib.suppress(OSError):
            os.unlink(path)


def p2pd_sockets(proc: psutil.Process) -> list[str]:
    """The unix control socket a p2pd process listens on (its `-listen=/unix/PATH` argument); none
    for any other process. Raises psutil.Error for a process that is gone."""
    return [a.removeprefix("-listen=/unix") for a in proc.cmdline() if a.startswith("-listen=/unix/")]


def remove_dead_sockets(since: float, folder: Path = Path("/tmp")) -> list[Path]:
    """Unlink the p2pd control sockets made since `since` that nobody listens on (hivemind puts
    them in /tmp whatever TMPDIR says). Go's listener binds and listens in one call, so a refused
    connection means the daemon is gone; a live daemon takes the probe's empty connection quietly.
    Never hivemind's client sockets: each connection to one is an incoming stream to a peer."""
    removed = []
    for path in folder.glob("hivemind-p2pd-*.sock"):
        try:
            if path.stat().st_mtime < since - 1.0:
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(1.0)
                probe.connect(str(path))
        except ConnectionRefusedError:
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path)
        except OSError:
            continue  # gone already, or busy: not ours to judge
    return removed


def _descendants(pid: int) -> list:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _kill_all(procs: list, grace: float, term_first: bool = False) -> None:
    """End `procs` (psutil processes: safe against pid reuse): optionally SIGTERM and wait `grace`
    seconds, then SIGKILL those still running and wait for them."""
    if not procs:
        return
    if term_first:
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.terminate()
    _, procs = psutil.wait_procs(procs, timeout=grace)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(procs, timeout=grace)
