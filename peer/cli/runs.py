"""`swarmgrad runs`: the public runs a swarm hosts, each as NAME@FINGERPRINT, read by a short-lived
client-mode DHT node. Only runs whose owner-signed manifest verifies are listed
(peer/public/directory.py)."""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Sequence

from swarmgrad.peer.net.deadline import within


def list_runs(peers: Sequence[str], as_json: bool, timeout: float) -> int:
    """Print the runs (a table, or JSON); 0 even when there is none. SwarmUnreachable and the
    network's failures propagate (the caller turns them into one line)."""
    from swarmgrad.peer.cli.swarm_access import start_client_dht
    from swarmgrad.peer.public.directory import RunDirectory
    dht = start_client_dht(peers, timeout)
    try:
        directory = RunDirectory(dht, timeout)

        async def gather() -> list:
            found = await directory.runs()
            return list(await asyncio.gather(*(directory.summary(f.published) for f in found)))

        # every read has `timeout`; the whole listing gets twice that (the run ids, then the runs)
        summaries = asyncio.run(within(gather(), 2 * timeout))
    finally:
        dht.shutdown()
    summaries.sort(key=lambda s: (-s.peers_online, s.run))
    if as_json:
        print(json.dumps({"time": time.time(), "runs": [s.to_json() for s in summaries]}, indent=1))
        return 0
    if not summaries:
        print("no public runs: no peer of this swarm serves a run with a signed manifest")
        return 0
    print(format_table(summaries))
    return 0


def format_table(summaries: Sequence[Any]) -> str:
    header = ("RUN", "MODEL", "PARAMS", "STAGES", "PEERS", "SAMPLES", "ROUND", "AGE")
    rows = [header] + [(s.run, s.model, _count(s.params), str(s.stages), str(s.peers_online),
                        _count(s.samples_trained), "-" if s.last_round is None else str(s.last_round),
                        _age(s.age_s)) for s in summaries]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
                     for r in rows)


def _count(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"
