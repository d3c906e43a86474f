"""Subspace-constrained boundaries (``model.boundary_subspace``) against the unconstrained Llama,
measured by training: one process, no network, at equal samples.

    python -m benchmarks.subspace_boundary [--quick] [--steps N] [--batch B] [--ks 8 16 32]
                                           [--codecs fp16 int8] [--seeds 0 1] [--cache-dir DIR] [--out DIR]

The model is examples/llama-cpu.toml's (d_model 256, 6 layers, 8 heads / 4 key/value, SwiGLU 768,
seq_len 128, byte-level stdlib data; AdamW 1e-3, betas (0.9, 0.95), wd 0.1, clip 1.0) in its two
stages of three layers, with warmup then cosine over the run's steps, trained by the benchmarks'
loop (benchmarks/harness/training.py). Between the stages sits benchmarks/boundary_codecs.py's
``Boundary``: what stage 0 sends goes through the activation codec's encode -> decode and the
gradient stage 1 sends back through the gradient codec's (the same codec both ways here), as in
a swarm. With k > 0 what crosses is z ([B, T, k]) and the receiver builds its input exactly as
a stage server does (``TokenCarry``: z and the ids carried in front of the targets).

Rows: the unconstrained model with fp32 and with each codec on its residual (the reference is
fp32, k = 0, of the same seed), then every k with every codec on z. Columns: val bits/byte at
equal samples (evaluated through the forward codec), the gap against the reference of the same
seed, boundary bytes per trained sample (both directions' ``Encoded.nbytes``, plus the carried
first id), and fp32 residual bytes / these.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.boundary_codecs import Boundary, Link
from benchmarks.harness import REPO
from benchmarks.harness.report import Report, add_common_args
from benchmarks.harness.training import Trainer, reference_data
from swarmgrad.compression import parse_codec_spec
from swarmgrad.peer.data import MicrobatchStream
from swarmgrad.peer.manifest import Manifest, load

PRESET = REPO / "examples" / "llama-cpu.toml"


@dataclass
class Result:
    k: int
    codec: str
    seed: int
    val_bpb: float
    bytes_per_sample: float
    fwd_err: float
    bwd_err: float
    seconds: float


def manifest(k: int, seed: int, steps: int, batch: int, warmup: int) -> Manifest:
    m = load(PRESET).replace(seed=seed, model={"boundary_subspace": k},
                             inner={"microbatch_size": batch, "microbatches_per_step": 1})
    return m.replace(schedule={"warmup_samples": warmup * batch, "total_samples": steps * batch})


class SubspaceTrainer(Trainer):
    """The preset's two stages with `link`'s codecs on what crosses between them."""

    def __init__(self, m: Manifest, link: Link):
        super().__init__(m)
        self.link = link
        self.carry = self.model.token_carry

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.carry is None:
            return self.model.loss_fn(self.stages[1](Boundary.apply(self.stages[0](x), self.link)), y)
        sent = self.carry.wire_targets(x, y)
        z = Boundary.apply(self.stages[0](x), self.link)
        # the receiver's input is [z, ids]; the ids channel gets no gradient, so z's is what crosses back
        return self.model.loss_fn(self.stages[1](self.carry.stage_input(z, sent)), sent)


def train(k: int, codec: str, seed: int, args: argparse.Namespace, data: tuple) -> Result:
    m = manifest(k, seed, args.steps, args.batch, args.warmup)
    link = Link(parse_codec_spec(codec), parse_codec_spec(codec))
    trainer = SubspaceTrainer(m, link)
    train_corpus, val = data
    stream = MicrobatchStream(train_corpus, m.model.seq_len, args.batch, seed=1000 + seed)
    started = time.perf_counter()
    for _ in range(args.steps):
        trainer.step([next(stream)])
    link.counting = False
    val_bpb = trainer.evaluate(val)
    samples = args.steps * args.batch
    f, b = link.fwd_stats, link.bwd_stats
    carried = 1 if k else 0  # the first id of each sequence, in front of its targets (one byte: vocab 256)
    return Result(k, codec, seed, val_bpb, (f.nbytes + b.nbytes) / samples + carried,
                  f.mean(f.rel_err), b.mean(b.rel_err), time.perf_counter() - started)


def cached(k: int, codec: str, seed: int, args: argparse.Namespace, data: tuple) -> Result:
    if not args.cache_dir:
        return train(k, codec, seed, args, data)
    key = json.dumps([k, codec, seed, args.steps, args.batch, args.warmup, args.val_batches, "subspace-v1"])
    path = Path(args.cache_dir) / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")
    if path.exists():
        return Result(**json.loads(path.read_text())["result"])
    result = train(k, codec, seed, args, data)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, "result": dataclasses.asdict(result)}))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, quick="smoke run: 6 steps of 4, k 8, int8 (< 30 s)",
                    seed="one seed (default: --seeds)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--ks", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--codecs", nargs="+", default=["fp16", "int8"], help="codec specs, used both ways")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--unconstrained-codecs", action="store_true",
                        help="also train k = 0 with each codec (the reference is k = 0 with fp32)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache-dir", default="")
    args = parser.parse_args()
    seeds = [args.seed] if args.seed is not None else args.seeds
    torch.set_num_threads(args.threads)
    if args.quick:
        args.steps, args.batch, args.warmup, args.val_batches, args.ks, args.codecs = 6, 4, 1, 1, [8], ["int8"]
    train_corpus, val = reference_data(args.val_batches, max_bytes=20_000_000 if args.quick else None)
    data = (train_corpus, val)
    rows = [(0, "fp32")] + ([(0, c) for c in args.codecs] if args.unconstrained_codecs else []) \
        + [(k, c) for k in args.ks for c in args.codecs]
    report = Report("Subspace-constrained boundaries (llama-cpu), trained side by side", args.out)
    report.print(f"# {args.steps} steps x batch {args.batch} (seq 128), warmup {args.warmup} + cosine, "
                 f"val {args.val_batches}x32 sequences; seeds {seeds}")
    results: list[Result] = []
    for seed in seeds:
        for k, codec in rows:
            results.append(cached(k, codec, seed, args, data))
            r = results[-1]
            print(f"#   k={k} {codec} (seed {seed}): {r.val_bpb:.4f} bits/byte ({r.seconds:.0f} s)", flush=True)
    d_model = load(PRESET).model.d_model
    fp32_bytes = 2 * 4 * 128 * d_model

    def gap(r: Result) -> float:
        ref = next((x.val_bpb for x in results if x.k == 0 and x.codec == "fp32" and x.seed == r.seed), math.nan)
        return 100 * (r.val_bpb - ref) / ref

    report.table(["k", "codec (both ways)", "seed", "val bits/byte", "gap vs fp32 k=0", "bytes/sample",
                  "fp32 bytes / these", "fwd rel err", "bwd rel err", "s"],
                 [[r.k or "off", r.codec, r.seed, f"{r.val_bpb:.4f}", f"{gap(r):+.2f}%",
                   f"{r.bytes_per_sample:,.0f}", f"{fp32_bytes / r.bytes_per_sample:.1f}x", f"{r.fwd_err:.4f}",
                   f"{r.bwd_err:.4f}", f"{r.seconds:.0f}"] for r in results])
    if len(seeds) > 1:
        summary = []
        for k, codec in rows[1:]:
            gaps = [gap(r) for r in results if (r.k, r.codec) == (k, codec)]
            b = next(r.bytes_per_sample for r in results if (r.k, r.codec) == (k, codec))
            summary.append([k or "off", codec, len(gaps), f"{sum(gaps) / len(gaps):+.2f}%", f"{min(gaps):+.2f}%",
                            f"{max(gaps):+.2f}%", f"{fp32_bytes / b:.1f}x"])
        report.print()
        report.table(["k", "codec", "seeds", "mean gap", "min", "max", "fp32 bytes / these"], summary)
    report.results = {"settings": {k: v for k, v in vars(args).items() if k != "out"},
                      "results": [dataclasses.asdict(r) | {"gap_pct": gap(r)} for r in results]}
    report.finish()


if __name__ == "__main__":
    main()
