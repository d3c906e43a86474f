"""Unequal peers in a real swarm: how close the placement policy keeps the swarm to the best
assignment, and how often peers move.

Six real peer processes on 127.0.0.1, 3 stages, speeds [1, 1, 1, 1, 3, 3] (four peers with
`--slowdown 3`), all started on stage 0 with `--rebalance on` (the issue's setup; the same as
`make test-slow`). Every `--every` seconds the script reads the swarm as `swarmgrad status --json`
sees it and prints the swarm's throughput (the slowest stage's summed announced rates) next to
what placement can reach with the same peers (the exact optimum over the same rates), and their
ratio. At the end: the ratio averaged over the run after the first `--settle` seconds, the moves
and moves per peer-hour.

Ratios, not absolute speeds: on a shared 2-core machine six processes contend, so rates are
noisy, and both sides of the ratio use the same announced rates.

    python -m benchmarks.rebalance                # 6 minutes
    python -m benchmarks.rebalance --quick        # a smoke run: 2 minutes, 30 s left out
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks.harness.report import Report, add_common_args, seed_or
from swarmgrad.peer.cli.launcher import LocalSwarm, small_manifest
from swarmgrad.peer.manifest import dumps

SLOWDOWNS = [3, 3, 3, 3, 1, 1]  # four peers at speed 1, two at speed 3


def status(swarm: LocalSwarm) -> dict:
    out = subprocess.run([sys.executable, "-m", "swarmgrad.peer.cli", "status", "--initial-peers",
                          *swarm.initial_peers, "--manifest", str(swarm.manifest), "--json"],
                         capture_output=True, text=True, timeout=90)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-500:])
    return json.loads(out.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, quick="a smoke run: 2 minutes, 30 s left out of the average",
                    seed="the manifest's seed: weights and data (default 1)")
    parser.add_argument("--minutes", type=float, default=None, help="default 6 (2 with --quick)")
    parser.add_argument("--every", type=float, default=15.0, help="seconds between two looks at the swarm")
    parser.add_argument("--settle", type=float, default=None,
                        help="seconds left out of the average (default 90; 30 with --quick)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--rate-clock", choices=("cpu", "wall"), default="cpu",
                        help="what peers measure their rate in (--rate-clock; cpu: their own CPU time, wall: "
                             "elapsed time, which counts the neighbours' share of the 2 cores)")
    args = parser.parse_args()
    args.minutes = args.minutes or (2.0 if args.quick else 6.0)
    args.settle = args.settle if args.settle is not None else (30.0 if args.quick else 90.0)
    m = small_manifest(seed=seed_or(args, 1), model={"d_model": 32, "n_layers": 3, "n_heads": 2, "seq_len": 32}, stages={"count": 3},
                       timeouts={"rebalance_check": 3.0}, rounds={"max_rounds": 0})
    with tempfile.TemporaryDirectory(prefix="swarmgrad-rebalance-") as tmp:
        # the peers' logs and events are kept only where --workdir says
        return run(args, m, Path(args.workdir or tmp))


def run(args: argparse.Namespace, m, workdir: Path) -> int:
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "manifest.toml"
    path.write_text(dumps(m))
    rows = []
    with LocalSwarm(path, workdir / "swarm") as swarm:
        started = time.monotonic()
        flags = ("--rebalance", "on", "--rate-clock", args.rate_clock)
        swarm.start_first(0, *flags, "--slowdown", str(SLOWDOWNS[0]))
        for f in SLOWDOWNS[1:]:
            swarm.start(0, *flags, "--slowdown", str(f))
        print(f"{'t (s)':>6} {'per stage':>10} {'throughput':>11} {'reachable':>10} {'ratio':>6} {'moves':>6}  "
              f"announced rates by stage")
        while time.monotonic() - started < args.minutes * 60:
            time.sleep(args.every)
            try:
                view = status(swarm)
            except Exception as e:  # a slow DHT read: skip this look
                print(f"  (status failed: {e})")
                continue
            t = time.monotonic() - started
            counts = Counter(int(s) for s, recs in view["stages"].items() for r in recs if r["state"] == "online")
            moves = sum(len(p.events("moved")) for p in swarm.peers)
            ratio = view["throughput"] / view["reachable"] if view["reachable"] else 0.0
            rows.append((t, ratio, moves))
            per_stage = "/".join(str(counts[s]) for s in range(m.stages.count))
            rates = " | ".join(" ".join(f"{r['throughput']:.0f}" for r in view["stages"].get(str(s), [])
                                        if r["state"] == "online") for s in range(m.stages.count))
            print(f"{t:6.0f} {per_stage:>10} {view['throughput']:11.1f} {view['reachable']:10.1f} {ratio:6.3f} "
                  f"{moves:6d}  {rates}", flush=True)
        elapsed_h = (time.monotonic() - started) / 3600
        moves = sum(len(p.events("moved")) for p in swarm.peers)
    settled = [r for t, r, _ in rows if t >= args.settle]
    mean = sum(settled) / len(settled) if settled else float("nan")
    summary = {"throughput_ratio": round(mean, 4), "moves": moves,
               "moves_per_peer_hour": round(moves / (len(SLOWDOWNS) * elapsed_h), 3)}
    report = Report("Unequal peers in a real swarm: throughput against the best placement", args.out)
    report.print(f"\nthroughput / reachable after {args.settle:.0f} s: mean {mean:.3f} over {len(settled)} looks "
                 f"(min {min(settled, default=float('nan')):.3f}); moves {moves} = "
                 f"{moves / (len(SLOWDOWNS) * elapsed_h):.2f} per peer-hour over {elapsed_h * 60:.1f} min")
    print(json.dumps(summary))
    report.results = summary | {"looks": [{"t": t, "ratio": r, "moves": n} for t, r, n in rows]}
    report.figure("ratio.png", lambda fig: plot_ratio(fig, rows, args.settle))
    report.finish()
    return 0


def plot_ratio(fig, rows: list[tuple[float, float, int]], settle: float) -> None:  # type: ignore[no-untyped-def]
    """The swarm's throughput over what placement can reach, look by look, and the moves so far."""
    ax = fig.subplots()
    ax.plot([t for t, _, _ in rows], [r for _, r, _ in rows], marker="o", label="throughput / reachable")
    ax.axvline(settle, color="0.4", linestyle="--", linewidth=1, label="settled (averaged from here)")
    ax.set_title("Six unequal peers on 3 stages: the swarm against the best placement of the same peers")
    ax.set_xlabel("seconds since the first peer started")
    ax.set_ylabel("throughput / reachable")
    ax.set_ylim(0, 1.05)
    moves = ax.twinx()
    moves.step([t for t, _, _ in rows], [n for _, _, n in rows], where="post", color="tab:orange", label="moves")
    moves.set_ylabel("moves so far")
    moves.set_ylim(bottom=0, top=max([n for _, _, n in rows], default=0) + 1)
    moves.yaxis.get_major_locator().set_params(integer=True)
    moves.grid(False)
    ax.set_xlim(left=0)
    lines = ax.get_legend_handles_labels()
    more = moves.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="lower right")


if __name__ == "__main__":
    sys.exit(main())
