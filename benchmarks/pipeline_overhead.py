"""Pipeline overhead: the same model trained by one process alone vs by the demo swarm, in one run.

    python -m benchmarks.pipeline_overhead [--manifest PATH] [--rounds N] [--seconds S] [--quick]
                                           [--seed N] [--out DIR]

(a) single process: the whole model, every stage in this process (the benchmarks' training loop,
    benchmarks/harness/training.py: each stage's inner optimiser with the manifest's settings),
    inner.microbatches_per_step microbatches of inner.microbatch_size per step, for S seconds,
    torch's default thread count -> samples/s.
(b) swarm: stages.count x 2 replicas peer processes on this machine, same manifest, --max-rounds N
    with the manifest's rounds.round_seconds -> samples trained by the drivers / (last stage-0 round
    event - first "online" event). Pipeline-only: each driver's samples / (its last round event - its
    first eval, i.e. the start of driving, - its rounds' averaging_s), summed over drivers; excluding
    averaging: samples / (that window - the drivers' mean total averaging_s).

All peers share this machine's cores, so the ratio is the pipeline's overhead on one machine, not a
multi-machine speed-up. Only ratios measured side by side in one run mean anything.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness.report import Report, add_common_args, fmt, seed_or
from benchmarks.harness.swarm import DEFAULT_MANIFEST, SwarmFailed, SwarmRun, fail, run_swarm
from benchmarks.harness.training import Trainer
from swarmgrad.peer.data import MicrobatchStream, load_corpora
from swarmgrad.peer.manifest import Manifest, load

REPLICAS = 2


def single_process(m: Manifest, seconds: float) -> dict[str, float]:
    """Train the whole model in this process for `seconds`; samples/s over whole inner steps."""
    trainer = Trainer(m)
    c = m.inner
    d = m.data
    train, _ = load_corpora(d.source, d.paths, d.val_fraction, d.max_bytes or None)
    stream = MicrobatchStream(train, m.model.seq_len, c.microbatch_size, m.seed)

    def step() -> float:
        losses = trainer.step([next(stream) for _ in range(c.microbatches_per_step)])
        return sum(losses) / len(losses)

    first_loss = step()  # warm-up (allocator, kernels), not timed
    steps, loss = 0, first_loss
    started, cpu0 = time.perf_counter(), time.process_time()
    while time.perf_counter() - started < seconds:
        loss = step()
        steps += 1
    elapsed = time.perf_counter() - started
    samples = steps * c.microbatches_per_step * c.microbatch_size
    return {"samples": samples, "seconds": elapsed, "samples_per_s": samples / elapsed,
            "cores_used": (time.process_time() - cpu0) / elapsed,
            "first_loss": first_loss, "last_loss": loss, "threads": torch.get_num_threads()}


def swarm_figures(run: SwarmRun) -> dict[str, float]:
    drivers = run.drivers
    driver_rounds = run.events("round", drivers)
    online = [e["time"] for e in run.events("online")]
    window = max(e["time"] for e in driver_rounds) - min(online)
    samples = run.samples
    pipeline_rate, driving_s, averaging_s = 0.0, [], []
    for p in drivers:
        rounds = p.events("round")
        started = p.events("driving")  # after its start evaluation, if it made one
        if not rounds or not started:
            continue
        avg = sum(e["averaging_s"] or 0.0 for e in rounds)
        driving = max(e["time"] for e in rounds) - started[0]["time"] - avg
        driving_s.append(driving)
        averaging_s.append(avg)
        if driving > 0:
            pipeline_rate += sum(e["samples"] for e in rounds) / driving
    first_eval = min(e["time"] for e in run.events("eval", drivers))
    mean_avg = sum(averaging_s) / len(averaging_s) if averaging_s else math.nan
    return {"no_avg_samples_per_s": samples / (window - mean_avg) if window > mean_avg else math.nan,
            "samples": samples, "window_s": window, "samples_per_s": samples / window if window > 0 else math.nan,
            "pipeline_samples_per_s": pipeline_rate if driving_s else math.nan,
            "startup_s": first_eval - min(online),
            "averaging_s": sum(averaging_s) / len(averaging_s) if averaging_s else math.nan,
            "driving_s": sum(driving_s) / len(driving_s) if driving_s else math.nan,
            "bytes_per_sample": run.bytes_sent / samples if samples else math.nan,
            "complete": sum(1 for e in run.events("round") if e["complete"]),
            "rounds": len(run.events("round")),
            "val_before": run.first_val_loss(), "val_after": run.final_val_loss()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap, quick="a short smoke run (about 1-2 minutes): 2 rounds, 15 s single process",
                    seed="the manifest's seed: weights and data (default: the manifest's)")
    ap.add_argument("--manifest", type=Path, default=DEFAULT_MANIFEST)
    ap.add_argument("--rounds", type=int, default=None, help="swarm rounds (default 4; 2 with --quick)")
    ap.add_argument("--seconds", type=float, default=None, help="single-process seconds (default 60; 15 with --quick)")
    ap.add_argument("--keep", action="store_true", help="keep the swarm's logs and events")
    args = ap.parse_args()
    rounds = args.rounds if args.rounds is not None else (2 if args.quick else 4)
    seconds = args.seconds if args.seconds is not None else (15.0 if args.quick else 60.0)
    m = load(args.manifest)
    m = m.replace(seed=seed_or(args, m.seed))
    n_peers = m.stages.count * REPLICAS
    cores = os.cpu_count() or 1
    report = Report("Pipeline overhead: one process alone against the demo swarm", args.out)

    report.print(f"pipeline overhead: run {m.run_id} ({args.manifest}), {cores} cores on this machine")
    report.print(f"load average before: {os.getloadavg()[0]:.1f}")
    print(f"(a) single process, whole model, {seconds:g}s ...", flush=True)
    single = single_process(m, seconds)
    report.print(f"(a) single process: {single['samples']} samples in {single['seconds']:.1f}s, {single['threads']} torch "
                 f"threads using {single['cores_used']:.2f} cores on average (load average {os.getloadavg()[0]:.1f}), "
                 f"train loss {single['first_loss']:.3f} -> {single['last_loss']:.3f} nats")

    print(f"(b) swarm: {m.stages.count} stages x {REPLICAS} replicas = {n_peers} processes, {rounds} rounds of "
          f"{m.rounds.round_seconds:g}s ...", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="swarmgrad-bench-pipeline-"))
    budget = (rounds + 3) * m.rounds.round_seconds + 240
    try:
        run = run_swarm(m, workdir, rounds, REPLICAS, budget, label="swarm")
    except SwarmFailed as e:
        print(f"logs kept in {workdir}", flush=True)
        fail(e)
    sw = swarm_figures(run)
    report.print(f"(b) swarm: {sw['samples']} samples; first online -> last driver round {sw['window_s']:.1f}s, of "
                 f"which startup (until the drivers' first eval) {sw['startup_s']:.1f}s; per driver "
                 f"{sw['driving_s']:.1f}s driving, {sw['averaging_s']:.1f}s averaging; rounds complete "
                 f"{sw['complete']}/{sw['rounds']}; validation {sw['val_before']:.3f} -> {sw['val_after']:.3f} "
                 f"bits/byte; load average after {os.getloadavg()[0]:.1f}")
    if args.keep:
        print(f"    logs and events in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)

    base = single["samples_per_s"]
    rows = [
        ["single process (whole model)", fmt(base), "1.00", "0"],
        [f"swarm {m.stages.count}x{REPLICAS} ({n_peers} processes)", fmt(sw["samples_per_s"]),
         fmt(sw["samples_per_s"] / base, 2), fmt(sw["bytes_per_sample"] / 1e3, 1) + " kB"],
        ["swarm, excluding averaging time", fmt(sw["no_avg_samples_per_s"]),
         fmt(sw["no_avg_samples_per_s"] / base, 2), ""],
        ["swarm, pipeline only (driving: no startup, no averaging)", fmt(sw["pipeline_samples_per_s"]),
         fmt(sw["pipeline_samples_per_s"] / base, 2), ""],
    ]
    report.print()
    report.table(["mode", "samples/s", "ratio to single process", "bytes sent/sample"], rows)
    report.print()
    report.print(f"Note: the {n_peers} swarm processes (1 torch thread each) share this machine's {cores} cores with "
                 f"each other (the single process used {single['threads']} threads), so the ratio measures the "
                 "pipeline's overhead on one machine, not a multi-machine speed-up. On a machine shared with other "
                 f"jobs, the swarm's {n_peers} processes also get more of the CPU than one process does, which flatters "
                 "the swarm; compare the load averages and the single process's cores used. Bytes sent per sample: "
                 "all peers' bytes_sent (stopped events: activations, gradients, averaging) / samples trained by the "
                 "drivers.")
    report.results = {"manifest": str(args.manifest), "rounds": rounds, "single_process": single, "swarm": sw}
    report.finish()


if __name__ == "__main__":
    main()
