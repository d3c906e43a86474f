"""Pseudo-gradient codecs in one process: DiLoCo rounds of R replicas of the whole model, each
variant trained on the same samples, to find out *why* a codec loses quality and by how much.

    python -m benchmarks.sparse_rounds [--manifest examples/reference.toml] [--rounds N]
        [--inner-steps H] [--variants NAME,...] [--list] [--quick] [--seed N] [--out DIR]

No network: the replicas take turns in this process, so a variant costs only its compute and
rounds are exact (every replica trains exactly H steps). Each replica is the benchmarks' training
loop (benchmarks/harness/training.py: the worker's inner optimiser, the manifest's schedule at
the swarm's position); the averaging path is the swarm's own
code: each replica encodes Δ with the manifest codec (small tensors fp32, `SizeAdaptive`) and
its `ErrorFeedback`, the contributions are decoded and reduced with `peer.aggregate.reduce_part`,
and then either

- ``reduce``: re-encoded with `compression.reduce_codec` and decoded, as a reducer of the
  reduce-scatter does (peer/averaging/averager.py), or
- ``gather``: used as is, as when every member receives every contribution and reduces locally;

θ_global takes the outer step of `peer.state.StageState`. Bytes are the codec payloads each
member would send in that exchange (reduce: its contribution's parts to the other reducers and
its part of the mean to the other members, by `peer.averaging_group.partition`; gather: its whole
contribution to each other member), without framing, so they compare variants with each other;
benchmarks/round_codecs.py measures the real swarm's bytes.

Columns: val bits/byte after the last round (the drivers' evaluation set), payload bytes per
sample, DDP / that (DDP's fp32 all-reduce of every step: 8·P bytes per step's samples), and the
gap to the first variant.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import time
from pathlib import Path

import torch

from benchmarks.harness.report import Report, add_common_args, fmt
from benchmarks.harness.training import REFERENCE, Trainer
from swarmgrad.compression import ErrorFeedback, SizeAdaptive, decode, parse_codec_spec, reduce_codec
from swarmgrad.peer.rounds import overlap
from swarmgrad.peer.averaging.aggregate import reduce_part
from swarmgrad.peer.averaging.group import partition
from swarmgrad.peer.data import MicrobatchStream, load_corpora, validation_batches
from swarmgrad.peer.manifest import Manifest, load
from swarmgrad.peer.compute.schedule import TrainingProgress, lr_multiplier
from swarmgrad.peer.state.stage_state import StageState


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    codec: str
    error_feedback: bool = True
    exchange: str = "reduce"
    """reduce (the reducer re-encodes the mean with reduce_codec), reduce-ef (the reducer re-encodes
    it with the members' own codec and keeps error feedback of its own) or gather (no re-encode)."""
    feedback_decay: float = 1.0
    """β of SparseLoCo's accumulator: e ← β·e + Δ before the encode (1: plain error feedback)."""
    outer_lr: float | None = None
    outer_momentum: float | None = None
    mean_codec: str | None = None
    """reduce-ef: the reducer's codec for the mean (default: the members' codec)."""
    small: str = "fp32"
    """The codec of tensors below averaging.small_tensor_threshold."""
    swarm_moment: bool = False
    """inner.swarm_second_moment: SwarmAdamW, each step's batch as two microbatches of half the size."""
    overlap: str = ""
    """Overlapped rounds: "" plain rounds; "delayed" as the swarm runs rounds.overlap
    (peer/rounds/overlap.py: each replica resumes from its own θ_local while the mean travels); "eager"
    it resumes from `eager_start` instead (measured here only, not in the daemon: it lost more
    than it saved, docs/measurements.md). The mean lands after `lands_after` inner steps of the
    next round, and θ_local is moved onto θ_global_new + its progress there (the worker's rebase)."""
    lands_after: int = 1


VARIANTS = {v.name: v for v in [
    Variant("fp32", "fp32", error_feedback=False),
    Variant("int8+ef", "int8"),
    Variant("topk1%+ef", "topk:fraction=0.01,values=fp16"),
    Variant("topk1%+ef/gather", "topk:fraction=0.01,values=fp16", exchange="gather"),
    Variant("ctk64b2+ef", "chunktopk:chunk=4096,k=64,bits=2"),
    Variant("ctk64b2+ef/gather", "chunktopk:chunk=4096,k=64,bits=2", exchange="gather"),
    Variant("ctk64b16+ef/gather", "chunktopk:chunk=4096,k=64,bits=16", exchange="gather"),
    Variant("ctk64b2+ef/gather/sgd1", "chunktopk:chunk=4096,k=64,bits=2", exchange="gather",
            outer_lr=1.0, outer_momentum=0.0),
    Variant("ctk64b2+ef.95/gather/sgd1", "chunktopk:chunk=4096,k=64,bits=2", exchange="gather",
            feedback_decay=0.95, outer_lr=1.0, outer_momentum=0.0),
    Variant("ctk64b2+ef/reduce-ef", "chunktopk:chunk=4096,k=64,bits=2", exchange="reduce-ef"),
    Variant("ctk128b2+ef/reduce-ef", "chunktopk:chunk=4096,k=128,bits=2", exchange="reduce-ef"),
    Variant("ctk256b2+ef.95/gather/sgd1", "chunktopk:chunk=4096,k=256,bits=2", exchange="gather",
            feedback_decay=0.95, outer_lr=1.0, outer_momentum=0.0),
    Variant("ctk256b2+ef/gather", "chunktopk:chunk=4096,k=256,bits=2", exchange="gather"),
    Variant("ctk512b2+ef/gather", "chunktopk:chunk=4096,k=512,bits=2", exchange="gather"),
    Variant("ctk1024b2+ef/gather", "chunktopk:chunk=4096,k=1024,bits=2", exchange="gather"),
    Variant("ctk4096b1+ef/gather", "chunktopk:chunk=4096,k=4096,bits=1", exchange="gather"),
    Variant("ctk4096b1+ef/reduce-ef", "chunktopk:chunk=4096,k=4096,bits=1", exchange="reduce-ef"),
    Variant("ctk2048b1+ef/gather", "chunktopk:chunk=4096,k=2048,bits=1", exchange="gather"),
    Variant("ctk1024b2+ef/reduce-ef", "chunktopk:chunk=4096,k=1024,bits=2", exchange="reduce-ef"),
    Variant("ctk128b1+ef/gather", "chunktopk:chunk=128,k=128,bits=1", exchange="gather"),
    Variant("ctk128b1+ef/reduce-ef", "chunktopk:chunk=128,k=128,bits=1", exchange="reduce-ef"),
    Variant("fp32/sgd1", "fp32", error_feedback=False, outer_lr=1.0, outer_momentum=0.0),
    Variant("fp32/sgd1/swarm-moment", "fp32", error_feedback=False, outer_lr=1.0, outer_momentum=0.0,
            swarm_moment=True),
    Variant("ctk256x256b3+ef.95/gather/all/sgd1/swarm-moment", "chunktopk:chunk=256,k=256,bits=3",
            exchange="gather", small="chunktopk:chunk=256,k=256,bits=3", feedback_decay=0.95, outer_lr=1.0,
            outer_momentum=0.0, swarm_moment=True),
    # the outer step of plain averaging, stretched: does the data-parallel gap to DDP shrink?
    Variant("fp32/sgd1.4", "fp32", error_feedback=False, outer_lr=1.4, outer_momentum=0.0),
    Variant("fp32/nag1/m0.5", "fp32", error_feedback=False, outer_lr=1.0, outer_momentum=0.5),
    Variant("int8+ef/sgd1", "int8", outer_lr=1.0, outer_momentum=0.0),
    # SwarmAdamW at few steps per round: where the drift within a round is small
    Variant("int8+ef/sgd1/swarm-moment", "int8", outer_lr=1.0, outer_momentum=0.0, swarm_moment=True),
    Variant("fp32/nag1/m0.5/swarm-moment", "fp32", error_feedback=False, outer_lr=1.0, outer_momentum=0.5,
            swarm_moment=True),
    # averaging overlapped with the next round's compute (rounds.overlap), and an eager start
    Variant("int4+ef/gather/sgd1/swarm-moment/overlap", "int4", exchange="gather", outer_lr=1.0,
            outer_momentum=0.0, swarm_moment=True, overlap="delayed"),
    Variant("int4+ef/gather/sgd1/swarm-moment/eager", "int4", exchange="gather", outer_lr=1.0,
            outer_momentum=0.0, swarm_moment=True, overlap="eager"),
    Variant("int8+ef/sgd1/overlap", "int8", outer_lr=1.0, outer_momentum=0.0, overlap="delayed"),
    Variant("int8+ef/sgd1/eager", "int8", outer_lr=1.0, outer_momentum=0.0, overlap="eager"),
    # the 2-bit pair of examples/reference-h3-2bit-swarm.toml, plain and overlapped (rounds.overlap_steps
    # bounds how late the mean lands: --lands-after)
    Variant("ctk256x256b2+ef/gather/sgd1/swarm-moment", "chunktopk:chunk=256,k=256,bits=2", exchange="gather",
            outer_lr=1.0, outer_momentum=0.0, swarm_moment=True),
    Variant("ctk256x256b2+ef/gather/sgd1/swarm-moment/overlap", "chunktopk:chunk=256,k=256,bits=2",
            exchange="gather", outer_lr=1.0, outer_momentum=0.0, swarm_moment=True, overlap="delayed"),
    # fewer averaging bytes at few steps per round, where the round's exchange is what costs time
    Variant("int4+ef/gather/sgd1/swarm-moment", "int4", exchange="gather", outer_lr=1.0, outer_momentum=0.0,
            swarm_moment=True),
    Variant("ctk256x256b3+ef/gather/all/sgd1/swarm-moment", "chunktopk:chunk=256,k=256,bits=3",
            exchange="gather", small="chunktopk:chunk=256,k=256,bits=3", outer_lr=1.0, outer_momentum=0.0,
            swarm_moment=True),
    Variant("ctk4096b1+ef/reduce-ef:ctk2048b1", "chunktopk:chunk=4096,k=4096,bits=1", exchange="reduce-ef",
            mean_codec="chunktopk:chunk=4096,k=2048,bits=1"),
    Variant("ctk2048b1+ef/reduce-ef", "chunktopk:chunk=4096,k=2048,bits=1", exchange="reduce-ef"),
    Variant("ctk4096b1+ef/gather/sgd1", "chunktopk:chunk=4096,k=4096,bits=1", exchange="gather",
            outer_lr=1.0, outer_momentum=0.0),
    Variant("ctk4096b1+ef.95/gather/sgd1", "chunktopk:chunk=4096,k=4096,bits=1", exchange="gather",
            feedback_decay=0.95, outer_lr=1.0, outer_momentum=0.0),
    Variant("ctk2048b1+ef.95/gather/sgd1", "chunktopk:chunk=4096,k=2048,bits=1", exchange="gather",
            feedback_decay=0.95, outer_lr=1.0, outer_momentum=0.0),
    Variant("ctk2048b1+ef/gather/int8s", "chunktopk:chunk=4096,k=2048,bits=1", exchange="gather", small="int8"),
    Variant("ctk2048b1+ef/gather/all", "chunktopk:chunk=4096,k=2048,bits=1", exchange="gather",
            small="chunktopk:chunk=4096,k=2048,bits=1"),
    Variant("ctk1638b1+ef.95/gather/all/sgd1", "chunktopk:chunk=4096,k=1638,bits=1", exchange="gather",
            small="chunktopk:chunk=4096,k=1638,bits=1", feedback_decay=0.95, outer_lr=1.0, outer_momentum=0.0),
    Variant("ctk1638b1+ef/gather/all", "chunktopk:chunk=4096,k=1638,bits=1", exchange="gather",
            small="chunktopk:chunk=4096,k=1638,bits=1"),
    # dense signs with a scale per 256 values (1.125 bits) and 25 % at 2 bits (1.5 bits): the two
    # other ways to spend SparseLoCo's ~1.5 bits per value at H = 50
    Variant("ctk256x256b1+ef.95/gather/all/sgd1", "chunktopk:chunk=256,k=256,bits=1", exchange="gather",
            small="chunktopk:chunk=256,k=256,bits=1", feedback_decay=0.95, outer_lr=1.0, outer_momentum=0.0),
    Variant("ctk1024b2+ef.95/gather/all/sgd1", "chunktopk:chunk=4096,k=1024,bits=2", exchange="gather",
            small="chunktopk:chunk=4096,k=1024,bits=2", feedback_decay=0.95, outer_lr=1.0, outer_momentum=0.0),
    Variant("ctk256x256b1+ef/gather/all", "chunktopk:chunk=256,k=256,bits=1", exchange="gather",
            small="chunktopk:chunk=256,k=256,bits=1"),
    # 2 bits per value (2.125 with the scales): the budget at H = 100
    Variant("ctk256x256b2+ef/gather/all", "chunktopk:chunk=256,k=256,bits=2", exchange="gather",
            small="chunktopk:chunk=256,k=256,bits=2"),
    Variant("ctk256x256b2+ef.95/gather/all/sgd1", "chunktopk:chunk=256,k=256,bits=2", exchange="gather",
            small="chunktopk:chunk=256,k=256,bits=2", feedback_decay=0.95, outer_lr=1.0, outer_momentum=0.0),
    # 3 bits per value (3.125 with the scales): 2,048x below DDP at H = 100, the goal's budget
    Variant("ctk256x256b3+ef.95/gather/all/sgd1", "chunktopk:chunk=256,k=256,bits=3", exchange="gather",
            small="chunktopk:chunk=256,k=256,bits=3", feedback_decay=0.95, outer_lr=1.0, outer_momentum=0.0),
]}


def payload(enc) -> int:
    return sum(len(b) for b in enc.buffers)


def inner_step(trainer: Trainer, x: torch.Tensor, y: torch.Tensor, since_boundary: int) -> None:
    """One inner step as a replica's worker takes it, on one batch, at the lr of the run's samples
    at the last boundary + `since_boundary`; with SwarmAdamW the batch as two microbatches of half
    its size, each observed, as the worker does."""
    if trainer.opts[0].per_microbatch:
        half = x.shape[0] // 2
        trainer.step([(x[:half], y[:half]), (x[half:], y[half:])], at=since_boundary)
    else:
        trainer.step([(x, y)], at=since_boundary)


def eager_start(state: StageState, own: dict[str, torch.Tensor], last_mean: dict[str, torch.Tensor] | None,
                share: float, lr_multiplier: float) -> StageState:
    """Where an eager overlapped round resumes: θ_global after the outer step that the mean would
    take if it were our own Δ at our share of the samples plus the last mean for the others'
    (the eager update of Kale et al. 2025, applied only to the next round's start point, so that
    θ_global stays one for all replicas), taken on a copy of the stage state. Without a last mean
    our own Δ stands for everyone's."""
    est = own if last_mean is None else {n: own[n] * share + last_mean[n] * (1.0 - share) for n in own}
    preview = copy.deepcopy(state)
    preview.apply_outer(est, lr_multiplier=lr_multiplier)
    return preview


def run_variant(m: Manifest, v: Variant, rounds: int, replicas: int, train, val_batches) -> dict:
    outer = m.outer
    if v.outer_lr is not None or v.outer_momentum is not None:
        outer = dataclasses.replace(outer, lr=v.outer_lr if v.outer_lr is not None else outer.lr,
                                    momentum=v.outer_momentum if v.outer_momentum is not None else outer.momentum)
    # every replica's position: the samples at the round's start (`trained`) + the whole run's since
    progress = TrainingProgress(m.schedule)
    inner = dataclasses.replace(m.inner, swarm_second_moment=v.swarm_moment)
    trainers = [Trainer(m, progress, replicas, inner) for _ in range(replicas)]
    state = StageState(trainers[0].model.build_stage(0), outer)
    modules = [t.stages[0] for t in trainers]
    batch = inner.microbatch_size * inner.microbatches_per_step
    streams = [MicrobatchStream(train, m.model.seq_len, batch, seed=m.seed * 1000 + r + 1) for r in range(replicas)]
    small = parse_codec_spec(v.small)
    codec = SizeAdaptive(m.averaging.small_tensor_threshold, small, parse_codec_spec(v.codec))
    feedback = [ErrorFeedback(codec, v.feedback_decay) if v.error_feedback else None for _ in range(replicas)]
    mean_codec = reduce_codec(codec)
    reducer_feedback = ErrorFeedback(codec if v.mean_codec is None else
                                     SizeAdaptive(m.averaging.small_tensor_threshold, small,
                                                  parse_codec_spec(v.mean_codec)))
    parts = partition(state.shapes, replicas)
    H = m.rounds.inner_steps
    samples = 0
    sent = 0
    shifts: list[dict[str, torch.Tensor] | None] = [None] * replicas  # overlapped: θ_global_new − anchor
    anchors: list[dict[str, torch.Tensor] | None] = [None] * replicas
    pending: tuple[dict[str, torch.Tensor], float, float] | None = None  # overlapped: the mean in flight
    last_mean: dict[str, torch.Tensor] | None = None
    for rnd in range(rounds):
        progress.trained = samples
        if pending is not None:  # the mean lands: one outer step, then each replica's shift
            state.apply_outer(*pending)
            last_mean, pending = pending[0], None
            shifts = [overlap.into_shift(a, state.params) if a is not None else None for a in anchors]
        deltas = []
        for r, (mod, trainer) in enumerate(zip(modules, trainers)):
            if not v.overlap or rnd == 0:
                state.copy_to(mod)
            for step in range(H):
                inner_step(trainer, *next(streams[r]), replicas * step * batch)
                if shifts[r] is not None and step + 1 >= min(H, v.lands_after):
                    overlap.rebase(mod, shifts[r], state.params, moved=True)
                    shifts[r] = None
            deltas.append(state.pseudo_gradient(mod))
        encoded = []
        for r, delta in enumerate(deltas):
            fb = feedback[r]
            encoded.append({n: fb.encode(n, t) if fb else codec.encode(t) for n, t in sorted(delta.items())})
        decoded = [{n: decode(e) for n, e in enc.items()} for enc in encoded]
        weight = float(H * batch)
        mean = reduce_part([(weight, d) for d in decoded], m.averaging.robust_min_members,
                           m.averaging.max_weight_ratio)
        if v.exchange.startswith("reduce"):
            if v.exchange == "reduce-ef":
                answers = {n: reducer_feedback.encode(n, t) for n, t in mean.items()}
            else:
                answers = {n: mean_codec.encode(t) for n, t in mean.items()}
            mean = {n: decode(e) for n, e in answers.items()}
            for r in range(replicas):  # member r: its other parts' contributions, then its part's mean
                sent += sum(payload(encoded[r][n]) for n, p in parts.items() if p != r)
                sent += (replicas - 1) * sum(payload(answers[n]) for n, p in parts.items() if p == r)
        else:
            sent += (replicas - 1) * sum(payload(e) for enc in encoded for e in enc.values())
        samples += replicas * H * batch
        outer_mult = lr_multiplier(m.schedule, samples) if m.schedule.outer else 1.0
        if not v.overlap or rnd == rounds - 1:  # the swarm's last round is a plain one
            state.apply_outer(mean, replicas * H * batch, outer_mult)
            continue
        pending = (mean, replicas * H * batch, outer_mult)
        for r, mod in enumerate(modules):  # resume at once: from θ_local, or from the eager estimate
            if v.overlap == "eager":
                eager_start(state, deltas[r], last_mean, 1.0 / replicas, outer_mult).copy_to(mod)
            anchors[r] = overlap.snapshot_local(mod)
    state.copy_to(modules[0])
    params = sum(t.numel() for t in state.params.values())
    return {"val": trainers[0].evaluate(val_batches), "bytes_per_sample": sent / samples,
            "ddp": 8.0 * params / batch, "samples": samples}


def run_ddp(m: Manifest, steps: int, replicas: int, train, val_batches) -> dict:
    """What data-parallel training computes: one model, each step on every replica's microbatch
    (the same streams as the variants), AdamW on the mean gradient, the same lr schedule."""
    trainer = Trainer(m, inner=dataclasses.replace(m.inner, swarm_second_moment=False))
    inner = m.inner
    batch = inner.microbatch_size * inner.microbatches_per_step
    streams = [MicrobatchStream(train, m.model.seq_len, batch, seed=m.seed * 1000 + r + 1) for r in range(replicas)]
    for step in range(steps):
        xs, ys = zip(*(next(s) for s in streams))
        inner_step(trainer, torch.cat(xs), torch.cat(ys), step * replicas * batch)
    ddp = 8.0 * sum(p.numel() for p in trainer.params()) / batch
    return {"val": trainer.evaluate(val_batches), "bytes_per_sample": ddp, "ddp": ddp,
            "samples": steps * replicas * batch}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap, quick="smoke run: 2 rounds of H=3 of fp32, int8+ef and ddp on 2 MB, 4 evaluation batches",
                    seed="the manifest's seed: weights, batches, evaluation set (default: the manifest's)")
    ap.add_argument("--manifest", type=Path, default=REFERENCE)
    ap.add_argument("--rounds", type=int, default=None, help="default: the manifest's max_rounds")
    ap.add_argument("--inner-steps", type=int, default=None, help="default: the manifest's rounds.inner_steps")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--variants", default=None,
                    help="names from --list, or ddp (one model on every replica's batches: the baseline); "
                         "default fp32,int8+ef,ctk64b2+ef")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lands-after", type=int, default=None,
                    help="overlapped variants: the mean lands after this many inner steps of the next round "
                         "(default 1; over a slow link or shared cores it lands later)")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args()
    if args.list:
        for v in VARIANTS.values():
            print(v)
        return
    torch.set_num_threads(args.threads)
    m = load(args.manifest)
    m = m.replace(stages={"count": 1}, seed=m.seed if args.seed is None else args.seed)
    if args.quick:  # fewer rounds, steps, bytes and evaluation batches: a smoke run, not a figure
        args.rounds, args.inner_steps = args.rounds or 2, args.inner_steps or 3
        m = m.replace(data={"max_bytes": 2_000_000, "eval_batches": 4})
    variants = args.variants or ("fp32,int8+ef,ddp" if args.quick else "fp32,int8+ef,ctk64b2+ef")
    if args.inner_steps:
        m = m.replace(rounds={"inner_steps": args.inner_steps})
    rounds = args.rounds or m.rounds.max_rounds
    if m.schedule.kind != "constant" and rounds != m.rounds.max_rounds:
        # the schedule spans this run's samples (warmup the same share of them)
        total = rounds * m.rounds.inner_steps * args.replicas * m.inner.microbatch_size * m.inner.microbatches_per_step
        share = m.schedule.warmup_samples / max(1, m.schedule.total_samples)
        m = m.replace(schedule={"total_samples": total, "warmup_samples": int(share * total)})
    d = m.data
    train, val = load_corpora(d.source, d.paths, d.val_fraction, d.max_bytes or None)
    val_batches = validation_batches(val, m.model.seq_len, m.inner.microbatch_size, d.eval_batches, seed=m.seed)
    report = Report("Pseudo-gradient codecs in exact DiLoCo rounds, one process", args.out)
    report.print(f"{args.replicas} replicas, {rounds} rounds of H={m.rounds.inner_steps}, manifest {args.manifest.name}"
                 + (f", overlapped means land after {args.lands_after} steps" if args.lands_after is not None else ""))
    rows, results = [], []
    first = None
    for name in variants.split(";") if ";" in variants else variants.split(","):
        t = time.monotonic()
        if name == "ddp":
            res = run_ddp(m, rounds * m.rounds.inner_steps, args.replicas, train, val_batches)
        else:
            v = VARIANTS[name]
            if args.lands_after is not None:
                v = dataclasses.replace(v, lands_after=args.lands_after)
            res = run_variant(m, v, rounds, args.replicas, train, val_batches)
        first = res["val"] if first is None else first
        gap = 100.0 * (res["val"] / first - 1.0)
        ratio = res["ddp"] / res["bytes_per_sample"] if res["bytes_per_sample"] else math.inf
        rows.append([name, f"{res['val']:.4f}", f"{gap:+.2f} %", fmt(res["bytes_per_sample"], 1), fmt(ratio, 0),
                     f"{time.monotonic() - t:.0f}"])
        results.append({"variant": name, **res, "gap_pct": gap, "seconds": time.monotonic() - t})
        print(f"  {name}: {res['val']:.4f} bits/byte, {gap:+.2f} %, {fmt(res['bytes_per_sample'], 1)} bytes/sample "
              f"({rows[-1][-1]} s)", flush=True)
    report.print()
    report.table(["variant", "val bits/byte", "gap", "payload bytes/sample", "DDP / that", "s"], rows)
    report.results = {"manifest": str(args.manifest), "seed": m.seed, "replicas": args.replicas, "rounds": rounds,
                      "inner_steps": m.rounds.inner_steps, "variants": results}
    report.finish()


if __name__ == "__main__":
    main()
