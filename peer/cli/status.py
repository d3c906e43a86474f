"""`swarmgrad status`: the swarm as the DHT sees it, read by a short-lived client-mode peer."""
from __future__ import annotations

import asyncio
import json
import sys
import time

MAX_PROBED_STAGES = 32


def print_status(initial_peers: list[str], run_id: str | None, manifest_path: str | None, as_json: bool,
                 timeout: float, run: str | None = None) -> int:
    """`run`: a public run's NAME[@FINGERPRINT], whose verified manifest is read from the swarm
    (cli/public.py); raises PublicRunError for one that is unknown, ambiguous or refused."""
    from swarmgrad.peer.cli.swarm_access import start_client_dht
    from swarmgrad.peer.net.record_signing import MAX_RECORD_TTL
    from swarmgrad.peer.net.dht_view import SwarmView
    n_stages, manifest_hash, ttl, manifest = MAX_PROBED_STAGES, None, MAX_RECORD_TTL, None
    if manifest_path:
        from swarmgrad.peer.manifest import load
        manifest = load(manifest_path)
        run_id, n_stages, manifest_hash = manifest.run_id, manifest.stages.count, manifest.hash
        ttl = manifest.timeouts.announce_ttl
    assert run_id is not None or run is not None
    # The swarm's validator without a key: it verifies and strips signatures, and signs nothing
    # (this client only reads). Unsigned or forged records never reach the table. An initial peer
    # that does not answer raises SwarmUnreachable (one line: cli/swarm_access.py).
    dht = start_client_dht(initial_peers, timeout)
    try:
        if run is not None:  # a public run by name: its manifest as `peer --run` would train with it
            from swarmgrad.peer.cli.public import published_over
            manifest = asyncio.run(published_over(dht, run, timeout)).manifest
            run_id, n_stages, manifest_hash = manifest.run_id, manifest.stages.count, manifest.hash
            ttl = manifest.timeouts.announce_ttl
        # ttl: the read cap on expiries (2 x announce_ttl); without a manifest, the protocol's cap
        view = SwarmView(dht, run_id, manifest_hash or "", n_stages, timeout, ttl=ttl)

        async def gather() -> tuple[dict[int, list], list]:
            results = await asyncio.gather(*(view.stage_records(s) for s in range(n_stages)))
            stages = {s: recs for s, recs in enumerate(results) if recs or manifest is not None}
            return stages, await view.data_records()

        swarm, data_records = asyncio.run(asyncio.wait_for(gather(), timeout))
    finally:
        dht.shutdown()
    from hivemind.utils import get_dht_time
    from swarmgrad.peer.shards.leases import swarm_data
    data = swarm_data(data_records, None, get_dht_time())  # the count the records name (a text corpus's own)
    placement = _placement(manifest, swarm) if manifest is not None else None
    if as_json:
        print(json.dumps({"run_id": run_id, "time": time.time(), "stages": {
            str(s): [{k: v for k, v in r.__dict__.items() if k != "voucher"} | {"maddrs": list(r.maddrs)}
                     for r in recs] for s, recs in swarm.items()},
            "data": data, **(placement or {})}, indent=1))
        return 0
    hashes = sorted({r.manifest_hash for recs in swarm.values() for r in recs})
    print(f"run {run_id}  manifest {', '.join(h[:12] for h in hashes) or '-'}  "
          f"stages {len(swarm) if manifest is None else n_stages}")
    if not any(swarm.values()):
        print("  no peers announce this run (wrong run id, or the swarm is gone)")
        return 1
    for stage, recs in sorted(swarm.items()):
        capacity = sum(r.throughput for r in recs if r.state in ("joining", "online"))
        mark = "  <- bottleneck" if placement and placement["bottleneck"] == stage else ""
        print(f"stage {stage}: {len(recs)} replica(s), capacity {capacity:.1f} samples/s{mark}")
        for r in recs:
            print(f"  {r.peer_id}  {r.state:8s}{' moving' if r.moving else ' pinned' if r.pinned else '       '} "
                  f"{'driver ' if r.driver else '       '}{'anchor ' if r.vouched else ''}{r.throughput:8.1f} samples/s  "
                  f"{r.memory / 2**30:6.1f} GiB  round {r.round:4d}  applied {r.applied_rounds:4d}  θ {r.digest[:10]}")
            if (evaluation := eval_line(r.stats)) is not None:
                print(f"      {evaluation}")
    if data is not None:
        print(data_line(data))
    if placement:
        print(f"throughput {placement['throughput']:.1f} samples/s; placement can reach "
              f"{placement['reachable']:.1f} ({placement['reachable_method']})")
        for mv in placement["moves"]:
            print(f"  would move {mv['peer_id'][-8:]}: stage {mv['from_stage']} -> {mv['to_stage']} ({mv['reason']}, "
                  f"+{mv['expected_gain']:.1f} samples/s)")
        if not placement["moves"]:
            print("  no move would be made now")
        for s in placement["unfilled"]:
            print(f"  stage {s} is empty and no peer would move there (those that could are pinned, or their "
                  f"stage has none to spare): start a peer with --stage {s} or --stage auto")
    return 0


def eval_line(stats: dict | None) -> str | None:
    """A driver's last evaluation in the units people compare (peer/text/units.py); None before its first."""
    if not stats or stats.get("val_loss") is None:
        return None
    line = f"validation {stats['val_loss']:.4f} bits/byte"
    if stats.get("val_nats") is not None:
        line += f", {stats['val_nats']:.4f} nats/token"
    if stats.get("val_ppl") is not None:
        line += f", perplexity {stats['val_ppl']:.2f}"
    return line


def data_line(data: dict) -> str:
    """The data position line of `swarmgrad status` (peer/shards/leases.py `swarm_data`)."""
    leases = ", ".join(f"{lease['peer_id'][-8:]} shard {lease['shard']} (to window {lease['claimed']})"
                       for lease in data["leases"])
    return (f"data: epoch {data['epoch']}, {data['done']} of {data['shards']} shards done, {data['begun']} begun; "
            f"leased: {leases or 'none'}")


def _placement(manifest, swarm: dict[int, list]) -> dict:
    """The swarm as the placement policy sees it: bottleneck, what is reachable, and the move each
    online replica would decide now (one check; a real move also needs a second, confirming one)."""
    from swarmgrad.peer.placement.rules import SWARM_POLICY, PeerFigures, estimate_rates, should_move
    from swarmgrad.peer.placement.rebalancer import DEFAULT_BANDWIDTH, snapshot_from_view
    from swarmgrad.peer.placement.cost import stage_costs
    try:
        costs = stage_costs(manifest)
    except ValueError:  # an entry-point model: its costs need the model itself
        return {}
    snap = snapshot_from_view(swarm, costs)
    caps = snap.capacities
    moves = []
    for stage, recs in swarm.items():
        for r in recs:
            if r.state != "online":
                continue
            me = PeerFigures(peer_id=r.peer_id, rates=estimate_rates(r.throughput, stage, [c.cost for c in costs]),
                             memory=r.memory, bandwidth=DEFAULT_BANDWIDTH, tenure=3600.0)
            decision = should_move(snap, me, stage, salt=r.round, policy=SWARM_POLICY)
            if decision is not None:
                moves.append({"peer_id": r.peer_id, "from_stage": decision.source, "to_stage": decision.target,
                              "reason": decision.reason, "expected_gain": decision.gain})
    reach = snap.reachable
    filled = {mv["to_stage"] for mv in moves}
    # an empty stage that no move fills: every replica that could come is pinned, or its stage has
    # no replica to spare (placement never empties a stage): only a new peer fills it
    unfilled = [s for s in snap.empty_stages if s not in filled]
    return {"bottleneck": min(range(len(caps)), key=lambda s: (caps[s], s)), "capacities": list(caps),
            "throughput": snap.throughput, "reachable": reach.throughput, "reachable_method": reach.method,
            "moves": moves, "unfilled": unfilled}


if __name__ == "__main__":
    sys.exit(print_status(sys.argv[1:], None, None, False, 15.0))
