"""Shared fixtures. Swarm tests start real peer processes (each with its DHT child and p2pd) on
127.0.0.1 port 0; `local_swarm` always tears them down, by process group, whatever the test did."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterator

import pytest

from swarmgrad.peer.launcher import LocalSwarm
from swarmgrad.peer.manifest import Manifest, dumps, from_dict

os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")


def small_manifest(**sections: dict) -> Manifest:
    """A run small enough for tests on 2 cores: a 2-layer GPT, 2 stages, short wall-clock rounds."""
    raw = {
        "run_id": "test-run",
        "seed": 1,
        "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32},
        "stages": {"count": 2},
        "inner": {"lr": 3e-3, "microbatch_size": 4, "microbatches_per_step": 2},
        "rounds": {"round_seconds": 4.0},
        "pipeline": {"max_in_flight": 2},
        "data": {"max_bytes": 300_000, "eval_every": 1, "eval_batches": 2},
        "timeouts": {"matchmaking": 3.0, "allreduce": 8.0, "announce_ttl": 8.0, "heartbeat": 1.0,
                     "microbatch": 10.0, "min_microbatch": 3.0, "ban_base": 2.0},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values} if isinstance(values, dict) else values
    return from_dict(raw)


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
