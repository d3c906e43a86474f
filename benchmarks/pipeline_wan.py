"""A pipeline over slow links (issue 45's benchmark): a model no peer may hold whole, 2 stages x 2
replicas of real peers, each in its own network namespace, over unshaped, 100 Mbit and 20 Mbit
links and with one replica behind 5 Mbit; one row per configuration (manifest overrides).

    python -m benchmarks.pipeline_wan [--quick] [--out DIR] [--seeds 0 1] [--samples N]
        [--links unshaped,100mbit,20mbit,slow-replica] [--rows NAME:KEY=VALUE,... ...]
        [--target-loss X] [--manifest PATH] [--inner-steps H] [--slow-stage 0|1] [--workdir DIR]

**The swarm.** Four `swarmgrad peer` processes, each in a namespace of its own (`pwan-<pid>-...`,
on a bridge: benchmarks/harness/netns.py), started together on stages 0, 1, 0, 1 (2 drivers, 2
replicas of the last stage), on the Llama CPU preset (examples/llama-cpu.toml: 4.9M parameters,
d_model 256, 6 layers, seq_len 128, microbatches of 8, 2 per inner step, fp16 boundaries) with
rounds of `--inner-steps` inner steps (default 4: 3 rounds of 128 samples), the learning-rate schedule (linear warmup over
10 % of `--samples`, cosine to 10 % at the last), and evaluations only at the start and the end.
Every driver runs `--max-rounds` = `--samples` / (2 drivers x H x 16 samples), rounded up, so every
row trains the same samples (the table says how many the drivers' round events counted); the stage
servers serve until both drivers have evaluated, and the swarm is then stopped. Each
peer offers `--max-memory` = 1.05 x placement's estimate of the largest stage (peer/placement/cost.py,
fp32 on the CPU, for that row's manifest), checked to be below the estimate for the whole model as
one stage: no peer could hold the model, data parallelism is impossible. The run checks from the
events that every peer served only the stage it started on (the note column says otherwise).

**Links.** `unshaped` (veths, no qdisc); `100mbit`, `20mbit`: `tbf rate R burst 32kb latency 50ms`
on every peer's egress (its upload; its download is the others' uploads); `slow-replica`: every
peer at 20 Mbit except one replica of stage `--slow-stage` (default 1, a stage server: the drivers'
routing decides what it gets) at 5 Mbit. For `slow-replica` each row also runs the baseline its goal
needs: the same swarm without the slow replica (3 peers at 20 Mbit). The slow replica's share is
min(its link-limited rate, its compute rate), both measured in the slow run: the link-limited rate
is 5 Mbit / the boundary bytes per sample it has to send (a stage server sends the activations'
gradients back, the drivers' answer bytes per sample; a driver sends activations, its request bytes
per sample), the compute rate is the mean rate it announced (samples/s of its own forward and
backward). The goal's denominator is (the others alone + that share), capped by the 20mbit run of
the same row and seed when it ran (four fast peers: the slow one cannot add more than a fast one).

**Rows** are manifest overrides (benchmarks/harness/overrides.py): `NAME:KEY=VALUE,...` with dotted
keys, e.g. `--rows "exact-fp32:pipeline.activation_codec=fp32,pipeline.gradient_codec=fp32"
defaults: "lookahead:pipeline.lookahead=true"` (the built-in rows: the exact synchronous pipeline
with fp32 boundaries, the quality reference; today's defaults; pipeline.lookahead). A new method is
a new row on the command line, e.g. `"async:pipeline.async_steps=true"`; every row is loaded as a
manifest before anything starts, so a bad key or value is an error naming it. The first row is the
reference (`--reference NAME` picks another).

**Columns** (counted from each peer's second round event to its last: the first round holds the
start-up): samples/s of the drivers, and that over the unshaped run of the same row and seed; link
utilisation per stage (egress bytes of its peers' interfaces, all traffic, over their tbf rate) and
compute utilisation per stage (the round events' `utilisation`: compute seconds over round
seconds); the drivers' own view (their `pipeline` events: most frequent bottleneck, link and
compute utilisation); boundary bytes per sample (the drivers' trips, request + answer, from the
`pipeline` events' byte rates, over the samples trained: a microbatch sent twice counts twice) and fp32's (2 x seq_len x d_model x 4 bytes) over it; validation
loss (bits/byte, the drivers' final evaluations, equal samples) against the reference row on the
same link and seed; seconds from the first driver's `driving` event to the first round whose
training loss (mean of the drivers') is at most the target: `--target-loss`, or by default the
reference row's final round's training loss on the same link and seed x 1.02 (training loss,
because evaluating every round would cost the compute measured; its resolution is one round).

Goals (issue 45): at 20 Mbit, >= 0.95 of the unshaped samples/s at <= 1 % loss above the reference;
boundary bytes >= 32x below fp32 at <= 1 %; with the slow replica, >= 0.9 of the others plus its
share. Only ratios measured within one run mean anything (the machine's cores are shared by the
peers and by whatever else runs). Root is needed for the namespaces; without it the script says why
and exits 0. Namespaces are removed whatever happens (Ctrl-C, SIGTERM, an exception), and those of
an earlier run that died are removed at start.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import REPO, netns
from benchmarks.harness.overrides import OverrideError, Row, apply, parse_rows
from benchmarks.harness.pipeline_figures import (BYTES_GOAL, LINK_GOAL, SLOW_GOAL, PeerEvents, RunFigures,
                                                 final_train_loss, fp32_boundary_bytes, rate_bytes, slow_share,
                                                 summarise, time_to, verdict, within)
from benchmarks.harness.report import Report, add_common_args, fmt, markdown_table
from swarmgrad.peer.cli.launcher import stop_on_signals
from swarmgrad.peer.manifest import Manifest, dumps, load
from swarmgrad.peer.placement.cost import stage_costs

PRESET = REPO / "examples" / "llama-cpu.toml"
ROWS = ("exact-fp32:pipeline.activation_codec=fp32,pipeline.gradient_codec=fp32", "defaults:",
        "lookahead:pipeline.lookahead=true")
QUICK_ROW = "defaults:"
LINKS = ("unshaped", "100mbit", "20mbit", "slow-replica")
RATES = {"unshaped": None, "100mbit": "100mbit", "20mbit": "20mbit", "slow-replica": "20mbit"}
SLOW_RATE = "5mbit"
STAGES = (0, 1, 0, 1)
"""The stage of each peer, in start order: 2 stages x 2 replicas."""
NS_PREFIX = "pwan-"
PORT = 31377
MEMORY_MARGIN = 1.05
TARGET_MARGIN = 1.02


@dataclasses.dataclass
class Run:
    row: str
    link: str
    seed: int
    variant: str = "full"
    """"full" (four peers) or "without-slow" (the slow-replica baseline: three)."""
    rounds: int = 0
    memory: int = 0
    wall_s: float = math.nan
    figures: RunFigures = dataclasses.field(default_factory=RunFigures)
    error: str = ""


# --- the manifests ----------------------------------------------------------------------------------
def base_manifest(path: Path, seed: int, samples: int, inner_steps: int) -> Manifest:
    """The preset as every row starts from it: step-counted rounds, the schedule over `samples`,
    evaluations only at the start and the end."""
    m = load(path)
    return m.replace(run_id="pipeline-wan", seed=seed, stages={"count": 2},
                     rounds={"inner_steps": inner_steps, "round_seconds": 0.0, "max_rounds": 0},
                     schedule={"kind": "cosine", "warmup_samples": samples // 10, "total_samples": samples,
                               "min_lr_ratio": 0.1},
                     data={"eval_every": 0})


def rounds_for(m: Manifest, samples: int, drivers: int = 2) -> int:
    """Rounds every peer runs so that the drivers train at least `samples` (and 2 rounds at least:
    the first is not counted)."""
    per_round = drivers * m.rounds.inner_steps * m.inner.microbatch_size * m.inner.microbatches_per_step
    if m.inner.microbatch_sizes:
        per_round = drivers * m.rounds.inner_steps * sum(m.inner.microbatch_sizes)
    return max(2, math.ceil(samples / per_round))


def memory_offer(m: Manifest) -> int:
    """1.05 x placement's estimate of the largest stage; raises if that would hold the whole model."""
    per_stage = max(c.memory_bytes for c in stage_costs(m, None, compute_dtype="float32"))
    # the whole model as one stage has no boundary to constrain (boundary_subspace needs two stages)
    whole = stage_costs(m.replace(stages={"count": 1, "layers": []}, model={"boundary_subspace": 0}), None,
                        compute_dtype="float32")[0].memory_bytes
    offer = int(per_stage * MEMORY_MARGIN)
    if offer >= whole:
        raise ValueError(f"{MEMORY_MARGIN} x the largest stage ({per_stage / 2**20:.0f} MiB) would hold the whole "
                         f"model ({whole / 2**20:.0f} MiB): the stages are too unequal for this benchmark")
    return offer


# --- one swarm --------------------------------------------------------------------------------------
def set_rate(endpoint: netns.Endpoint, rate: str) -> None:
    """Change one peer's egress tbf rate (the net was built with one rate for all)."""
    subprocess.run([*endpoint.exec_prefix(), "tc", "qdisc", "replace", "dev", endpoint.ifname, "root", "tbf",
                    "rate", rate, *netns.TBF], check=True, capture_output=True)


def run_swarm(m: Manifest, stages: list[int], rates: list[str | None], rounds: int, memory: int, workdir: Path,
              tag: str, subnet: int, timeout_s: float) -> tuple[RunFigures, float]:
    """Run the swarm until every driver has its final evaluation; its figures and its wall time
    (from the launch to the last driver's final evaluation)."""
    workdir.mkdir(parents=True)
    (workdir / "manifest.toml").write_text(dumps(m))
    # the drivers decide the samples; a stage server that stopped after its own count of rounds left
    # a driver that was a round behind with no route (seen with the slow replica): they serve until closed
    extra = lambda stage: ["--max-memory", str(memory), "--max-rounds", str(rounds if stage == 0 else 0)]  # noqa: E731
    started = time.monotonic()
    with netns.WanNet(tag, len(stages), rates[0], subnet=subnet, name_prefix=NS_PREFIX) as net:
        for endpoint, rate in zip(net.endpoints, rates):
            if rate != rates[0]:
                set_rate(endpoint, rate or "10gbit")
        sampler = netns.TxSampler(net, 1.0, time.time)  # the events' clock
        sampler.start()
        try:
            with netns.NetnsSwarm(workdir / "manifest.toml", workdir, net.endpoints, port=PORT) as swarm:
                # every peer at once, as a launch script would: the others wait for the first (--bootstrap-wait)
                swarm.start_first_at(f"/ip4/{net.endpoints[0].address}/tcp/{PORT}", stages[0], *extra(stages[0]))
                for s in stages[1:]:
                    swarm.start(s, *extra(s))
                drivers = [p for p in swarm.peers if p.stage == 0]
                deadline = time.monotonic() + timeout_s
                evaluated = lambda d: any(e.get("final") for e in d.events("eval"))  # noqa: E731
                while not all(evaluated(d) for d in drivers):
                    failed = [p for p in swarm.peers if not p.alive and p.proc.returncode != 0] + \
                        [d for d in drivers if not d.alive and not evaluated(d)]
                    if failed or time.monotonic() > deadline:
                        p = (failed or drivers)[0]
                        why = f"{p.name} exited {p.proc.returncode}" if failed else f"timeout {timeout_s:.0f}s"
                        raise RuntimeError(f"{why}: " + p.log_tail(6).replace("\n", " | "))
                    time.sleep(0.5)
                wall = time.monotonic() - started
                swarm.close(grace=20.0)
                peers = [PeerEvents(s, rate_bytes(r), p.events()) for s, r, p in zip(stages, rates, swarm.peers)]
        finally:
            sampler.stop.set()
            sampler.join(5)
            # the interface counters over time, beside the peers' events (--workdir keeps both)
            (workdir / "tx.jsonl").write_text("".join(json.dumps([t, v]) + "\n" for t, v in sampler.samples))
    return summarise(peers, sampler.between), wall


def run_one(run: Run, m: Manifest, args: argparse.Namespace, workdir: Path, index: int) -> Run:
    """One (row, link, seed, variant): its swarm, or the error that stopped it (the others go on)."""
    stages, rates = list(STAGES), [RATES[run.link]] * len(STAGES)
    slow = STAGES.index(args.slow_stage, 2)  # the second replica of that stage
    if run.link == "slow-replica":
        rates[slow] = SLOW_RATE
    if run.variant == "without-slow":
        del stages[slow], rates[slow]
    run.rounds, run.memory = rounds_for(m, args.samples), memory_offer(m)
    try:
        run.figures, run.wall_s = run_swarm(m, stages, rates, run.rounds, run.memory,
                                            workdir / f"{run.seed}-{run.link}-{run.row}-{run.variant}",
                                            f"{index}", subnet=index % 250, timeout_s=args.run_timeout)
    except (RuntimeError, TimeoutError, subprocess.CalledProcessError) as e:
        run.error = f"{type(e).__name__}: {e}"
    return run


# --- the table --------------------------------------------------------------------------------------
def _find(runs: list[Run], row: str, link: str, seed: int, variant: str = "full") -> Run | None:
    return next((r for r in runs if (r.row, r.link, r.seed, r.variant) == (row, link, seed, variant) and not r.error),
                None)


def _per_stage(d: dict[int, float], digits: int = 2) -> str:
    return " / ".join(fmt(d.get(s, math.nan), digits) for s in (0, 1))


def target_for(runs: list[Run], run: Run, reference: str, target: float | None) -> float:
    if target is not None:
        return target
    ref = _find(runs, reference, run.link, run.seed)
    return final_train_loss(ref.figures.losses) * TARGET_MARGIN if ref else math.nan


def main_table(runs: list[Run], reference: str, fp32: int, target: float | None) -> str:
    out = []
    for r in runs:
        if r.variant != "full":
            continue
        if r.error:
            out.append([r.row, r.link, r.seed] + [""] * 9 + [f"FAILED: {r.error[:200]}"])
            continue
        f, base, ref = r.figures, _find(runs, r.row, "unshaped", r.seed), _find(runs, reference, r.link, r.seed)
        goal = target_for(runs, r, reference, target)
        loss = f"{fmt(f.val_loss, 3)}" + (f" ({100 * (f.val_loss / ref.figures.val_loss - 1):+.2f} %)" if ref else "")
        notes = ([] if f.one_stage_each else ["a peer changed stage"]) + f.notes
        out.append([r.row, r.link, r.seed, f.samples, fmt(f.samples_per_s, 2),
                    fmt(f.samples_per_s / base.figures.samples_per_s, 2) if base else "",
                    _per_stage(f.link_util), _per_stage(f.compute_util),
                    f"{f.bottleneck} ({fmt(f.driver_link_util, 2)}, {fmt(f.driver_compute_util, 2)})" if f.bottleneck else "",
                    f"{fmt(f.boundary_bytes_per_sample / 1e3, 1)} ({fmt(fp32 / f.boundary_bytes_per_sample, 1)}x)",
                    loss, f"{fmt(time_to(f.losses, goal), 0)} (≤ {fmt(goal, 3)})", "; ".join(notes)])
    return markdown_table(["row", "link", "seed", "samples", "samples/s", "÷ unshaped", "link util s0 / s1",
                           "compute util s0 / s1", "drivers: bottleneck (link, compute)",
                           "boundary kB/sample (fp32 ÷ it)", f"val bits/byte (vs {reference})",
                           "s to train loss (target)", "note"], out)


def slow_rows(runs: list[Run], slow_stage: int) -> list[tuple[Run, Any]]:
    """(the slow run, its SlowShare) for every row and seed whose slow run and baseline both ran."""
    out = []
    for r in runs:
        if r.link != "slow-replica" or r.variant != "full" or r.error:
            continue
        alone = _find(runs, r.row, r.link, r.seed, "without-slow")
        if alone is None:
            continue
        fast = _find(runs, r.row, "20mbit", r.seed)
        f = r.figures
        per_sample = f.up_bytes_per_sample if slow_stage == 0 else f.down_bytes_per_sample
        slow = STAGES.index(slow_stage, 2)
        out.append((r, slow_share(alone.figures.samples_per_s, rate_bytes(SLOW_RATE) or math.nan, per_sample,
                                  f.compute_rate[slow] if len(f.compute_rate) > slow else math.nan,
                                  fast.figures.samples_per_s if fast else math.nan)))
    return out


def slow_table(pairs: list[tuple[Run, Any]]) -> str:
    return markdown_table(
        ["row", "seed", "swarm samples/s", "others alone", "slow replica: link-limited / compute -> share",
         "others + share (capped by 4 x 20 Mbit)", f"ratio (goal ≥ {SLOW_GOAL})"],
        [[r.row, r.seed, fmt(r.figures.samples_per_s, 2), fmt(s.others, 2),
          f"{fmt(s.link_limited, 2)} / {fmt(s.compute, 2)} -> {fmt(s.share, 2)}", fmt(s.ideal, 2),
          f"{fmt(s.ratio(r.figures.samples_per_s), 2)} {verdict(s.ratio(r.figures.samples_per_s) >= SLOW_GOAL)}"]
         for r, s in pairs])


def goal_lines(runs: list[Run], reference: str, fp32: int, slow: list[tuple[Run, Any]]) -> list[str]:
    lines = []
    for r in runs:
        if r.variant != "full" or r.error or r.link != "20mbit":
            continue
        base, ref = _find(runs, r.row, "unshaped", r.seed), _find(runs, reference, r.link, r.seed)
        f = r.figures
        loss_ok = within(f.val_loss, ref.figures.val_loss) if ref else None
        if base:
            speed = f.samples_per_s / base.figures.samples_per_s
            ok = None if loss_ok is None else speed >= LINK_GOAL and loss_ok
            lines.append(f"- {r.row} (seed {r.seed}) at 20 Mbit: {speed:.2f} of unshaped, loss "
                         f"{100 * (f.val_loss / ref.figures.val_loss - 1):+.2f} % vs {reference}: {verdict(ok)}"
                         if ref else f"- {r.row} (seed {r.seed}) at 20 Mbit: {speed:.2f} of unshaped")
        ratio = fp32 / f.boundary_bytes_per_sample
        lines.append(f"- {r.row} (seed {r.seed}) boundary bytes: {ratio:.1f}x below fp32 (goal ≥ {BYTES_GOAL:g}x at ≤ 1 %): "
                     f"{verdict(None if loss_ok is None else ratio >= BYTES_GOAL and loss_ok)}")
    for r, s in slow:
        ratio = s.ratio(r.figures.samples_per_s)
        lines.append(f"- {r.row} (seed {r.seed}) with one replica at {SLOW_RATE}: {ratio:.2f} of the others + its share: "
                     f"{verdict(ratio >= SLOW_GOAL)}")
    return lines


# --- the command ------------------------------------------------------------------------------------
def remove_stale() -> None:
    """Namespaces `pwan-<pid>-...` of benchmark processes that are gone (a SIGKILLed earlier run)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for name in (line.split()[0] for line in listing.splitlines() if line.strip()):
        pid = name[len(NS_PREFIX):].split("-", 1)[0] if name.startswith(NS_PREFIX) else ""
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    add_common_args(p, quick="a smoke run of a few minutes: 192 samples (H = 3), the defaults row only",
                    seed="one seed (the manifest's seed: weights and data); --seeds for several")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds to run, each a full pass (default 0)")
    p.add_argument("--rows", nargs="+", default=None, metavar="NAME:KEY=VALUE,...",
                   help="rows as manifest overrides (default: " + " ".join(repr(r) for r in ROWS) + ")")
    p.add_argument("--reference", default=None, help="the row losses compare to (default: the first)")
    p.add_argument("--links", default=",".join(LINKS), help=f"comma-separated, of {','.join(LINKS)}")
    p.add_argument("--samples", type=int, default=None, help="samples the drivers train per run (default 384; --quick 192)")
    p.add_argument("--inner-steps", type=int, default=None, help="H, inner steps per round (default 4; --quick 3)")
    p.add_argument("--slow-stage", type=int, choices=(0, 1), default=1,
                   help="the stage of the replica behind 5 Mbit in the slow-replica link (default 1)")
    p.add_argument("--target-loss", type=float, default=None,
                   help="training loss (nats/token) that time-to-target counts to (default: the reference row's "
                        f"final round's x {TARGET_MARGIN} on the same link and seed)")
    p.add_argument("--manifest", type=Path, default=PRESET, help="the manifest rows start from (default: the Llama CPU preset)")
    p.add_argument("--run-timeout", type=float, default=None, help="seconds one swarm may take (default 300 + samples/2)")
    p.add_argument("--workdir", type=Path, default=None, help="keep every peer's log and events here")
    args = p.parse_args(argv)
    args.seeds = args.seeds or [0 if args.seed is None else args.seed]
    args.samples = args.samples or (192 if args.quick else 384)
    args.inner_steps = args.inner_steps or (3 if args.quick else 4)
    args.run_timeout = args.run_timeout or 300 + args.samples / 2
    args.links = args.links.split(",")
    if any(x not in LINKS for x in args.links):
        p.error(f"--links: choose from {','.join(LINKS)}")
    try:
        args.rows = parse_rows(args.rows or ([QUICK_ROW] if args.quick else list(ROWS)))
        args.manifests = {(r.name, s): apply(base_manifest(args.manifest, s, args.samples, args.inner_steps), r)
                          for r in args.rows for s in args.seeds}
        for m in args.manifests.values():
            memory_offer(m)
    except (OverrideError, ValueError) as e:
        p.error(str(e))
    args.reference = args.reference or args.rows[0].name
    if args.reference not in {r.name for r in args.rows}:
        p.error(f"--reference {args.reference}: not one of the rows")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    why = netns.why_unavailable()
    if why:
        print(f"SKIP: benchmarks.pipeline_wan needs network namespaces: {why}")
        return 0
    remove_stale()
    tmp = args.workdir or Path(tempfile.mkdtemp(prefix="pipeline-wan-"))
    any_m = next(iter(args.manifests.values()))
    fp32 = fp32_boundary_bytes(any_m.model.seq_len, any_m.model.d_model)
    report = Report("A pipeline over slow links", args.out)
    plan = [Run(r.name, link, seed, variant) for seed in args.seeds for link in args.links for r in args.rows
            for variant in (("full", "without-slow") if link == "slow-replica" else ("full",))]
    report.print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
                 f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; {len(plan)} swarms of "
                 f"{args.manifest.name}, {args.samples} samples each, H = {args.inner_steps}; rows: "
                 + "; ".join(r.spec() for r in args.rows))
    runs: list[Run] = []
    started = time.monotonic()
    try:
        with stop_on_signals():
            for i, run in enumerate(plan):
                print(f"--- {run.row} over {run.link} ({run.variant}), seed {run.seed} [{i + 1}/{len(plan)}]", flush=True)
                runs.append(run_one(run, args.manifests[(run.row, run.seed)], args, tmp, i))
                f = run.figures
                print(f"  {f.samples} samples, {fmt(f.samples_per_s, 2)} samples/s, val {fmt(f.val_loss, 3)} bits/byte, "
                      f"{fmt(run.wall_s, 0)} s" + (f" FAILED: {run.error}" if run.error else ""), flush=True)
                report.results = {"runs": [dataclasses.asdict(r) for r in runs]}
                report.write()
    except KeyboardInterrupt:
        report.print(f"stopped after {len(runs)} of {len(plan)} swarms")
    finally:
        if not args.workdir:
            shutil.rmtree(tmp, ignore_errors=True)
    report.print()
    report.print(main_table(runs, args.reference, fp32, args.target_loss))
    slow = slow_rows(runs, args.slow_stage)
    if slow:
        report.print(f"\nWith one replica of stage {args.slow_stage} at {SLOW_RATE}, the others at 20 Mbit:\n")
        report.print(slow_table(slow))
    report.print("\nGoals:")
    for line in goal_lines(runs, args.reference, fp32, slow):
        report.print(line)
    report.print(f"\n{len(runs)} swarms in {(time.monotonic() - started) / 60:.1f} min; load average after "
                 f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}. Only ratios within one run compare.")
    report.results = {"samples": args.samples, "inner_steps": args.inner_steps, "fp32_bytes_per_sample": fp32,
                      "rows": [r.spec() for r in args.rows], "reference": args.reference,
                      "runs": [dataclasses.asdict(r) for r in runs]}
    report.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
