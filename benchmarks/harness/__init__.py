"""What every benchmark shares: `swarm` runs a local swarm of real peers to the end (on the demo's
LocalSwarm), `training` trains the manifest's model in one process as the peers' workers do,
`netns` builds network namespaces with shaped links, and `report` prints and writes the result
(markdown, JSON, PNG) behind the common flags ``--quick --out --seed``."""
from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository root: `benchmarks` is imported from here (``python -m benchmarks.NAME``)."""


def module_command(name: str) -> list[str]:
    """The command line that runs ``benchmarks.NAME`` in a child process (a baseline's rank, a DHT
    node in a namespace), whatever its working directory: pair it with `module_env`."""
    import sys
    return [sys.executable, "-m", f"benchmarks.{name}"]


def module_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with the repository root on PYTHONPATH, after whatever is
    there already (a code snapshot put first stays first)."""
    env = dict(os.environ if env is None else env)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO) not in parts:
        parts.append(str(REPO))
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env
