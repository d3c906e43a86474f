"""Placement policy against its ablations: `swarmgrad simulate` at 1000 peers, same seeds, side by side:
the full policy with warm standbys as the daemon pushes them (BACKUP_COPIES holders, one pusher) and
no-margin (any improving move, at once), each with links by device class and with home links for
every peer; the full policy with the daemon's former 30 s checks, with 8 holders pushed in parallel
(a what-if the daemon does not do yet) and with no backups (every mover downloads).

    .venv/bin/python -m benchmarks.simulate [--peers 1000] [--hours 3] [--seeds 0 1 2] [--jobs 2] [--extra]
                                            [--only NAME ...] [--quick] [--seed N] [--out DIR]

Prints one markdown row per policy and seed, then the mean over seeds, then each variant against the
first, seed by seed (mean difference ± its standard error: whether the seeds can tell them apart).
With --out, ratio.png plots each variant's throughput over the optimum against time (first seed).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from benchmarks.harness.report import Report, add_common_args
from swarmgrad.peer.sim.config import SimConfig, SimResult
from swarmgrad.peer.sim.simulator import simulate

VARIANTS = {
    "full": dict(policy="full"),
    "no-margin": dict(policy="no-margin"),
    "full, home links everywhere": dict(policy="full", hosted_bandwidth_median_mbit=0.0),
    "no-margin, home links everywhere": dict(policy="no-margin", hosted_bandwidth_median_mbit=0.0),
    "full, checks every 30 s (the daemon's until 2026-12-01)": dict(policy="full", check_s=30.0),
    "full, 8 parallel copies": dict(policy="full", backup_copies=8, parallel_push=True),
    "full, no backups": dict(policy="full", backup_copies=0),
    "full, backups unpaced (before 2026-12-01)": dict(policy="full", backup_link_share=1.0),
    "full, backups at most 5 % of the link": dict(policy="full", backup_link_share=0.05),
}
"""Links by device class unless named: data-centre cards around 1 Gbit/s, home cards around
100 Mbit/s (``SimConfig.hosted_bandwidth_median_mbit``); checks every 15 s (the daemon's
``timeouts.rebalance_check``)."""
EXTRA = {
    "full, checks every 120 s (the simulator's default until 2026-12-01)": dict(policy="full", check_s=120.0),
    "full, holders kept fresh (what-if)": dict(policy="full", holders_listen=True),
    "full, 8 holders kept fresh (what-if)": dict(policy="full", backup_copies=8, parallel_push=True,
                                                 holders_listen=True),
    "full, 10 % pinned": dict(policy="full", pinned_share=0.1),
    "full, 30 % pinned": dict(policy="full", pinned_share=0.3),
    "full, 10 % pinned on stage 0 (NAT clients)": dict(policy="full", pinned_share=0.1, pinned_stage=0),
    "full, 30 % pinned on stage 0 (NAT clients)": dict(policy="full", pinned_share=0.3, pinned_stage=0),
}
"""Opt-in (``--extra``): the simulator's former check interval, backup holders that stay fresh
all round (``SimConfig.holders_listen``, not in the daemon), and a share of pinned peers
(``SimConfig.pinned_share``: never moved, placed where a newcomer would go on arrival, or all on
stage 0 as NAT clients are)."""


def row(name: str, results: list[SimResult], seconds: float) -> str:
    recs = [r.recovery_s for r in results]
    rec = "never" if any(x is None for x in recs) else f"{statistics.mean(recs):.0f}"
    mean = statistics.mean
    return (f"| {name} | {mean(r.throughput_ratio for r in results):.4f} "
            f"| {mean(r.moves_per_peer_hour for r in results):.4f} | {rec} "
            f"| {mean(r.min_ratio_after_departure for r in results):.3f} "
            f"| {sum(r.moves for r in results)} | {sum(r.warm_moves for r in results)} "
            f"| {mean(r.paper_ratio for r in results):.4f} | {mean(r.reaction_limit for r in results):.4f} "
            f"| {mean(r.reaction_limit_warm for r in results):.4f} "
            f"| {mean(r.backup_bytes_per_round for r in results) / 1e9:.1f} "
            f"| {mean(r.averaging_bytes_per_round for r in results) / 1e9:.0f} "
            f"| {mean(r.pinned_bound_ratio for r in results):.4f} | {seconds:.1f} |")


def paired(base: list[float], other: list[float]) -> tuple[float, float]:
    """The mean of other − base over the same seeds and its standard error (0 with one seed). The
    seeds' own spread (~0.003 in the throughput ratio at 1000 peers) is larger than most policy
    variants' effects: a difference within ~2 standard errors is not one the runs can tell."""
    diffs = [o - b for b, o in zip(base, other, strict=True)]
    se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else 0.0
    return statistics.mean(diffs), se


def paired_rows(names: list[str], ratios: list[list[float]]) -> list[str]:
    """Markdown rows: each variant's throughput ratio against the first one's, seed by seed."""
    rows = ["| variant | Δ ratio vs " + names[0] + " (mean ± se over seeds) | told apart (\\|Δ\\| > 2 se) |",
            "| --- | --- | --- |"]
    for name, r in zip(names[1:], ratios[1:]):
        d, se = paired(ratios[0], r)
        rows.append(f"| {name} | {d:+.4f} ± {se:.4f} | {'yes' if se > 0 and abs(d) > 2 * se else 'no'} |")
    return rows


def _run(job: tuple[int, int, float, dict]) -> tuple[SimResult, float]:
    seed, peers, hours, kw = job
    t = time.perf_counter()
    r = simulate(SimConfig(peers=peers, hours=hours, seed=seed, **kw))
    return r, time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap, quick="200 peers, 0.5 h, seed 0 (seconds)",
                    seed="one seed of the simulation (default: --seeds, or 0 1 2)")
    ap.add_argument("--peers", type=int, default=None, help="default 1000 (200 with --quick)")
    ap.add_argument("--hours", type=float, default=None, help="default 3 (0.5 with --quick)")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (0 with --quick)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (each is single-threaded and deterministic)")
    ap.add_argument("--extra", action="store_true", help="also the variants in EXTRA")
    ap.add_argument("--only", nargs="+", default=None, help="just these variants (exact names)")
    args = ap.parse_args(argv)
    if args.seed is not None and args.seeds is not None:
        ap.error("--seed and --seeds: give one or the other")
    seeds = args.seeds or ([args.seed] if args.seed is not None else [0] if args.quick else [0, 1, 2])
    peers = args.peers or (200 if args.quick else 1000)
    hours = args.hours or (0.5 if args.quick else 3.0)
    report = Report("The placement policy against its ablations (simulator)", args.out)
    report.print(f"{peers} peers, {hours} h, 30 % leave at mid-run; ratio = throughput / fluid optimum, "
                 f"time-averaged; on paper = the same with joiners and movers counted at their target; "
                 f"recovery = seconds until the ratio is back at 0.95; reaction limit = the ratio if every "
                 f"departure were repaired exactly one switch time after it (download + warm-up; warm: warm-up only); "
                 f"GB/round: backups pushed and averaging sent per round, all stages; pinned bound = the bound with "
                 f"pinned peers kept in place over the free bound (peer/sim/simulator.py)")
    report.print("| policy (seed) | throughput ratio | moves/peer-hour | recovery s | min ratio after departure | moves "
                 "| warm moves | on paper | reaction limit | reaction limit, warm | backup GB/round | averaging GB/round "
                 "| pinned bound | run s |")
    report.print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    variants = {**VARIANTS, **(EXTRA if args.extra else {})}
    if args.only:
        variants = {name: variants[name] for name in args.only}
    jobs = [(seed, peers, hours, kw) for kw in variants.values() for seed in seeds]
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:
        done = list(pool.map(_run, jobs))
    summary, ratios, runs = [], [], []
    for i, name in enumerate(variants):
        chunk = done[i * len(seeds):(i + 1) * len(seeds)]
        for seed, (r, dt) in zip(seeds, chunk):
            report.print(row(f"{name} ({seed})", [r], dt))
            runs.append({"variant": name, "seed": seed, "seconds": dt, **r.summary()})
        summary.append(row(f"**{name}, mean**", [r for r, _ in chunk], sum(dt for _, dt in chunk)))
        ratios.append([r.throughput_ratio for r, _ in chunk])
    report.print("\n".join(summary))
    if len(variants) > 1:
        report.print()
        report.print("\n".join(paired_rows(list(variants), ratios)))
    report.results = {"peers": peers, "hours": hours, "seeds": seeds, "runs": runs}
    first = {name: done[i * len(seeds)][0].series for i, name in enumerate(variants)}
    report.figure("ratio.png", lambda fig: plot_ratio(fig, first, seeds[0], peers), size=(11.0, 6.5))
    report.finish()
    return 0


def plot_ratio(fig, series: dict[str, list[tuple[float, float, float]]], seed: int, peers: int) -> None:  # type: ignore[no-untyped-def]
    """Each variant's throughput over the optimum against simulated time."""
    ax = fig.subplots()
    for name, points in series.items():
        ax.plot([t / 3600 for t, _, _ in points], [tp / best if best > 0 else 0.0 for _, tp, best in points],
                label=name, linewidth=1.2)
    ax.set_title(f"Throughput over the fluid optimum, {peers} peers (seed {seed}; 30 % leave at mid-run)")
    ax.set_xlabel("simulated time (hours)")
    ax.set_ylabel("throughput / optimum")
    fig.legend(loc="outside lower center", ncols=3)


if __name__ == "__main__":
    sys.exit(main())
