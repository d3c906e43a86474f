"""Pipeline-boundary codecs, measured by training: one process, no network, one CPU thread.

    python -m benchmarks.boundary_codecs [--quick] [--steps N] [--batch B] [--pairs FWD/BWD ...]
                                         [--seed N] [--out DIR]

The reference task of the swarm benchmarks (byte-level GPT, d_model 128, 4 layers, 4 heads,
seq_len 128, two stages of two layers; the Python stdlib's .py files; AdamW lr 2e-3, betas
(0.9, 0.95), wd 0.1, grad_clip 1.0 per stage; the manifest's schedule over the run's samples),
trained by the benchmarks' loop (benchmarks/harness/training.py: the workers' inner optimiser)
with a :class:`Boundary` between the stages: the activation that stage 0 sends goes through ``fwd.encode`` -> ``decode`` and the
gradient that stage 1 sends back through ``bwd.encode`` -> ``decode``, exactly the two hops a
swarm makes, and nothing else differs. Every pair starts from the same weights and sees the
same batches, so the val bits/byte column differs only by what the codecs did (plus chaotic
divergence of training: any perturbation, even fp16's, moves the result by ~0.2%;
``--noise-seeds N`` adds fp32 rows with other seeds for the seed-to-seed spread; ``--seeds 0 1 2``
(``--seed N``: one seed, N)
trains every pair with each seed, weights, batches and rounding alike, and compares each run with
the fp32/fp32 run of its own seed, so a gap near a threshold can be told from that spread).

A full run takes ~3 min per pair on one idle core (300 steps of 32); ``--cache-dir`` keeps
each pair's result, so a table can be assembled from runs made at different times.

Columns: codec fwd / codec bwd; val bits/byte at equal samples (evaluated through the forward
codec, as a swarm evaluates); gap vs the fp32/fp32 row in %; boundary bytes per trained sample
(payload of both directions, ``Encoded.nbytes``); fp32 bytes / these bytes; mean relative L2
error and cosine of each hop over training (``bwd cos`` is the cosine of the decoded gradient
with the exact one).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.harness.report import Report, add_common_args
from benchmarks.harness.training import Trainer, reference, reference_data
from swarmgrad.compression import Codec, decode, parse_codec_spec
from swarmgrad.peer.data import MicrobatchStream
from swarmgrad.peer.manifest import Manifest

#: the pairs of the full run: the int8 diagnosis, then the codecs made for the boundary
DEFAULT_PAIRS = [
    "fp32/fp32", "fp16/fp16", "int8/fp32", "fp32/int8", "int8/int8",
    "int8:stochastic=true/int8:stochastic=true",
    "lowrank:rank=32/fp32", "fp32/hadamard:bits=4,stochastic=true",
    "lowrank:rank=32/hadamard:bits=4,stochastic=true", "lowrank:rank=16/hadamard:bits=4,stochastic=true",
    "lowrank:rank=32/hadamard:bits=2,stochastic=true", "lowrank:rank=16/hadamard:bits=2,stochastic=true",
]
QUICK_PAIRS = ["fp32/fp32", "int8/int8", "lowrank:rank=32/hadamard:bits=4,stochastic=true"]


@dataclass
class HopStats:
    """What one direction of the boundary sent and how far its decode was from the exact tensor."""
    nbytes: int = 0
    rel_err: list[float] = field(default_factory=list)
    cosine: list[float] = field(default_factory=list)

    def observe(self, exact: torch.Tensor, sent: torch.Tensor, nbytes: int) -> None:
        self.nbytes += nbytes
        e, s = exact.double().flatten(), sent.double().flatten()
        norm = float(e.norm())
        if norm > 0:
            self.rel_err.append(float((s - e).norm()) / norm)
            self.cosine.append(float(e @ s) / (norm * max(float(s.norm()), 1e-300)))

    def mean(self, values: list[float]) -> float:
        return sum(values) / len(values) if values else math.nan


class Link:
    """The two codecs of one boundary, with byte and error accounting per direction."""

    def __init__(self, fwd: Codec, bwd: Codec) -> None:
        self.fwd, self.bwd = fwd, bwd
        self.fwd_stats, self.bwd_stats = HopStats(), HopStats()
        self.counting = True

    def send(self, codec: Codec, x: torch.Tensor, stats: HopStats) -> torch.Tensor:
        enc = codec.encode(x)
        out = decode(enc).to(x.dtype).view_as(x)
        if self.counting:
            stats.observe(x, out, enc.nbytes)
        return out


class Boundary(torch.autograd.Function):
    """Identity in the graph; codec round trip of the activation (forward) and of its gradient (backward)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, link: Link) -> torch.Tensor:  # type: ignore[override]
        ctx.link = link
        return link.send(link.fwd, h.detach(), link.fwd_stats)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return ctx.link.send(ctx.link.bwd, grad.contiguous(), ctx.link.bwd_stats), None


@dataclass
class Result:
    fwd: str
    bwd: str
    seed: int
    val_bpb: float
    bytes_per_sample: float
    fwd_err: float
    bwd_err: float
    bwd_cos: float
    seconds: float


class BoundaryTrainer(Trainer):
    """The reference model with `link`'s codecs on the boundary between its two stages."""

    def __init__(self, manifest: Manifest, link: Link):
        super().__init__(manifest)
        self.link = link

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages[1](Boundary.apply(self.stages[0](x), self.link))


def train_pair(pair: str, args: argparse.Namespace, data: tuple, seed: int = 0) -> Result:
    """Train the reference model from scratch with ``pair`` ("FWD/BWD" specs) on the boundary."""
    fwd_spec, bwd_spec = pair.split("/")
    manifest = reference(stages=2, seed=seed, steps=args.steps, microbatch=args.batch, warmup_steps=args.warmup,
                         constant_lr=args.constant_lr)
    link = Link(parse_codec_spec(fwd_spec), parse_codec_spec(bwd_spec))
    trainer = BoundaryTrainer(manifest, link)  # seeds the global generator: stochastic rounding draws from it
    train, val = data
    stream = MicrobatchStream(train, 128, args.batch, seed=1000 + seed)
    started = time.perf_counter()
    for _ in range(args.steps):
        trainer.step([next(stream)])
    link.counting = False
    val_bpb = trainer.evaluate(val)  # through the forward codec, as a swarm evaluates
    samples = args.steps * args.batch
    f, b = link.fwd_stats, link.bwd_stats
    return Result(fwd_spec, bwd_spec, seed, val_bpb,
                  (f.nbytes + b.nbytes) / samples, f.mean(f.rel_err), b.mean(b.rel_err), b.mean(b.cosine),
                  time.perf_counter() - started)


def cached_train_pair(pair: str, args: argparse.Namespace, data: tuple, seed: int = 0) -> Result:
    """:func:`train_pair`, reusing a result stored under ``--cache-dir`` for the same settings."""
    if not args.cache_dir:
        return train_pair(pair, args, data, seed)
    # "inner-optimizer": the loop that made the result (benchmarks/harness/training.py); a result
    # cached by another loop (its own clipping and schedule) is not reused
    key = json.dumps([pair, seed, args.steps, args.batch, args.warmup, args.val_batches, "inner-optimizer"]
                     + (["constant"] if args.constant_lr else []))
    path = Path(args.cache_dir) / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")
    if path.exists():
        return Result(**json.loads(path.read_text())["result"])
    result = train_pair(pair, args, data, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, "result": dataclasses.asdict(result)}))
    return result


def fp32_of(results: list[Result], seed: int) -> float:
    return next((r.val_bpb for r in results if r.fwd == "fp32" and r.bwd == "fp32" and r.seed == seed), math.nan)


def gap_pct(r: Result, results: list[Result]) -> float:
    """`r`'s val bits/byte against the fp32/fp32 run of the same seed (the noise-seed rows: seed 0's)."""
    base = fp32_of(results, r.seed)
    if r.fwd == "fp32" and r.bwd == "fp32":
        base = fp32_of(results, 0)
    return 100 * (r.val_bpb - base) / base


def table(report: Report, results: list[Result], fp32_bytes: float) -> None:
    rows = [[r.fwd, r.bwd, r.seed, f"{r.val_bpb:.4f}", f"{gap_pct(r, results):+.2f}%", f"{r.bytes_per_sample:,.0f}",
             f"{fp32_bytes / r.bytes_per_sample:.1f}x", f"{r.fwd_err:.4f}", f"{r.bwd_err:.4f}", f"{r.bwd_cos:.5f}",
             f"{r.seconds:.0f}"] for r in results]
    report.table(["codec fwd", "codec bwd", "seed", "val bits/byte", "gap vs fp32", "bytes/sample", "ratio vs fp32",
                  "fwd rel err", "bwd rel err", "bwd cos", "s"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, quick="smoke run: 30 steps of 8, 3 pairs (< 60 s)",
                    seed="train every pair with this one seed (weights, batches, rounding; default 0)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--constant-lr", action="store_true", help="lr 2e-3 throughout (the tiny-gpt demo's setting)")
    parser.add_argument("--val-batches", type=int, default=16)
    parser.add_argument("--pairs", nargs="+", default=None, help='"FWD/BWD" codec spec pairs')
    parser.add_argument("--noise-seeds", type=int, default=0, help="extra fp32/fp32 runs with other seeds")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="train every pair with each of these seeds (fp32/fp32 too, for the paired gaps)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache-dir", default="", help="reuse results of runs with the same settings from here")
    args = parser.parse_args()
    if args.seeds is not None and args.seed is not None:
        parser.error("--seed and --seeds: give one or the other")
    seeds = args.seeds or [args.seed or 0]
    torch.set_num_threads(args.threads)
    if args.quick:
        args.steps, args.batch, args.warmup, args.val_batches, args.noise_seeds = 30, 8, 5, 4, 0
    pairs = args.pairs or (QUICK_PAIRS if args.quick else DEFAULT_PAIRS)
    train, val = reference_data(args.val_batches, max_bytes=20_000_000 if args.quick else None)
    data = (train, val)
    report = Report("Pipeline-boundary codecs, trained side by side", args.out)
    schedule = "constant lr" if args.constant_lr else f"warmup {args.warmup} + cosine"
    report.print(f"# {args.steps} steps x batch {args.batch} (seq 128), {schedule}, "
                 f"val {args.val_batches}x32 sequences; train corpus {len(train):,} bytes")
    if seeds != [0]:
        pairs = list(dict.fromkeys(["fp32/fp32", *pairs]))
    results = []
    for seed in seeds:
        for pair in pairs:
            results.append(cached_train_pair(pair, args, data, seed=seed))
            print(f"#   {pair} (seed {seed}): {results[-1].val_bpb:.4f} bits/byte ({results[-1].seconds:.0f} s)", flush=True)
    for seed in range(1, args.noise_seeds + 1):
        if seed not in seeds:
            results.append(cached_train_pair("fp32/fp32", args, data, seed=seed))
    table(report, results, fp32_bytes=2 * 4 * 128 * 128)
    summary = []
    if len(seeds) > 1:
        for pair in pairs[1:]:
            gaps = [gap_pct(r, results) for r in results if f"{r.fwd}/{r.bwd}" == pair and r.seed in seeds]
            summary.append([pair.split('/')[0], pair.split('/')[1], len(gaps), f"{sum(gaps) / len(gaps):+.2f}%",
                            f"{min(gaps):+.2f}%", f"{max(gaps):+.2f}%"])
        report.print()
        report.table(["codec fwd", "codec bwd", "seeds", "mean gap vs fp32 of the same seed", "min", "max"], summary)
    report.results = {"settings": {k: v for k, v in vars(args).items() if k != "out"},
                      "results": [dataclasses.asdict(r) | {"gap_pct": gap_pct(r, results)} for r in results]}
    report.finish()


if __name__ == "__main__":
    main()
