"""What inner.swarm_second_moment costs per inner step: the reference model's step (32 samples)
timed three ways, side by side, in one run on one thread:

    python -m benchmarks.swarm_moment_step [--manifest examples/reference.toml] [--steps 10] [--quick]
                                           [--seed N] [--out DIR]

- AdamW on one microbatch of 32 (the reference's step),
- AdamW on two microbatches of 16 (what SwarmAdamW needs: the spread between them),
- SwarmAdamW on two microbatches of 16, each microbatch's gradients observed (the worker's path).

Each step is the benchmarks' training loop's (benchmarks/harness/training.py): the worker's inner
optimiser (the mean, clipping, the schedule's lr, the optimizer), its gradients reaching it as the
worker's do: summed by autograd for AdamW, one microbatch at a time for SwarmAdamW.

Ratios to the first row, so a shared machine's speed cancels; the rows alternate step by step.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch

from benchmarks.harness.report import Report, add_common_args, seed_or
from benchmarks.harness.training import REFERENCE, Batch, Trainer
from swarmgrad.peer.manifest import load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap, quick="3 steps each", seed="weights and the random batch (default: the manifest's)")
    ap.add_argument("--manifest", type=Path, default=REFERENCE)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    steps = 3 if args.quick else args.steps
    torch.set_num_threads(1)
    m = load(args.manifest)
    m = m.replace(stages={"count": 1}, seed=seed_or(args, m.seed),
                  inner={"microbatch_size": 32, "microbatches_per_step": 1})
    gen = torch.Generator().manual_seed(m.seed)
    seq = m.model.seq_len
    x = torch.randint(0, 256, (32, seq), generator=gen)
    y = torch.randint(0, 256, (32, seq), generator=gen)
    whole: list[Batch] = [(x, y)]
    halves: list[Batch] = [(x[:16], y[:16]), (x[16:], y[16:])]

    def trainer(swarm: bool) -> Trainer:
        return Trainer(m, replicas=2, inner=dataclasses.replace(m.inner, swarm_second_moment=swarm))

    rows: list[tuple[str, list[Batch], Trainer]] = [
        ("AdamW, 1 x 32", whole, trainer(False)),
        ("AdamW, 2 x 16", halves, trainer(False)),
        ("SwarmAdamW, 2 x 16", halves, trainer(True)),
    ]
    times: dict[str, list[float]] = {name: [] for name, _, _ in rows}
    for _, batches, t in rows:
        t.step(batches)  # warm-up
    for _ in range(steps):
        for name, batches, t in rows:
            started = time.perf_counter()
            t.step(batches)
            times[name].append(time.perf_counter() - started)
    base = statistics.median(times[rows[0][0]])
    params = sum(p.numel() for p in rows[0][2].params())
    report = Report("inner.swarm_second_moment: the cost of an inner step", args.out)
    report.print(f"{params:,} parameters, {steps} steps each (medians)")
    report.table(["step", "ms", "vs AdamW 1 x 32"],
                 [[name, f"{1000 * statistics.median(times[name]):.0f}",
                   f"{statistics.median(times[name]) / base:.2f}x"] for name, _, _ in rows])
    report.results = {"manifest": str(args.manifest), "parameters": params, "steps": steps,
                      "seconds": times, "median_ratio": {n: statistics.median(t) / base for n, t in times.items()}}
    report.finish()


if __name__ == "__main__":
    main()
