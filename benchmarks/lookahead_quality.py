"""What one-step-stale stage-0 gradients (pipeline.lookahead) cost per sample: one process, no
network, one CPU thread.

    python -m benchmarks.lookahead_quality [--ahead 0 2 4] [--stale-stages 0,1] [--steps 500] [--quick]
                                           [--correction none nesterov predict delay_comp] [--scale S]
                                           [--seeds N M] [--seed N] [--out DIR]

The reference task (byte-level GPT, d_model 128, 4 layers, 4 heads, seq_len 128, two stages of two
layers; the Python stdlib's .py files; AdamW lr 2e-3, betas (0.9, 0.95), wd 0.1, clip 1.0 per stage;
warmup over 10 % of the steps then cosine to 10 %; 500 steps of 4 microbatches of 16 = 32,000 samples),
trained as the 2-stage pipeline trains it with one replica per stage, without rounds, by the
benchmarks' loop (benchmarks/harness/training.py: each stage's inner optimiser and the manifest's
schedule). With `--ahead A`, the
first A microbatches of every step after the first ran ahead: each stage of `--stale-stages`
computed them against the stash peer/compute/lookahead.py keeps (its weights before the previous step was
applied), exactly as a replica with lookahead does, so their gradients there are one step stale.
A = 4 is the bound (in a swarm the last step of each round never runs ahead at the driver, and a
driver's `pipeline` events report the share that did: `ahead_share`). Every variant starts from the same weights and
sees the same batches; val bits/byte on 16 × 32 held-out windows (the single-process benchmarks'
evaluation set). With `--trace N` (and --out) the training curves are plotted (training.png).

`--correction` adds, for every A > 0, a variant per pipeline.stale_correction
(peer/compute/staleness.py, σ = `--scale`): the stash each stage keeps is extrapolated, or the stale
gradients compensated as they join their step, by the worker's own `StaleCorrection`. `--seeds`
repeats every variant per seed (weights, batches; the validation windows stay those of seed 0's
corpus split).
"""
from __future__ import annotations

import argparse
import math
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

import torch

from benchmarks.harness.report import Report, add_common_args, seed_or
from benchmarks.harness.training import Trainer, reference, reference_data
from swarmgrad.peer.compute.lookahead import Lookahead, grads_wrt
from swarmgrad.peer.compute.staleness import StaleCorrection
from swarmgrad.peer.data import MicrobatchStream, bits_per_byte
from swarmgrad.peer.manifest import STALE_CORRECTIONS


def train(ahead: int, stale: tuple[int, ...], steps: int, microbatches: int, size: int, warmup: int,
          val_batches: int, trace: int = 0, seed: int = 0, correction: str = "none", scale: float = 1.0
          ) -> tuple[float, float, list[float]]:
    """(val bits/byte, seconds, training bits/byte averaged over every `trace` steps) after `steps`
    steps with `ahead` microbatches per step stale on the stages `stale`, corrected by
    pipeline.stale_correction `correction` (σ `scale`)."""
    torch.set_num_threads(1)
    train_data, val = reference_data(val_batches)
    trainer = Trainer(reference(stages=2, seed=seed, steps=steps, microbatch=size, microbatches=microbatches,
                                warmup_steps=warmup))
    (s0, s1), loss_fn = trainer.stages, trainer.model.loss_fn
    fixes = [StaleCorrection(correction, scale, opt.params(), opt.optimizer, lambda opt=opt: opt.lr)
             for opt in trainer.opts]
    looks = [Lookahead(s, fix.extrapolate if fix.moves_stash else None) for s, fix in zip((s0, s1), fixes)]
    stream = MicrobatchStream(train_data, 128, size, seed=1000 + seed)
    started = time.perf_counter()
    stashes: list = [None, None]  # each stage's weights before the previous step was applied
    train_losses: list[float] = []
    for step in range(steps):
        for j in range(microbatches):
            x, y = next(stream)
            use = [stashes[k] if k in stale and stashes[k] is not None and j < ahead else None for k in (0, 1)]
            h = looks[0].forward(use[0], x) if use[0] is not None else s0(x)
            h_in = h.detach().requires_grad_(True)
            out = looks[1].forward(use[1], h_in) if use[1] is not None else s1(h_in)
            loss = trainer.opts[1].weighted(loss_fn(out, y), len(x))
            train_losses.append(loss.item())
            if use[1] is not None:
                grads, grad_h = grads_wrt(loss, looks[1].leaves(use[1]), h_in, None)
                grads = fixes[1].compensate(grads, looks[1].leaves(use[1]), trainer.opts[1].weight(len(x)))
                trainer.opts[1].add([grads], [len(x)])
            else:
                loss.backward()
                grad_h = h_in.grad
            if use[0] is not None:
                grads = grads_wrt(h, looks[0].leaves(use[0]), x, grad_h)[0]
                grads = fixes[0].compensate(grads, looks[0].leaves(use[0]), trainer.opts[0].weight(len(x)))
                trainer.opts[0].add([grads], [len(x)])
            else:
                h.backward(grad_h)
        # before this step's update: what the next step's ahead microbatches run against
        stashes = [looks[k].stash(step + 1) if k in stale else None for k in (0, 1)]
        trainer.update(microbatches, microbatches * size)
    per = trace * microbatches
    curve = [bits_per_byte(sum(train_losses[i:i + per]) / per) for i in range(0, len(train_losses) - per + 1, per)] \
        if trace else []
    return trainer.evaluate(val), time.perf_counter() - started, curve


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, quick="smoke run: 20 steps of 2 x 8, 2 validation batches",
                    seed="weights, batches and validation windows (default 0)")
    p.add_argument("--ahead", type=int, nargs="+", default=None,
                   help="microbatches per step that ran ahead (0: exact, the baseline; default 0 2 4, 0 1 2 with --quick)")
    p.add_argument("--stale-stages", default="0,1", help="the stages whose ahead microbatches are stale (default 0,1)")
    p.add_argument("--correction", nargs="+", default=["none"],
                   help="pipeline.stale_correction variants for every ahead > 0, each KIND or KIND:SCALE "
                        f"(KIND of {', '.join(STALE_CORRECTIONS)}; default none)")
    p.add_argument("--scale", type=float, default=1.0, help="pipeline.stale_correction_scale (default 1)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="train every variant once per seed")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--shape", default="4x16", help="microbatches per step x samples per microbatch")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--val-batches", type=int, default=16)
    p.add_argument("--jobs", type=int, default=1, help="variants trained at once, one process and thread each")
    p.add_argument("--trace", type=int, default=0, help="also print the training bits/byte averaged over every N steps")
    args = p.parse_args()
    microbatches, size = (int(v) for v in args.shape.split("x"))
    steps, warmup, val = args.steps, args.warmup, args.val_batches
    if args.quick:
        steps, warmup, microbatches, size, val = 20, 2, 2, 8, 2
    ahead = args.ahead or ([0, 1, 2] if args.quick else [0, 2, 4])
    if any(a < 0 or a > microbatches for a in ahead):
        p.error(f"--ahead: between 0 and {microbatches}")
    stale = tuple(int(k) for k in args.stale_stages.split(","))
    if any(k not in (0, 1) for k in stale):
        p.error("--stale-stages: of 0,1")
    seeds = args.seeds or [seed_or(args, 0)]
    if any(c.split(":")[0] not in STALE_CORRECTIONS for c in args.correction):
        p.error(f"--correction: each of {', '.join(STALE_CORRECTIONS)}, optionally :SCALE")
    variants = [(a, c) for a in ahead for c in (["none"] if a == 0 else args.correction)]
    report = Report("One-step-stale stage gradients (pipeline.lookahead) per sample, and their corrections", args.out)
    report.print(f"{steps} steps of {microbatches} x {size} samples; ahead = microbatches per step whose gradients on "
                 f"stage(s) {args.stale_stages} are one step stale; correction σ = {args.scale}; seeds {seeds}")
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = {(a, c, seed): pool.submit(train, a, stale, steps, microbatches, size, warmup, val, args.trace,
                                             seed, c.split(":")[0], float(c.split(":")[1]) if ":" in c else args.scale)
                   for seed in seeds for a, c in variants}
        done = {f: key for key, f in futures.items()}
        for f in as_completed(done):  # each as it ends: a long run that is cut short still reports some
            a, c, seed = done[f]
            report.print(f"done: {a} ahead, {c}, seed {seed}: val bits/byte {f.result()[0]:.4f} "
                         f"({f.result()[1]:.0f} s)")
        results = {key: f.result() for key, f in futures.items()}
    rows = []
    for a, c in variants:
        bpbs = [results[(a, c, seed)][0] for seed in seeds]
        bases = [results.get((0, "none", seed), (math.nan, 0, []))[0] for seed in seeds]
        vs = [100 * (b - base) / base for b, base in zip(bpbs, bases)]
        rows.append([f"{a} of {microbatches}", "" if a == 0 else c, " / ".join(f"{b:.4f}" for b in bpbs),
                     " / ".join(f"{v:+.2f} %" for v in vs),
                     " / ".join(f"{results[(a, c, seed)][1]:.0f}" for seed in seeds)])
    report.table(["ahead per step", "correction", "val bits/byte (per seed)", "vs exact", "s"], rows)
    for (a, c, seed), (_, _, curve) in results.items():
        if curve:
            report.print(f"training bits/byte every {args.trace} steps, {a} ahead, {c}, seed {seed}: "
                         + " ".join(f"{v:.2f}" for v in curve))
    report.results = {"steps": steps, "microbatches": microbatches, "microbatch_size": size, "stale_stages": stale,
                      "seeds": seeds, "scale": args.scale,
                      "variants": [{"ahead": a, "correction": c, "seed": seed, "val_bpb": bpb, "seconds": sec,
                                    "trace": curve} for (a, c, seed), (bpb, sec, curve) in results.items()]}
    if args.trace:
        report.figure("training.png", lambda fig: plot_traces(fig, results, args.trace, microbatches, stale))
    report.finish()


def plot_traces(fig, results: dict, every: int, microbatches: int, stale: tuple[int, ...]) -> None:  # type: ignore[no-untyped-def]
    ax = fig.subplots()
    for (a, c, seed), (_, _, curve) in results.items():
        ax.plot([every * (i + 1) for i in range(len(curve))], curve,
                label=f"{a} of {microbatches} microbatches ahead" + (" (exact)" if a == 0 else f", {c}")
                + f", seed {seed}")
    ax.set_title(f"Training loss with one-step-stale gradients on stage(s) {','.join(map(str, stale))}")
    ax.set_xlabel("inner step")
    ax.set_ylabel(f"training loss (bits/byte, mean of {every} steps)")
    ax.legend()


if __name__ == "__main__":
    main()
