"""Shared fixtures. Swarm tests start real peer processes (each with its DHT child and p2pd) on
127.0.0.1 port 0; `local_swarm` always tears them down, by process group, whatever the test did."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterator

import pytest

from swarmgrad.peer.launcher import LocalSwarm, small_manifest  # noqa: F401  (tests import it from here)
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
