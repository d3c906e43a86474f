"""`swarmgrad status`: the swarm as the DHT sees it, read by a short-lived client-mode peer."""
from __future__ import annotations

import asyncio
import json
import sys
import time

MAX_PROBED_STAGES = 32


def print_status(initial_peers: list[str], run_id: str | None, manifest_path: str | None, as_json: bool,
                 timeout: float) -> int:
    from hivemind import DHT

    from swarmgrad.peer.record_signing import MAX_RECORD_TTL, SignedRecordValidator
    from swarmgrad.peer.swarm import SwarmView
    n_stages, manifest_hash, ttl = MAX_PROBED_STAGES, None, MAX_RECORD_TTL
    if manifest_path:
        from swarmgrad.peer.manifest import load
        manifest = load(manifest_path)
        run_id, n_stages, manifest_hash = manifest.run_id, manifest.stages.count, manifest.hash
        ttl = manifest.timeouts.announce_ttl
    assert run_id is not None
    # The swarm's validator without a key: it verifies and strips signatures, and signs nothing
    # (this client only reads). Unsigned or forged records never reach the table.
    dht = DHT(initial_peers=initial_peers, start=True, client_mode=True, startup_timeout=timeout,
              record_validators=[SignedRecordValidator()])
    try:
        # ttl: the read cap on expiries (2 x announce_ttl); without a manifest, the protocol's cap
        view = SwarmView(dht, run_id, manifest_hash or "", n_stages, timeout, ttl=ttl)

        async def gather() -> dict[int, list]:
            results = await asyncio.gather(*(view.stage_records(s) for s in range(n_stages)))
            return {s: recs for s, recs in enumerate(results) if recs or manifest_path}

        swarm = asyncio.run(asyncio.wait_for(gather(), timeout))
    finally:
        dht.shutdown()
    if as_json:
        print(json.dumps({"run_id": run_id, "time": time.time(), "stages": {
            str(s): [r.__dict__ | {"maddrs": list(r.maddrs)} for r in recs] for s, recs in swarm.items()}}, indent=1))
        return 0
    hashes = sorted({r.manifest_hash for recs in swarm.values() for r in recs})
    print(f"run {run_id}  manifest {', '.join(h[:12] for h in hashes) or '-'}  "
          f"stages {len(swarm) if not manifest_path else n_stages}")
    if not any(swarm.values()):
        print("  no peers announce this run (wrong run id, or the swarm is gone)")
        return 1
    for stage, recs in sorted(swarm.items()):
        capacity = sum(r.throughput for r in recs if r.state == "online")
        print(f"stage {stage}: {len(recs)} replica(s), capacity {capacity:.2f} microbatches/s")
        for r in recs:
            print(f"  {r.peer_id}  {r.state:8s} {'driver ' if r.driver else '       '}"
                  f"{r.throughput:7.2f} mb/s  round {r.round:4d}  applied {r.applied_rounds:4d}  θ {r.digest[:10]}")
    return 0


if __name__ == "__main__":
    sys.exit(print_status(sys.argv[1:], None, None, False, 15.0))
