"""Pipeline overhead: the same model trained by one process alone vs by the demo swarm, in one run.

    python benchmarks/pipeline_overhead.py [--manifest PATH] [--rounds N] [--seconds S] [--quick]

(a) single process: the whole model (all stages as one nn.Sequential), AdamW with the manifest's
    inner settings, inner.microbatches_per_step microbatches of inner.microbatch_size per step, for
    S seconds, torch's default thread count -> samples/s.
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
from torch import nn

from _common import DEFAULT_MANIFEST, SwarmFailed, SwarmRun, fail, fmt, markdown_table, run_swarm
from swarmgrad.peer.data import MicrobatchStream, load_corpora
from swarmgrad.peer.manifest import Manifest, load
from swarmgrad.peer.model import from_manifest

REPLICAS = 2


def single_process(m: Manifest, seconds: float) -> dict[str, float]:
    """Train the whole model in this process for `seconds`; samples/s over whole inner steps."""
    staged = from_manifest(m)
    stages = [staged.build_stage(i) for i in range(staged.n_stages)]
    model = nn.Sequential(*stages)
    model.train()
    c = m.inner
    opt = torch.optim.AdamW(model.parameters(), lr=c.lr, betas=tuple(c.betas), weight_decay=c.weight_decay)
    d = m.data
    train, _ = load_corpora(d.source, d.paths, d.val_fraction, d.max_bytes or None)
    stream = MicrobatchStream(train, m.model.seq_len, c.microbatch_size, m.seed)

    def step() -> float:
        losses = []
        for _ in range(c.microbatches_per_step):
            x, y = next(stream)
            loss = staged.loss_fn(model(x), y)
            (loss / c.microbatches_per_step).backward()  # the mean over the step's microbatches
            losses.append(loss.item())
        if c.grad_clip > 0:
            for stage in stages:  # clipped per stage, as every stage's worker does in the swarm
                torch.nn.utils.clip_grad_norm_(stage.parameters(), c.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
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
    ap.add_argument("--manifest", type=Path, default=DEFAULT_MANIFEST)
    ap.add_argument("--rounds", type=int, default=None, help="swarm rounds (default 4; 2 with --quick)")
    ap.add_argument("--seconds", type=float, default=None, help="single-process seconds (default 60; 15 with --quick)")
    ap.add_argument("--quick", action="store_true", help="a short smoke run (about 1-2 minutes)")
    ap.add_argument("--keep", action="store_true", help="keep the swarm's logs and events")
    args = ap.parse_args()
    rounds = args.rounds if args.rounds is not None else (2 if args.quick else 4)
    seconds = args.seconds if args.seconds is not None else (15.0 if args.quick else 60.0)
    m = load(args.manifest)
    n_peers = m.stages.count * REPLICAS
    cores = os.cpu_count() or 1

    print(f"pipeline overhead: run {m.run_id} ({args.manifest}), {cores} cores on this machine", flush=True)
    print(f"load average before: {os.getloadavg()[0]:.1f}", flush=True)
    print(f"(a) single process, whole model, {seconds:g}s ...", flush=True)
    single = single_process(m, seconds)
    print(f"    {single['samples']} samples in {single['seconds']:.1f}s, {single['threads']} torch threads using "
          f"{single['cores_used']:.2f} cores on average (load average {os.getloadavg()[0]:.1f}), "
          f"train loss {single['first_loss']:.3f} -> {single['last_loss']:.3f} nats", flush=True)

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
    print(f"    {sw['samples']} samples; first online -> last driver round {sw['window_s']:.1f}s, of which "
          f"startup (until the drivers' first eval) {sw['startup_s']:.1f}s; per driver {sw['driving_s']:.1f}s "
          f"driving, {sw['averaging_s']:.1f}s averaging; rounds complete {sw['complete']}/{sw['rounds']}; "
          f"validation {sw['val_before']:.3f} -> {sw['val_after']:.3f} bits/byte; load average after "
          f"{os.getloadavg()[0]:.1f}", flush=True)
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
    print()
    print(markdown_table(["mode", "samples/s", "ratio to single process", "bytes sent/sample"], rows))
    print()
    print(f"Note: the {n_peers} swarm processes (1 torch thread each) share this machine's {cores} cores with each "
          f"other (the single process used {single['threads']} threads), so the ratio measures the pipeline's "
          "overhead on one machine, not a multi-machine speed-up. On a machine shared with other jobs, the swarm's "
          f"{n_peers} processes also get more of the CPU than one process does, which flatters the swarm; compare "
          "the load averages and the single process's cores used. Bytes sent per sample: all peers' bytes_sent "
          "(stopped events: activations, gradients, averaging) / samples trained by the drivers.")


if __name__ == "__main__":
    main()
