"""What inner.swarm_second_moment costs per inner step: the reference model's step (32 samples)
timed three ways, side by side, in one run on one thread:

    python benchmarks/swarm_moment_step.py [--manifest examples/reference.toml] [--steps 10]

- AdamW on one microbatch of 32 (the reference's step),
- AdamW on two microbatches of 16 (what SwarmAdamW needs: the spread between them),
- SwarmAdamW on two microbatches of 16, each microbatch's gradients observed (the worker's path).

Each step is the worker's (peer/compute/inner_optimizer.py: the mean, clipping, the schedule's lr, the
optimizer), its gradients reaching it as the worker's do: summed by autograd for AdamW, one
microbatch at a time for SwarmAdamW.

Ratios to the first row, so a shared machine's speed cancels; the rows alternate step by step.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from swarmgrad.peer.compute.inner_optimizer import InnerOptimizer
from swarmgrad.peer.manifest import load
from swarmgrad.peer.model import from_manifest
from swarmgrad.peer.compute.schedule import TrainingProgress

REFERENCE = Path(__file__).resolve().parent.parent / "examples" / "reference.toml"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--manifest", type=Path, default=REFERENCE)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    m = load(args.manifest).replace(stages={"count": 1})
    model = from_manifest(m)
    mod = model.build_stage(0)
    params = list(mod.parameters())
    seq = m.model.seq_len
    x = torch.randint(0, 256, (32, seq))
    y = torch.randint(0, 256, (32, seq))
    halves = ((x[:16], y[:16]), (x[16:], y[16:]))

    def adamw_one(opt: InnerOptimizer) -> None:
        model.loss_fn(mod(x), y).backward()
        opt.step(1, 0)

    def adamw_two(opt: InnerOptimizer) -> None:
        for a, b in halves:
            model.loss_fn(mod(a), b).backward()
        opt.step(2, 0)

    def swarm_two(opt: InnerOptimizer) -> None:
        for a, b in halves:
            opt.add([torch.autograd.grad(model.loss_fn(mod(a), b), opt.params())])
        opt.step(2, 0)

    def optimizer(swarm: bool) -> InnerOptimizer:
        opt = InnerOptimizer(mod, dataclasses.replace(m.inner, swarm_second_moment=swarm), TrainingProgress(m.schedule))
        opt.set_replicas(2)
        return opt

    rows: list[tuple[str, Callable, InnerOptimizer]] = [
        ("AdamW, 1 x 32", adamw_one, optimizer(False)),
        ("AdamW, 2 x 16", adamw_two, optimizer(False)),
        ("SwarmAdamW, 2 x 16", swarm_two, optimizer(True)),
    ]
    times: dict[str, list[float]] = {name: [] for name, _, _ in rows}
    for name, fn, opt in rows:
        fn(opt)  # warm-up
    for _ in range(args.steps):
        for name, fn, opt in rows:
            t = time.perf_counter()
            fn(opt)
            times[name].append(time.perf_counter() - t)
    base = statistics.median(times[rows[0][0]])
    print(f"{sum(p.numel() for p in params):,} parameters, {args.steps} steps each (medians)")
    print("| step | ms | vs AdamW 1 x 32 |")
    print("| --- | --- | --- |")
    for name, _, _ in rows:
        med = statistics.median(times[name])
        print(f"| {name} | {1000 * med:.0f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
