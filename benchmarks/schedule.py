"""The learning-rate schedule at equal samples: the reference task (examples/reference.toml: 2 peers
each holding the whole model, H = 50, 10 rounds = 32,000 sequences) with a constant lr and with the
manifest's warmup + cosine schedule, one after the other in one run.

    python -m benchmarks.schedule [--rounds N] [--quick] [--seed N] [--out DIR]

Columns: final validation loss (mean of both drivers' final evals, bits/byte), samples trained, the
lr both replicas used at the start of the last round (equal by construction), and whether every
complete round left the replicas with one state digest.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from benchmarks.harness.report import Report, add_common_args, fmt, seed_or
from benchmarks.harness.swarm import SwarmFailed, fail, run_swarm
from benchmarks.harness.training import REFERENCE
from swarmgrad.peer.manifest import load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser, quick="2 rounds of H = 10 (a smoke run)",
                    seed="the manifest's seed: weights and data (default: the manifest's, 0)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per run (default: the manifest's 10)")
    args = parser.parse_args()
    base = load(REFERENCE)
    base = base.replace(seed=seed_or(args, base.seed))
    rounds = args.rounds or base.rounds.max_rounds
    if args.quick:
        rounds = 2
        base = base.replace(rounds={"inner_steps": 10}, schedule={"warmup_samples": 320, "total_samples": 1280})
    variants = [("constant lr", base.replace(schedule={"kind": "constant", "warmup_samples": 0})),
                (f"warmup {base.schedule.warmup_samples} + {base.schedule.kind} to {base.schedule.min_lr_ratio:g}", base)]
    rows, results = [], []
    workdir = Path(tempfile.mkdtemp(prefix="swarmgrad-schedule-"))
    try:
        for label, manifest in variants:
            print(f"--- {label}", flush=True)
            run = run_swarm(manifest, workdir / label.split()[0], rounds, replicas=2, budget_s=3600, label=label)
            last = [e for e in run.events("round") if e["round"] == max(x["round"] for x in run.events("round"))]
            lrs = sorted({e.get("lr_start") for e in last})
            agree, _, _ = run.replica_agreement()
            rows.append([label, fmt(run.final_val_loss(), 3), run.samples,
                         ", ".join(f"{x:.2e}" for x in lrs if x is not None), "yes" if agree else "NO"])
            results.append({"lr": label, "val_bpb": run.final_val_loss(), "samples": run.samples,
                            "lr_last_round": [x for x in lrs if x is not None], "replicas_identical": agree})
    except SwarmFailed as e:
        fail(e)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print()
    report = Report("The learning-rate schedule at equal samples", args.out)
    report.table(["lr", "val bits/byte", "samples", "lr at last round's start", "replicas identical"], rows)
    report.results = {"rounds": rounds, "seed": base.seed, "variants": results}
    report.finish()


if __name__ == "__main__":
    main()
