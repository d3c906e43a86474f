"""Overlapped averaging (`[rounds] overlap`) against plain rounds, side by side in one run.

    python -m benchmarks.overlap [--link 20mbit|unshaped] [--steps 500] [--modes off,on]
        [--manifest PATH] [--inner-steps H] [--quick] [--seed N] [--out DIR]

2 peers, each holding the whole model (the swarmgrad row of benchmarks.wan: the reference task
of examples/reference.toml, H = 50, int8 + error feedback), each in its own network namespace on
one veth pair; "20mbit" puts `tbf rate 20mbit burst 32kb latency 50ms` on both ends. Root and
`ip netns` are needed (the script says why it skips otherwise). `--steps` shortens the run: the
budget is steps x 64 sequences and the lr schedule is scaled with it (warmup 10 %, cosine to
10 % at the budget), as in wan.py. `--manifest` runs another manifest in its place (its codec,
inner and outer optimisers; H from `--inner-steps`). Modes: `off` plain rounds, `on`
`rounds.overlap`, `on:N` overlap with `rounds.overlap_steps = N` (a replica waits for the mean
after N steps of the next round).

Per mode it prints:
- utilisation per peer: the `utilisation` of its round events (compute seconds of the replica's
  worker over the round's wall time, waits excluded), time-weighted over the rounds after the
  first (the first includes start-up and the wait for the other peer);
- samples/s per peer over the same rounds (its own samples over their wall time);
- val bits/byte of θ_global at equal samples (the budget), scored here as wan.py scores it, and
  at every complete round (written to results.json with --out), and the time to reach 3.0 and
  2.7 (with `--score every-round`);
- the seconds a replica waited for overlapped means (`mean_wait_s` of its round events), per round.
With --out: report.md, results.json (every scored point, per-peer figures) and curves.png (val
bits/byte of θ_global against time and samples, one line per mode).
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from benchmarks.harness import netns
from benchmarks.harness.report import Report, add_common_args, fmt
from benchmarks.wan import Budget, CheckpointWatch, Task, manifest_for, plot_curves, stages_from, time_to
from swarmgrad.peer.cli.launcher import stop_on_signals
from swarmgrad.peer.manifest import dumps

LINKS = {"unshaped": None, "20mbit": "20mbit"}


def peer_figures(events: list[dict]) -> dict[str, float]:
    """Time-weighted utilisation and samples/s over a peer's rounds after its first."""
    rounds = sorted((e for e in events if e.get("utilisation") is not None), key=lambda e: e["round"])[1:]
    wall = sum(e["round_s"] for e in rounds)
    if not rounds or wall <= 0:
        return {"rounds": 0, "utilisation": math.nan, "samples_per_s": math.nan, "averaging_s": math.nan}
    return {"rounds": len(rounds), "utilisation": sum(e["utilisation"] * e["round_s"] for e in rounds) / wall,
            "samples_per_s": sum(e["samples"] for e in rounds) / wall,
            "averaging_s": sum(e["averaging_s"] for e in rounds) / len(rounds),
            "round_s": wall / len(rounds),
            "mean_wait_s": sum(e.get("mean_wait_s") or 0.0 for e in rounds) / len(rounds)}


def parse_mode(mode: str) -> dict:
    """A mode's [rounds] fields: off, on, or on:N."""
    if mode == "off":
        return {"overlap": False}
    if mode == "on":
        return {"overlap": True}
    head, _, steps = mode.partition(":")
    if head != "on" or not steps.isdigit() or int(steps) < 1:
        raise ValueError(f"a mode is off, on or on:N with N >= 1 (got {mode!r})")
    return {"overlap": True, "overlap_steps": int(steps)}


def run_mode(mode: str, link: str, net: netns.WanNet, budget: Budget, task: Task, workdir: Path
             ) -> tuple[dict, Callable[[bool], None]]:
    """Train; returns the figures and a scoring step to run once the peers (and the namespaces)
    are gone, so that scoring does not share the cores with training."""
    manifest = manifest_for("swarmgrad", budget, task).replace(rounds=parse_mode(mode))
    workdir.mkdir(parents=True)
    (workdir / "manifest.toml").write_text(dumps(manifest))
    t0 = time.time()
    out: dict = {"mode": mode, "link": link, "error": None}
    with netns.NetnsSwarm(workdir / "manifest.toml", workdir, net.endpoints, save=True) as swarm:
        swarm.start_first(0, "--max-rounds", "0")
        swarm.start(0, "--max-rounds", "0")
        watch = CheckpointWatch([workdir / f"{p.name}.ckpt" for p in swarm.peers])
        deadline = time.monotonic() + budget.timeout_s
        while watch.samples(1) < budget.samples:
            watch.poll()
            dead = [p for p in swarm.peers if not p.alive]
            if dead or time.monotonic() > deadline:
                out["error"] = (f"{dead[0].name} exited" if dead else "timeout") + ": " + swarm.peers[0].log_tail(8)
                break
            time.sleep(0.25)
        out["wall_s"] = time.time() - t0
        out["tx_bytes"] = sum(net.tx_bytes())
        out["peers"] = {p.name: peer_figures(p.events("round")) for p in swarm.peers}
        digests = {}
        for p in swarm.peers:
            for e in p.events("round"):
                if e["complete"]:
                    digests.setdefault(e["round"], set()).add(e["digest"])
        out["rounds_disagreeing"] = sorted(r for r, d in digests.items() if len(d) > 1)

    def score(every_round: bool) -> None:
        """Val bits/byte of θ_global at the first round holding the budget's samples (and, with
        every_round, at every complete round before it)."""
        rounds = watch.complete_rounds(1)
        first = next((r for r in rounds if watch.by_round[(0, r)][2] >= budget.samples), rounds[-1] if rounds else None)
        wanted = [r for r in rounds if every_round and first is not None and r < first] + ([first] if first else [])
        points = [(0.0, 0, task.init_score(manifest))] if every_round else []
        for r in wanted:
            mtime, params, samples = watch.by_round[(0, r)]
            points.append((mtime - t0, samples, task.score(stages_from(manifest, [params]))))
        out["points"] = points
        out["val_bpb"] = points[-1][2] if points and points[-1][1] >= budget.samples else math.nan
        out["samples_scored"] = points[-1][1] if points else 0
    return out, score


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p, quick="smoke run: 10 steps of H = 5 per mode, unshaped unless --link",
                    seed="the manifest's seed: weights and data (default: the manifest's)")
    p.add_argument("--link", choices=tuple(LINKS), default=None, help="default 20mbit (unshaped with --quick)")
    p.add_argument("--steps", type=int, default=None, help="global steps of 64 sequences (default 500: the reference task)")
    p.add_argument("--inner-steps", type=int, default=None, help="default 50")
    p.add_argument("--modes", default="off,on",
                   help="comma-separated, of off (plain rounds), on (rounds.overlap) and on:N (overlap_steps N)")
    p.add_argument("--manifest", default=None, type=Path,
                   help="the manifest the peers run (default examples/reference.toml; H from --inner-steps)")
    p.add_argument("--score", choices=("every-round", "final"), default="every-round",
                   help="score θ_global after every round (for curves) or only at the budget (faster on busy cores)")
    p.add_argument("--workdir", default=None, help="keep every peer's log and events here (default: a temp dir)")
    args = p.parse_args(argv)
    why = netns.why_unavailable()
    if why:
        print(f"SKIP: benchmarks.overlap needs network namespaces: {why}")
        return 0
    link = args.link or ("unshaped" if args.quick else "20mbit")
    steps = args.steps or (10 if args.quick else 500)
    inner_steps = args.inner_steps or (5 if args.quick else 50)
    modes = args.modes.split(",")
    for m in modes:
        try:
            parse_mode(m)
        except ValueError as e:
            p.error(f"--modes: {e}")
    budget = Budget(steps=steps, inner_steps=inner_steps, timeout_s=150.0 if args.quick else 1800.0, seed=args.seed)
    if args.manifest:
        budget = replace(budget, reference=args.manifest.resolve())
    torch.set_num_threads(2)
    results = []
    # SIGTERM and SIGHUP stop it as Ctrl-C does: the peers (sessions of their own) and the
    # namespaces are closed by the context managers, not left training
    with stop_on_signals(), tempfile.TemporaryDirectory(prefix="overlap-bench-") as tmp:
        if args.workdir:
            tmp = args.workdir
            Path(tmp).mkdir(parents=True, exist_ok=False)
        task = Task(Path(tmp), windows=64 if args.quick else 512)  # a smoke run scores on fewer windows
        print(f"{budget.samples} samples per run, H={budget.inner_steps}, link {link}", flush=True)
        for i, mode in enumerate(modes):
            print(f"--- overlap {mode}", flush=True)
            with netns.WanNet(f"ov{i}", 2, LINKS[link], subnet=90 + i) as net:
                res, score = run_mode(mode, link, net, budget, task, Path(tmp) / f"{link}-{mode}")
            score(args.score == "every-round")
            results.append(res)
            print(json.dumps({k: v for k, v in res.items() if k != "points"}, default=str), flush=True)
    rows = []
    for r in results:
        for name, f in sorted(r["peers"].items()):
            rows.append([f"overlap {r['mode']}", r["link"], name, fmt(f["utilisation"], 3), fmt(f["samples_per_s"], 1),
                         fmt(f.get("round_s", math.nan), 1), fmt(f["averaging_s"], 2),
                         fmt(f.get("mean_wait_s", math.nan), 2), str(f["rounds"]),
                         fmt(r["val_bpb"], 3), f"{r['samples_scored']:,}",
                         fmt(time_to(r.get("points", []), 3.0), 0), fmt(time_to(r.get("points", []), 2.7), 0),
                         fmt(r["wall_s"], 0)])
    print()
    report = Report("Overlapped averaging against plain rounds", args.out)
    report.table(["mode", "link", "peer", "utilisation", "samples/s", "round (s)", "averaging (s)",
                  "mean wait (s)", "rounds", "val bits/byte", "at samples", "to 3.0 (s)", "to 2.7 (s)",
                  "wall (s)"], rows)
    report.results = results
    report.figure("curves.png", lambda fig: plot_curves(fig, [(f"overlap {r['mode']} {r['link']}", r["points"])
                                                              for r in results if r.get("points")]), size=(13.0, 5.5))
    report.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
