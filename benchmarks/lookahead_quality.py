"""What one-step-stale stage-0 gradients (pipeline.lookahead) cost per sample: one process, no
network, one CPU thread.

    python benchmarks/lookahead_quality.py [--ahead 0 2 4] [--stale-stages 0,1] [--steps 500] [--quick]

The reference task (byte-level GPT, d_model 128, 4 layers, 4 heads, seq_len 128, two stages of two
layers; the Python stdlib's .py files; AdamW lr 2e-3, betas (0.9, 0.95), wd 0.1, clip 1.0 per stage;
50 warmup steps then cosine to 10 %; 500 steps of 4 microbatches of 16 = 32,000 samples), trained as
the 2-stage pipeline trains it with one replica per stage, without rounds. With `--ahead A`, the
first A microbatches of every step after the first ran ahead: each stage of `--stale-stages`
computed them against the stash peer/compute/lookahead.py keeps (its weights before the previous step was
applied), exactly as a replica with lookahead does, so their gradients there are one step stale.
A = 4 is the bound (in a swarm the last step of each round never runs ahead at the driver, and a
driver's `pipeline` events report the share that did: `ahead_share`). Every variant starts from the same weights and
sees the same batches; val bits/byte on 16 × 32 held-out windows (benchmarks/boundary_codecs.py's
evaluation).
"""
from __future__ import annotations

import argparse
import math
import time
from concurrent.futures import ProcessPoolExecutor

import torch

from swarmgrad.peer.data import MicrobatchStream, bits_per_byte, load_corpora, validation_batches
from swarmgrad.peer.compute.lookahead import Lookahead, grads_wrt
from swarmgrad.peer.manifest import from_dict
from swarmgrad.peer.model import from_manifest

REFERENCE = {"run_id": "lookahead-quality", "seed": 0,
             "model": {"d_model": 128, "n_layers": 4, "n_heads": 4, "seq_len": 128}, "stages": {"count": 2}}


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(ahead: int, stale: tuple[int, ...], steps: int, microbatches: int, size: int, warmup: int,
          val_batches: int, trace: int = 0) -> tuple[float, float, list[float]]:
    """(val bits/byte, seconds, training bits/byte averaged over every `trace` steps) after `steps`
    steps with `ahead` microbatches per step stale on the stages `stale`."""
    torch.set_num_threads(1)
    train_data, val_data = load_corpora("stdlib")
    val = validation_batches(val_data, 128, 32, val_batches, seed=0)
    torch.manual_seed(0)
    staged = from_manifest(from_dict(REFERENCE))
    s0, s1 = staged.build_stage(0), staged.build_stage(1)
    opts = [torch.optim.AdamW(s.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1) for s in (s0, s1)]
    looks = [Lookahead(s0), Lookahead(s1)]
    stream = MicrobatchStream(train_data, 128, size, seed=1000)
    started = time.perf_counter()
    stashes: list = [None, None]  # each stage's weights before the previous step was applied
    train_losses: list[float] = []
    for step in range(steps):
        for opt in opts:
            for group in opt.param_groups:
                group["lr"] = lr_at(step, steps, 2e-3, warmup)
        for j in range(microbatches):
            x, y = next(stream)
            use = [stashes[k] if k in stale and stashes[k] is not None and j < ahead else None for k in (0, 1)]
            h = looks[0].forward(use[0], x) if use[0] is not None else s0(x)
            h_in = h.detach().requires_grad_(True)
            out = looks[1].forward(use[1], h_in) if use[1] is not None else s1(h_in)
            loss = staged.loss_fn(out, y) / microbatches
            train_losses.append(loss.item() * microbatches)
            if use[1] is not None:
                grads, grad_h = grads_wrt(loss, looks[1].leaves(use[1]), h_in, None)
                add(s1, grads)
            else:
                loss.backward()
                grad_h = h_in.grad
            if use[0] is not None:
                add(s0, grads_wrt(h, looks[0].leaves(use[0]), x, grad_h)[0])
            else:
                h.backward(grad_h)
        # before this step's update: what the next step's ahead microbatches run against
        stashes = [looks[k].stash(step + 1) if k in stale else None for k in (0, 1)]
        for s, opt in zip((s0, s1), opts):
            torch.nn.utils.clip_grad_norm_(s.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        losses = [float(staged.loss_fn(s1(s0(x)), y)) for x, y in val]
    per = trace * microbatches
    curve = [bits_per_byte(sum(train_losses[i:i + per]) / per) for i in range(0, len(train_losses) - per + 1, per)] \
        if trace else []
    return bits_per_byte(sum(losses) / len(losses)), time.perf_counter() - started, curve


def add(module: torch.nn.Module, grads: list) -> None:
    for p, g in zip(module.parameters(), grads):
        if g is not None:
            p.grad = g.clone() if p.grad is None else p.grad.add_(g)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ahead", type=int, nargs="+", default=[0, 2, 4],
                   help="microbatches per step that ran ahead (0: exact, the baseline)")
    p.add_argument("--stale-stages", default="0,1", help="the stages whose ahead microbatches are stale (default 0,1)")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--shape", default="4x16", help="microbatches per step x samples per microbatch")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--val-batches", type=int, default=16)
    p.add_argument("--jobs", type=int, default=1, help="variants trained at once, one process and thread each")
    p.add_argument("--trace", type=int, default=0, help="also print the training bits/byte averaged over every N steps")
    p.add_argument("--quick", action="store_true", help="smoke run: 20 steps of 2 x 8, 2 validation batches")
    args = p.parse_args()
    microbatches, size = (int(v) for v in args.shape.split("x"))
    steps, warmup, val = args.steps, args.warmup, args.val_batches
    if args.quick:
        steps, warmup, microbatches, size, val = 20, 2, 2, 8, 2
    if any(a < 0 or a > microbatches for a in args.ahead):
        p.error(f"--ahead: between 0 and {microbatches}")
    stale = tuple(int(k) for k in args.stale_stages.split(","))
    if any(k not in (0, 1) for k in stale):
        p.error("--stale-stages: of 0,1")
    print(f"{steps} steps of {microbatches} x {size} samples; ahead = microbatches per step whose gradients on "
          f"stage(s) {args.stale_stages} are one step stale", flush=True)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = {a: pool.submit(train, a, stale, steps, microbatches, size, warmup, val, args.trace)
                   for a in args.ahead}
        results = {a: f.result() for a, f in futures.items()}
    base = results.get(0, (math.nan, 0, []))[0]
    print("| ahead per step | stale share | val bits/byte | vs exact | s |")
    print("| --- | --- | --- | --- | --- |")
    for a, (bpb, seconds, _) in results.items():
        print(f"| {a} of {microbatches} | {a / microbatches:.2f} | {bpb:.4f} | {100 * (bpb - base) / base:+.2f} % "
              f"| {seconds:.0f} |")
    for a, (_, _, curve) in results.items():
        if curve:
            print(f"training bits/byte every {args.trace} steps, {a} ahead: " + " ".join(f"{v:.2f}" for v in curve))


if __name__ == "__main__":
    main()
