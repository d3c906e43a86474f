"""The learning-rate schedule at equal samples: the reference task (examples/reference.toml: 2 peers
each holding the whole model, H = 50, 10 rounds = 32,000 sequences) with a constant lr and with the
manifest's warmup + cosine schedule, one after the other in one run.

    python benchmarks/schedule.py [--rounds N] [--quick]

Columns: final validation loss (mean of both drivers' final evals, bits/byte), samples trained, the
lr both replicas used at the start of the last round (equal by construction), and whether every
complete round left the replicas with one state digest.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from _common import SwarmFailed, fail, fmt, markdown_table, run_swarm
from swarmgrad.peer.manifest import load

REFERENCE = Path(__file__).resolve().parent.parent / "examples" / "reference.toml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="rounds per run (default: the manifest's 10)")
    parser.add_argument("--quick", action="store_true", help="2 rounds of H = 10 (a smoke run)")
    args = parser.parse_args()
    base = load(REFERENCE)
    rounds = args.rounds or base.rounds.max_rounds
    if args.quick:
        rounds = 2
        base = base.replace(rounds={"inner_steps": 10}, schedule={"warmup_samples": 320, "total_samples": 1280})
    variants = [("constant lr", base.replace(schedule={"kind": "constant", "warmup_samples": 0})),
                (f"warmup {base.schedule.warmup_samples} + {base.schedule.kind} to {base.schedule.min_lr_ratio:g}", base)]
    rows = []
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
    except SwarmFailed as e:
        fail(e)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print()
    print(markdown_table(["lr", "val bits/byte", "samples", "lr at last round's start", "replicas identical"], rows))


if __name__ == "__main__":
    main()
