"""Pseudo-gradient codecs at equal samples: the demo task run once per averaging codec, in one run.

    python -m benchmarks.round_codecs [--rounds N] [--inner-steps H] [--codecs fp16,int8,...] [--quick]
                                      [--seed N] [--out DIR]

Each variant is the demo swarm (stages.count x 2 replicas, same manifest, run by the swarm
benchmarks' runner: benchmarks/harness/swarm.py) with averaging.codec and
averaging.error_feedback set, rounds counted in inner steps (rounds.inner_steps = H,
rounds.round_seconds = 0) and --max-rounds N, so every replica trains the same number of inner steps
whatever the codec costs in time. Variants run one after another.

--codecs is a comma-separated list of codec specs; a spec's own parameters stay with it
("topk:fraction=0.01,values=fp16" is one entry); trailing flags: "+ef" turns error feedback on,
"+rf" averaging.reducer_feedback (the reducer answers in the same codec, with error feedback of its
own), "+g" averaging.gather_up_to = 2 (the reducers forward the members' own parts, every member
aggregates: no second encode), "+all" averaging.small_tensor_threshold = 0 (small tensors use the
codec too instead of fp32), "+sl" SparseLoCo's outer recipe (averaging.feedback_decay = 0.95,
outer.lr = 1, outer.momentum = 0), e.g. "chunktopk:chunk=4096,k=4096,bits=1+ef+rf".

Columns: final validation loss (mean of the drivers' final evals, bits/byte), samples trained by the
drivers, pseudo-gradient bytes sent per sample (all peers' round events' avg_bytes_sent, each peer's
median round times its rounds, / samples: see averaging_bytes),
how many times fewer that is than DDP's fp32 all-reduce of every step (each peer sends ~2·4·P bytes
per step of microbatches_per_step x microbatch_size samples, so 8·P / that per sample; P = the whole
model's parameter count), all bytes sent per sample (stopped events), and whether every complete round
left a stage's replicas with one state digest. Averaging bytes per round do not depend on H, so the
DDP ratio grows with H: the reference task uses H = 50 (--inner-steps 50).

Known daemon race (peer/node/peer.py, not fixable here): with rounds.inner_steps > 0, after its last round
a driver keeps training, its worker pauses itself after H more inner steps, and a final eval that has
not finished by then waits forever. A large enough H (20 by default, 12 with --quick) wins the race in
practice; if it is lost, the run fails with a message saying so instead of hanging.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.harness.report import Report, add_common_args, fmt, seed_or
from benchmarks.harness.swarm import DEFAULT_MANIFEST, SwarmFailed, SwarmRun, fail, run_swarm
from swarmgrad.peer.manifest import Manifest, ManifestError, load
from swarmgrad.peer.model import from_manifest

REPLICAS = 2
DEFAULT_CODECS = ("fp32,int8+ef,topk:fraction=0.01,values=fp16+ef,chunktopk:chunk=4096,k=64,bits=4+ef,"
                  "chunktopk:chunk=4096,k=160,bits=2+ef")
QUICK_CODECS = "fp16,topk:fraction=0.01,values=fp16+ef"


FLAGS = ("+ef", "+rf", "+g", "+all", "+sl")


def parse_codecs(text: str) -> list[tuple[str, set[str]]]:
    """"fp16,int4+ef,topk:fraction=0.01,values=fp16+ef+rf" -> [(spec, {flags}), ...]. A token
    holding "=" but no ":" is a parameter of the spec before it, not a codec of its own."""
    entries: list[str] = []
    for token in (t.strip() for t in text.split(",")):
        if not token:
            continue
        if (entries and "=" in token and ":" not in token and ":" in entries[-1]
                and not entries[-1].endswith(FLAGS)):
            entries[-1] += "," + token
        else:
            entries.append(token)
    out = []
    for e in entries:
        flags = set()
        while e.endswith(FLAGS):
            flag = next(f for f in FLAGS if e.endswith(f))
            flags.add(flag)
            e = e[:-len(flag)]
        out.append((e, flags))
    return out


def ddp_bytes_per_sample(m: Manifest) -> float:
    """DDP's fp32 all-reduce: ~2·4·P bytes per peer per step, over the samples of one peer's step."""
    model = from_manifest(m)
    params = sum(p.numel() for s in range(model.n_stages) for p in model.build_stage(s).parameters())
    return 8.0 * params / (m.inner.microbatches_per_step * m.inner.microbatch_size)


def averaging_bytes(run: SwarmRun) -> float:
    """Averaging bytes of all peers: each peer's median round (avg_bytes_sent) times its rounds.

    avg_bytes_sent counts everything a peer process sent during its averaging window, so a state
    or backup transfer, or pipeline traffic, that overlaps one window inflates that round by
    megabytes (seen: 3.6 MB in one round of a sparse codec whose other rounds sent 70 KB); the
    median round is what the codec costs."""
    per_peer: dict[str, list[int]] = {}
    for p in run.peers:
        per_peer[p.name] = [e["avg_bytes_sent"] for e in p.events("round")]
    return float(sum(statistics.median(v) * len(v) for v in per_peer.values() if v))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap, quick="a short smoke run (about 2 minutes): 1 round of H=12, two codecs unless --codecs",
                    seed="the manifest's seed: weights and data (default: the manifest's)")
    ap.add_argument("--manifest", type=Path, default=DEFAULT_MANIFEST)
    ap.add_argument("--rounds", type=int, default=None, help="rounds per variant (default 4; 1 with --quick)")
    ap.add_argument("--inner-steps", type=int, default=None, help="inner steps per round, H (default 20; 12 with --quick)")
    ap.add_argument("--codecs", default=None,
                    help=f"comma-separated codec specs, '+ef' for error feedback (default {DEFAULT_CODECS}; "
                         f"with --quick {QUICK_CODECS})")
    ap.add_argument("--keep", action="store_true", help="keep every variant's logs and events")
    args = ap.parse_args()
    # H stays >= 12 in quick runs too: a smaller H loses the daemon's post-last-round race
    # (benchmarks/harness/swarm.py).
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 4)
    H = args.inner_steps if args.inner_steps is not None else (12 if args.quick else 20)
    base = load(args.manifest)
    base = base.replace(seed=seed_or(args, base.seed))
    codecs = parse_codecs(args.codecs or (QUICK_CODECS if args.quick else DEFAULT_CODECS))
    variants = []
    for spec, flags in codecs:
        averaging = {"codec": spec, "error_feedback": "+ef" in flags, "reducer_feedback": "+rf" in flags,
                     "gather_up_to": 2 if "+g" in flags else 0}
        if "+all" in flags:
            averaging["small_tensor_threshold"] = 0
        if "+sl" in flags:
            averaging["feedback_decay"] = 0.95
        outer = {"lr": 1.0, "momentum": 0.0} if "+sl" in flags else {}
        try:
            variants.append((spec + "".join(f" {f.upper()}" for f in FLAGS if f in flags),
                             base.replace(rounds={"inner_steps": H, "round_seconds": 0.0}, averaging=averaging,
                                          outer=outer)))
        except ManifestError as e:
            ap.error(str(e))

    per_round = H * base.inner.microbatches_per_step * base.inner.microbatch_size
    ddp = ddp_bytes_per_sample(base)
    report = Report("Pseudo-gradient codecs at equal samples in the demo swarm", args.out)
    report.print(f"round codecs: run {base.run_id}, {base.stages.count} stages x {REPLICAS} replicas, {rounds} rounds "
                 f"of H={H} inner steps ({per_round} samples per driver per round); {len(variants)} variants")
    root = Path(tempfile.mkdtemp(prefix="swarmgrad-bench-codecs-"))
    # Generous: rounds end on inner steps, so time depends on the machine; this only catches a hang.
    budget = 240 + rounds * H * 10.0
    rows, results = [], []
    for i, (label, m) in enumerate(variants):
        print(f"[{i + 1}/{len(variants)}] {label} ...", flush=True)
        started = time.monotonic()
        try:
            run = run_swarm(m, root / f"v{i}", rounds, REPLICAS, budget, label=label)
        except SwarmFailed as e:
            print(f"logs kept in {root}", flush=True)
            fail(e)
        samples = run.samples
        agree, full, seen = run.replica_agreement()
        avg = averaging_bytes(run)
        avg_per_sample = avg / samples if samples and avg else float("nan")
        row = [label, fmt(run.final_val_loss(), 3), str(samples), fmt(avg_per_sample, 0), fmt(ddp / avg_per_sample, 0),
               fmt(run.bytes_sent / samples if samples else float("nan"), 0),
               "yes" if agree else "NO", f"{full}/{seen}"]
        rows.append(row)
        results.append({"codec": label, "val_bpb": run.final_val_loss(), "samples": samples,
                        "avg_bytes_per_sample": avg_per_sample, "ddp_ratio": ddp / avg_per_sample,
                        "total_bytes_per_sample": run.bytes_sent / samples if samples else None,
                        "replicas_identical": agree, "rounds_all_completed": full, "rounds_seen": seen})
        print(f"    done in {time.monotonic() - started:.0f}s: validation {run.first_val_loss():.3f} -> "
              f"{run.final_val_loss():.3f} bits/byte, {samples} samples", flush=True)
    if args.keep:
        print(f"logs and events in {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    report.print()
    report.table(["codec", "val bits/byte", "samples", "avg bytes/sample", "DDP / avg", "total bytes/sample",
                  "replicas identical", "rounds all replicas completed"], rows)
    report.print()
    report.print("avg bytes/sample: pseudo-gradient averaging bytes sent by all peers (each peer's median round x "
                 "its rounds: other traffic overlapping one averaging window is left out) / samples trained by the "
                 f"drivers; DDP / avg: DDP's fp32 all-reduce every step ({ddp:,.0f} bytes/sample) over avg "
                 f"bytes/sample, at H={H}; total bytes/sample: everything all peers sent (pipeline activations and "
                 "gradients too). Replicas identical: every complete round left the replicas of its stage with one "
                 "state digest. Variants ran one after another on a shared machine: compare them with each other, "
                 "not with other runs.")
    report.results = {"manifest": str(args.manifest), "rounds": rounds, "inner_steps": H,
                      "ddp_bytes_per_sample": ddp, "variants": results}
    report.finish()


if __name__ == "__main__":
    main()
