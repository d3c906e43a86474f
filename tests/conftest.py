"""Shared fixtures. Swarm tests start real peer processes (each with its DHT child and p2pd) on
127.0.0.1 port 0; `local_swarm` always tears them down, by process group, whatever the test did.

hivemind puts p2pd's control sockets in /tmp whatever TMPDIR says, and a p2pd that dies without
stopping (SIGKILLed, orphaned) leaves its socket there: each test removes those it left and the
run's summary names the test, so a leak is seen and found rather than piling up on the machine."""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator, TypeVar

import pytest

from swarmgrad.peer.net.dht_process import remove_dead_sockets
from swarmgrad.peer.cli.launcher import LocalSwarm, small_manifest  # noqa: F401  (tests import it from here)
from swarmgrad.peer.manifest import Manifest, dumps

os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")


@pytest.fixture
def local_swarm(tmp_path: Path) -> Iterator[Callable[[Manifest], LocalSwarm]]:
    swarms: list[LocalSwarm] = []

    def make(manifest: Manifest) -> LocalSwarm:
        path = tmp_path / f"manifest{len(swarms)}.toml"
        path.write_text(dumps(manifest))
        swarm = LocalSwarm(path, tmp_path / f"swarm{len(swarms)}")
        swarm.__enter__()
        swarms.append(swarm)
        return swarm

    yield make
    for swarm in swarms:
        swarm.close(grace=10.0)


T = TypeVar("T")

INPROCESS_TIMEOUT_S = 60.0
"""Default deadline of an in-process scenario: each runs in seconds, so a hang fails fast."""


@pytest.fixture
def inprocess(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """Runs an in-process scenario (tests/support/swarm.py): `inprocess(coroutine_function,
    timeout=...)` runs it in a fresh event loop and fails the test if it takes longer than
    `timeout` seconds (INPROCESS_TIMEOUT_S by default). Marks the test `inprocess`."""
    request.node.add_marker(pytest.mark.inprocess)

    def run(scenario: Callable[[], Awaitable[T]], timeout: float = INPROCESS_TIMEOUT_S) -> T:
        async def bounded() -> T:
            try:
                return await asyncio.wait_for(scenario(), timeout)
            except asyncio.TimeoutError:
                raise AssertionError(f"the in-process scenario did not end within {timeout:g}s") from None
        return asyncio.run(bounded())
    return run


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that uses the `inprocess` fixture carries the marker from collection on, so that
    `-m inprocess` (or `-m "not inprocess"`) selects it."""
    for item in items:
        if "inprocess" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.inprocess)


_LEFT = pytest.StashKey[list]()  # (test id, socket names) per test that left sockets
_BEGAN = pytest.StashKey[float]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_LEFT] = []
    config.stash[_BEGAN] = time.time()


@pytest.fixture(autouse=True)
def _hivemind_sockets_left(request: pytest.FixtureRequest) -> Iterator[None]:
    began = time.time()
    yield
    left = remove_dead_sockets(began)
    if left:
        request.config.stash[_LEFT].append((request.node.nodeid, [p.name for p in left]))


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:  # type: ignore[no-untyped-def]
    left = config.stash[_LEFT]
    late = remove_dead_sockets(config.stash[_BEGAN])  # owners that died after their test ended
    if late:
        left.append(("(found at the end of the run)", [p.name for p in late]))
    if left:
        terminalreporter.section("hivemind sockets left in /tmp (removed)")
        for nodeid, names in left:
            terminalreporter.write_line(f"{nodeid}: {', '.join(names)}")
