"""Shared fixtures, and the tiers they put tests in.

Each test lands in a tier by the fixtures it uses (`TIER_OF_FIXTURE`), so that a test cannot
start real processes and still be counted a unit test: `local_swarm`, `module_swarm` and
`private_swarm` (real peer processes, each with its DHT child and p2pd, on 127.0.0.1 port 0; torn
down by process group whatever the test did) and `spawned_peers` (peers a `swarmgrad demo` or a
benchmark starts) make it `swarm`; `inprocess` (real peers in one event loop over tests/support's
in-memory DHT and loopback transport) `inprocess`; `p2p_daemons` (real libp2p daemons in or under
the test process, no peer) `wire`; `chromium` (headless Chromium) `browser`. A test with none of
them is `unit`, unless its module names its tier itself (`pytestmark = pytest.mark.inprocess`).
`pytest -m unit` runs the fast tier; docs/testing.md lists them.

hivemind puts p2pd's control sockets in /tmp whatever TMPDIR says, and a p2pd that dies without
stopping (SIGKILLed, orphaned) leaves its socket there: each test removes those it left and the
run's summary names the test, so a leak is seen and found rather than piling up on the machine.

`make test` runs on two pytest-xdist workers (`-n logical --maxprocesses 2 --dist loadgroup`): every
test that starts real processes (`PROCESS_TIERS`) is put in one xdist group, `processes`, which one
worker runs in file order while the other runs the unit, in-process and browser tests (the group
is passed to xdist's scheduler by tests/support/workers.py: xdist 3.8's own way is lost on pytest 9.2). So two swarms
never share the cores, a check of /tmp's p2pd sockets (tests/test_bootstrap_wait.py,
tests/test_private_run.py) sees only its own, and a module's shared swarm (`module_swarm`) is made
once. `pytest` without `-n` runs everything in this process, in order, as before."""
from __future__ import annotations

import os

# One compute thread per process, set before torch is imported (here, and in every process a test
# starts: they inherit it): the suite's models are tiny, and two OpenMP threads per process on a
# shared 2-core machine spin at every barrier: at load ~13, tests/test_sparse_rounds.py took 90 s
# with torch's default of 2 threads and 14 s with 1 (tests/test_model.py's 30 AdamW steps, 27 s and
# 0.3 s). LocalSwarm's peers already ran with 1 (peer/cli/launcher.py).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import asyncio  # noqa: E402
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator, TypeVar

import psutil
import pytest
import torch

from swarmgrad.peer.net.dht_process import remove_dead_sockets
from swarmgrad.peer.cli.launcher import LocalSwarm, PrivateSwarm
from swarmgrad.peer.cli.launcher import small_manifest  # noqa: F401  (tests import it from here)
from swarmgrad.peer.manifest import Manifest, dumps

os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # in case a plugin imported torch before us


TIERS = ("unit", "inprocess", "wire", "swarm", "browser")
TIER_OF_FIXTURE = {
    "local_swarm": "swarm", "module_swarm": "swarm", "private_swarm": "swarm", "spawned_peers": "swarm",
    "natted_net": "swarm", "two_natted_net": "swarm", "slow_net": "swarm",  # peers in network namespaces
    "inprocess": "inprocess",
    "p2p_daemons": "wire",
    "chromium": "browser",
}
"""The tier each fixture puts a test in (a test may be in several: a swarm checked in a browser)."""

PROCESS_TIERS = ("wire", "swarm")
"""Tiers whose tests start real processes (peers, DHT processes, p2pd): under pytest-xdist they run
one at a time, on one worker (the `processes` xdist group)."""

PROCESS_GROUP = "processes"


# tryfirst: xdist's own hook (on each worker) reads the xdist_group markers to name a test's group
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tiers = {TIER_OF_FIXTURE[name] for name in getattr(item, "fixturenames", ()) if name in TIER_OF_FIXTURE}
        for tier in sorted(tiers):
            item.add_marker(tier)
        if not any(item.get_closest_marker(tier) for tier in TIERS):
            item.add_marker("unit")
        if any(item.get_closest_marker(tier) for tier in PROCESS_TIERS):
            item.add_marker(pytest.mark.xdist_group(PROCESS_GROUP))


def _swarm_factory(folder: Path, make_swarm: Callable[[Path, Path], LocalSwarm]
                   ) -> tuple[Callable[[Manifest], LocalSwarm], list[LocalSwarm]]:
    swarms: list[LocalSwarm] = []

    def make(manifest: Manifest) -> LocalSwarm:
        path = folder / f"manifest{len(swarms)}.toml"
        path.write_text(dumps(manifest))
        swarm = make_swarm(path, folder / f"swarm{len(swarms)}")
        swarm.__enter__()
        swarms.append(swarm)
        return swarm
    return make, swarms


@pytest.fixture
def local_swarm(tmp_path: Path) -> Iterator[Callable[[Manifest], LocalSwarm]]:
    """local_swarm(manifest) -> a LocalSwarm of this test; every peer's process group is killed
    at the end of the test whatever happened."""
    make, swarms = _swarm_factory(tmp_path, LocalSwarm)
    yield make
    for swarm in swarms:
        swarm.close(grace=10.0)


@pytest.fixture(scope="module")
def module_swarm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[Callable[[Manifest], LocalSwarm]]:
    """As `local_swarm`, for one swarm that a module's tests share (each checks one thing while it
    runs): torn down after the module's last test, and the p2pd sockets it left are named in the
    summary under the module."""
    began = time.time()
    make, swarms = _swarm_factory(tmp_path_factory.mktemp("module-swarm"), LocalSwarm)
    yield make
    for swarm in swarms:
        swarm.close(grace=10.0)
    _note_sockets_left(request.config, f"{request.node.nodeid} (module swarm)", began)


@pytest.fixture
def private_swarm(tmp_path: Path) -> Iterator[Callable[[Manifest], PrivateSwarm]]:
    """private_swarm(manifest) -> a PrivateSwarm (a private run's coordinator and invited peers)
    of this test, torn down as `local_swarm`'s."""
    make, swarms = _swarm_factory(tmp_path, PrivateSwarm)
    yield make  # type: ignore[misc]
    for swarm in swarms:
        swarm.close(grace=10.0)


def processes_naming(folder: Path) -> list[psutil.Process]:
    """Processes (not this one) whose command line names `folder`: peers started in it."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if p.pid != os.getpid() and any(str(folder) in part for part in (p.info["cmdline"] or [])):
            found.append(p)
    return found


@pytest.fixture
def spawned_peers(tmp_path: Path) -> Iterator[Path]:
    """A folder for peers that the test starts other than through a LocalSwarm (`swarmgrad demo`, a
    benchmark script): every process whose command line names it is killed at the end of the test."""
    yield tmp_path
    for p in processes_naming(tmp_path):
        try:
            p.kill()
        except psutil.Error:
            pass


_DAEMONS_LEFT = pytest.StashKey[list]()  # (test id, process descriptions) per wire test that left daemons


def _daemons_under(me: psutil.Process) -> list[psutil.Process]:
    """p2pd processes and forked DHT processes (this process's command line) under `me`; not
    torch's shm manager, which this process may still use."""
    out = []
    for p in me.children(recursive=True):
        try:
            if p.name() == "p2pd" or p.cmdline() == me.cmdline():
                out.append(p)
        except psutil.Error:
            pass
    return out


@pytest.fixture
def p2p_daemons(request: pytest.FixtureRequest) -> Iterator[None]:
    """For a test that starts real libp2p daemons itself (hivemind `P2P` instances, DHT processes;
    no peer process). Daemons under this process that the test started and that still run a few
    seconds after it ended are killed and named in the run's summary, as leaked sockets are."""
    me = psutil.Process()
    before = {p.pid for p in _daemons_under(me)}
    yield
    new = [p for p in _daemons_under(me) if p.pid not in before]
    _, alive = psutil.wait_procs(new, timeout=5)
    left = []
    for p in alive:
        try:
            left.append(f"{p.pid} {p.name()}")
            p.kill()
        except psutil.Error:
            pass
    if left:
        request.config.stash[_DAEMONS_LEFT].append((request.node.nodeid, left))


@pytest.fixture
def chromium() -> Path:
    """Headless Chromium (tests/support/browser.py); the test skips where it is missing."""
    from support.browser import CHROMIUM, SKIP_REASON, chromium_available
    if not chromium_available():
        pytest.skip(SKIP_REASON)
    return CHROMIUM


T = TypeVar("T")

INPROCESS_TIMEOUT_S = 60.0
"""Default deadline of an in-process scenario: each runs in seconds, so a hang fails fast."""


@pytest.fixture
def inprocess() -> Callable[..., Any]:
    """Runs an in-process scenario (tests/support/swarm.py): `inprocess(coroutine_function,
    timeout=...)` runs it in a fresh event loop and fails the test if it takes longer than
    `timeout` seconds (INPROCESS_TIMEOUT_S by default). Puts the test in the `inprocess` tier."""

    def run(scenario: Callable[[], Awaitable[T]], timeout: float = INPROCESS_TIMEOUT_S) -> T:
        async def bounded() -> T:
            try:
                return await asyncio.wait_for(scenario(), timeout)
            except asyncio.TimeoutError:
                raise AssertionError(f"the in-process scenario did not end within {timeout:g}s") from None
        return asyncio.run(bounded())
    return run




_LEFT = pytest.StashKey[list]()  # (test id, socket names) per test that left sockets
_BEGAN = pytest.StashKey[float]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_LEFT] = []
    config.stash[_DAEMONS_LEFT] = []
    config.stash[_BEGAN] = time.time()


def _note_sockets_left(config: pytest.Config, nodeid: str, began: float) -> None:
    left = remove_dead_sockets(began)
    if left:
        config.stash[_LEFT].append((nodeid, [p.name for p in left]))


def _on_a_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")  # set by pytest-xdist in its workers only


@pytest.fixture(autouse=True)
def _hivemind_sockets_left(request: pytest.FixtureRequest) -> Iterator[None]:
    # on an xdist worker, a test outside the process tiers would find (and be named for) the dead
    # sockets of the test the other worker runs at the same time: those are left to the next
    # process test and to the end of the run
    check = not _on_a_worker(request.config) or any(
        request.node.get_closest_marker(tier) for tier in PROCESS_TIERS)
    began = time.time()
    yield
    if check:
        _note_sockets_left(request.config, request.node.nodeid, began)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _on_a_worker(session.config):  # what this worker found, for the summary in the main process
        session.config.workeroutput["swarmgrad_left"] = {  # type: ignore[attr-defined]
            "sockets": [[nodeid, list(names)] for nodeid, names in session.config.stash[_LEFT]],
            "daemons": [[nodeid, list(procs)] for nodeid, procs in session.config.stash[_DAEMONS_LEFT]]}


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: called in the main process as a worker ends
def pytest_testnodedown(node: Any, error: Any) -> None:
    found = getattr(node, "workeroutput", {}).get("swarmgrad_left")
    if found:
        node.config.stash[_LEFT].extend((nodeid, names) for nodeid, names in found["sockets"])
        node.config.stash[_DAEMONS_LEFT].extend((nodeid, procs) for nodeid, procs in found["daemons"])


# The `processes` group under `--dist loadgroup`, whatever pytest's node ids (tests/support/workers.py)
_GROUPS_FOLDER = pytest.StashKey[str]()


@pytest.hookimpl(optionalhook=True)  # pytest-xdist, main process: before a worker starts
def pytest_configure_node(node: Any) -> None:
    from support.workers import GROUPS_KEY
    if _GROUPS_FOLDER not in node.config.stash:
        node.config.stash[_GROUPS_FOLDER] = tempfile.mkdtemp(prefix="swarmgrad-xdist-groups-")
    node.workerinput[GROUPS_KEY] = node.config.stash[_GROUPS_FOLDER]


@pytest.hookimpl(tryfirst=True)  # on a worker, before xdist's own hook reports the collection
def pytest_collection_finish(session: pytest.Session) -> None:
    from support.workers import GROUPS_KEY, write_process_tests
    folder = getattr(session.config, "workerinput", {}).get(GROUPS_KEY)
    if folder:
        write_process_tests(folder, session.config.workerinput["workerid"],  # type: ignore[attr-defined]
                            (item.nodeid for item in session.items
                             if any(item.get_closest_marker(tier) for tier in PROCESS_TIERS)))


@pytest.hookimpl(optionalhook=True)  # pytest-xdist, main process: firstresult, before xdist's own
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup" or _GROUPS_FOLDER not in config.stash:
        return None
    from support.workers import process_group_scheduler
    return process_group_scheduler(config, log, config.stash[_GROUPS_FOLDER], PROCESS_GROUP)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _GROUPS_FOLDER in config.stash:
        shutil.rmtree(config.stash[_GROUPS_FOLDER], ignore_errors=True)


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:  # type: ignore[no-untyped-def]
    left = config.stash[_LEFT]
    late = remove_dead_sockets(config.stash[_BEGAN])  # owners that died after their test ended
    if late:
        left.append(("(found at the end of the run)", [p.name for p in late]))
    if left:
        terminalreporter.section("hivemind sockets left in /tmp (removed)")
        for nodeid, names in left:
            terminalreporter.write_line(f"{nodeid}: {', '.join(names)}")
    daemons = config.stash[_DAEMONS_LEFT]
    if daemons:
        terminalreporter.section("libp2p daemons left running by wire tests (killed)")
        for nodeid, procs in daemons:
            terminalreporter.write_line(f"{nodeid}: {', '.join(procs)}")
