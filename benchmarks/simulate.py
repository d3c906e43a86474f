"""Placement policy against its ablation: `swarmgrad simulate` at 1000 peers, the full policy and
no-margin (any improving move, at once), same seeds, side by side.

    .venv/bin/python benchmarks/simulate.py [--peers 1000] [--hours 3] [--seeds 0 1 2]

Prints one markdown row per policy and seed, then the mean over seeds.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from swarmgrad.peer.simulator import SimConfig, SimResult, simulate


def row(name: str, results: list[SimResult], seconds: float) -> str:
    recs = [r.recovery_s for r in results]
    rec = "never" if any(x is None for x in recs) else f"{statistics.mean(recs):.0f}"
    return (f"| {name} | {statistics.mean(r.throughput_ratio for r in results):.4f} "
            f"| {statistics.mean(r.moves_per_peer_hour for r in results):.4f} | {rec} "
            f"| {statistics.mean(r.min_ratio_after_departure for r in results):.3f} "
            f"| {sum(r.moves for r in results)} | {statistics.mean(r.reaction_limit for r in results):.4f} "
            f"| {seconds:.1f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=1000)
    ap.add_argument("--hours", type=float, default=3.0)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args(argv)
    print(f"{args.peers} peers, {args.hours} h, 30 % leave at mid-run; ratio = throughput / fluid optimum, "
          f"time-averaged; recovery = seconds until the ratio is back at 0.95; reaction limit = the ratio if every "
          f"departure were repaired exactly one switch time after it (peer/simulator.py)")
    print("| policy (seed) | throughput ratio | moves/peer-hour | recovery s | min ratio after departure | moves | reaction limit | run s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    summary = []
    for policy in ("full", "no-margin"):
        results, total = [], 0.0
        for seed in args.seeds:
            t = time.perf_counter()
            r = simulate(SimConfig(peers=args.peers, hours=args.hours, seed=seed, policy=policy))
            dt = time.perf_counter() - t
            total += dt
            results.append(r)
            print(row(f"{policy} ({seed})", [r], dt), flush=True)
        summary.append(row(f"**{policy}, mean**", results, total))
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
