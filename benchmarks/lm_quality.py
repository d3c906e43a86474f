"""Quality, side by side: the CPU Llama preset on real English text, trained by one process and by
swarms of real peer processes, at the same global batch and the same tokens.

    python -m benchmarks.lm_quality [--quick] [--out DIR] [--seed N] [--steps S] [--global-batch W]
                                    [--inner-steps H] [--vocab-size V] [--activation-codec C]
                                    [--gradient-codec C] [--outer-lr LR] [--outer-momentum M]
                                    [--runs single 1x2 2x2]

The corpus is Debian's `fortunes` package (fortune-mod's data: /usr/share/games/fortunes/*, about
2.6 MB of English quips, quotations and jokes; `apt-get install fortunes`). Every fortune (the text
between two lines holding `%`) is one document, written to ``fortunes.jsonl`` in the work folder and
read through the streaming path (`[data] source = "jsonl"`: packed `seq_len` windows with an
end-of-document token, validation split by document). A byte-level BPE (peer/text/tokenizer.py)
is trained on the training documents only, and the model's vocab_size is set from it.

The model, optimiser and boundary settings are examples/llama-cpu.toml's (4.9M parameters at
vocab 256; d_model 256, 6 layers, 8 heads sharing 4 key/value heads, seq_len 128; AdamW 1e-3,
betas (0.9, 0.95), wd 0.1, clip 1.0; outer Nesterov 0.7 / 0.9, int8 pseudo-gradients with error
feedback) with the learning-rate schedule added: linear warmup over 10 % of the tokens, then
cosine to 10 % at the last one, over the swarm's samples. Three runs, each of `--steps` global
steps of `--global-batch` windows of 128 tokens (default 16: 2048 tokens):

- ``single``: one process trains the whole model (benchmarks/harness/training.py's Trainer: the
  peers' own inner optimiser and schedule), microbatches of 8 windows, from the token stream a
  driver reads (peer/text/run_data.py's `load_run_data`);
- ``1x2``: 2 data-parallel replicas of the whole model (stages.count = 1), each half the global
  batch per inner step, a DiLoCo round every H inner steps;
- ``2x2``: 2 stages x 2 replicas, the same, with the boundary tensors in `--activation-codec` /
  `--gradient-codec` (default int8 both ways: blockwise 8-bit, 4x fewer bytes than fp32).

The swarms are real `swarmgrad peer` processes on 127.0.0.1 (benchmarks/harness/swarm.py), each
driver reading the corpus's shards in an order drawn from its own data seed (no shard leases:
`data.shards` = 0), each peer `--max-rounds steps / H`. Peers start one after
another, so a replica that joins late trains its last rounds after the first one stopped: a swarm
trains somewhat more tokens than planned (the table says how many, from the drivers' round events).
The swarms run first; the single process then trains as far as the longest of them (past the
schedule's end, the lr stays at its floor, as in the swarm) and is scored after the step where each
swarm's token count falls, so every comparison is at equal tokens (to one step). Every run is scored
on the same validation windows (the first `eval_batches` x 8 windows of the validation documents),
in nats per token, perplexity and bits per byte. The goal: every swarm run within 1.5 % of the
single process's validation loss (nats per token) at equal tokens.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import REPO
from benchmarks.harness.report import Report, add_common_args, fmt, seed_or
from benchmarks.harness.swarm import SwarmFailed, SwarmRun, fail, run_swarm
from benchmarks.harness.training import Trainer
from swarmgrad.peer.manifest import Manifest, load
from swarmgrad.peer.text.run_data import load_run_data, text_corpus
from swarmgrad.peer.text.sources import TextSource, is_validation
from swarmgrad.peer.text.tokenizer import BPETokenizer, TrainedTokenizer, file_sha256, train_bpe
from swarmgrad.peer.text.units import eval_units

FORTUNES = Path("/usr/share/games/fortunes")
PRESET = REPO / "examples" / "llama-cpu.toml"
GOAL = 0.015
"""A swarm run's final validation nats/token may exceed the single process's by this share."""
MICROBATCH = 8
REPLICAS = 2


def fortunes(root: Path = FORTUNES) -> list[str]:
    """Every fortune of the package's plain-text files (not the *.dat indexes nor the *.u8 links), in
    file order: the text between lines that hold only ``%``, stripped; empty ones dropped."""
    docs: list[str] = []
    for path in sorted(root.iterdir()):
        if path.suffix in (".dat", ".u8") or path.is_symlink() or not path.is_file():
            continue
        piece: list[str] = []
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines() + ["%"]:
            if line.strip() == "%":
                text = "\n".join(piece).strip()
                if text:
                    docs.append(text)
                piece = []
            else:
                piece.append(line)
    return docs


def prepare(workdir: Path, vocab_size: int, seed: int, steps: int, global_batch: int, inner_steps: int,
            eval_every: int, eval_batches: int, activation_codec: str, gradient_codec: str,
            tokenizer: Path | None = None) -> dict[str, Manifest]:
    """fortunes.jsonl, the tokenizer trained on its training documents (or `tokenizer`, an earlier
    run's), and the three runs' manifests."""
    workdir.mkdir(parents=True, exist_ok=True)
    corpus = workdir / "fortunes.jsonl"
    # a document's key (the validation split hashes it) names the file's path: runs compare only on
    # one corpus file, so a second invocation with the same --workdir reuses it (never rewrites it)
    text = "".join(json.dumps({"text": d}) + "\n" for d in fortunes())
    if not corpus.is_file() or corpus.read_text() != text:
        corpus.write_text(text)
    data = {"source": "jsonl", "paths": [str(corpus)], "text_field": "text", "val_fraction": 0.05,
            "shard_mb": 0.25, "max_bytes": 0, "eval_every": eval_every, "eval_batches": eval_batches,
            "evaluators": 1}
    # the training side of the split, exactly as the corpus will cut it (the keys are the rows' offsets)
    source = TextSource("jsonl", [str(corpus)], "", "text", int(0.25 * (1 << 20)))
    train_docs = (d.text for s in source.shards for d in source.documents(s) if not is_validation(d.key, 0.05))
    if tokenizer is None:
        tok = train_bpe(train_docs, vocab_size, workdir / "tokenizer.json")
    else:
        tok = TrainedTokenizer(tokenizer.absolute(), BPETokenizer(tokenizer).vocab_size, file_sha256(tokenizer))
    tokens = steps * global_batch  # the schedule counts samples: windows
    base = load(PRESET).replace(
        seed=seed, model={"vocab_size": tok.vocab_size},
        data={**data, "tokenizer": str(tok.path), "tokenizer_sha256": tok.sha256},
        schedule={"kind": "cosine", "warmup_samples": tokens // 10, "total_samples": tokens, "min_lr_ratio": 0.1},
        rounds={"inner_steps": inner_steps, "round_seconds": 0.0})
    return {
        "single": base.replace(run_id="lmq-single", stages={"count": 1},
                               inner={"microbatch_size": MICROBATCH,
                                      "microbatches_per_step": global_batch // MICROBATCH}),
        "1x2": base.replace(run_id="lmq-1x2", stages={"count": 1},
                            inner={"microbatch_size": MICROBATCH,
                                   "microbatches_per_step": global_batch // MICROBATCH // REPLICAS}),
        "2x2": base.replace(run_id="lmq-2x2", stages={"count": 2},
                            inner={"microbatch_size": MICROBATCH,
                                   "microbatches_per_step": global_batch // MICROBATCH // REPLICAS},
                            pipeline={"activation_codec": activation_codec, "gradient_codec": gradient_codec}),
    }


def train_single(m: Manifest, steps: int, eval_steps: int, seed: int, planned: int,
                 score_at: set[int]) -> dict[str, Any]:
    """One process, the whole model: `steps` steps on the stream a driver with data seed `seed` reads,
    evaluated at the start, every `eval_steps` steps and after each step of `score_at`. Its result
    is its state after `planned` steps (in `score_at`; its wall time is to there); ``at`` maps the
    tokens of each step of `score_at` to the validation loss there (a swarm's equal-token baseline)."""
    data = load_run_data(m, seed)
    trainer = Trainer(m)
    per_step = m.inner.microbatch_size * m.inner.microbatches_per_step * m.model.seq_len
    curve: list[tuple[int, float]] = []
    at: dict[int, float] = {}

    def evaluate() -> float:
        for stage in trainer.stages:
            stage.eval()
        with torch.no_grad():
            losses = [float(trainer.loss(x, y)) for x, y in data.validation]
        for stage in trainer.stages:
            stage.train()
        nats = sum(losses) / len(losses)
        curve.append((trainer.samples * m.model.seq_len, nats))
        return nats

    started, wall = time.monotonic(), 0.0
    evaluate()
    try:
        for step in range(1, steps + 1):
            trainer.step([data.stream.draw(m.inner.microbatch_size) for _ in range(m.inner.microbatches_per_step)])
            if step == planned:
                wall = time.monotonic() - started
            if step in score_at or step % eval_steps == 0:
                nats = evaluate()
                print(f"  [single] step {step}/{steps}: val {nats:.4f} nats/token", flush=True)
                if step in score_at:
                    at[step * per_step] = nats
    finally:
        data.close()
    return {"nats": at[planned * per_step], "curve": curve,
            "tokens": planned * per_step, "wall_s": wall, "at": at, "val_tokens": data.val_tokens,
            "val_bytes": data.val_bytes}


def swarm_result(run: SwarmRun) -> dict[str, Any]:
    """The drivers' evaluations as (tokens trained by the swarm before it, nats/token); the final one
    the mean of the drivers' final evaluations (they hold the same θ_global)."""
    seq = run.manifest.model.seq_len
    rounds = sorted(run.events("round", run.drivers), key=lambda e: e["round"])
    def tokens_through(r: int | None) -> int:
        return seq * sum(e["samples"] for e in rounds if r is not None and e["round"] <= r)
    evals = sorted((e for e in run.events("eval", run.drivers) if e.get("val_nats") is not None),
                   key=lambda e: e["time"])
    finals = [e for e in evals if e.get("final")]
    total = seq * run.samples
    curve = [(total if e.get("final") else tokens_through(e.get("after_round")), e["val_nats"])
             for e in evals if not e.get("final")]
    nats = sum(e["val_nats"] for e in finals) / len(finals)
    curve.append((total, nats))
    return {"nats": nats, "curve": curve, "tokens": total, "wall_s": run.wall_s,
            "val_tokens": finals[0]["val_tokens"], "val_bytes": finals[0]["val_bytes"],
            "complete_rounds": run.replica_agreement()[1], "bytes_sent": run.bytes_sent}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, quick="smoke run: 16 global steps (rounds of 4), vocab 1024, 2 validation batches",
                    seed="weights, the drivers' data order and the manifests' seed (default 0)")
    p.add_argument("--steps", type=int, default=96, help="global steps (default 96)")
    p.add_argument("--global-batch", type=int, default=16,
                   help="windows of 128 tokens per global step, a multiple of 16 (default 16)")
    p.add_argument("--inner-steps", type=int, default=8, help="H: inner steps per round of a replica (default 8)")
    p.add_argument("--vocab-size", type=int, default=2048, help="BPE vocabulary (default 2048)")
    p.add_argument("--eval-every", type=int, default=3, help="rounds between evaluations (default 3)")
    p.add_argument("--eval-batches", type=int, default=16, help="validation batches of 8 windows (default 16)")
    p.add_argument("--activation-codec", default="int8", help="2x2's boundary activations (default int8)")
    p.add_argument("--gradient-codec", default="int8", help="2x2's boundary gradients (default int8)")
    p.add_argument("--outer-lr", type=float, default=None, help="the swarms' outer lr (default: the preset's 0.7)")
    p.add_argument("--outer-momentum", type=float, default=None,
                   help="the swarms' outer Nesterov momentum (default: the preset's 0.9; 0: none)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="a tokenizer.json to use instead of training one (runs compare in nats/token only with one "
                        "tokenizer; with an earlier invocation's --workdir it is the same one, trained again)")
    p.add_argument("--runs", nargs="+", default=["single", "1x2", "2x2"], choices=["single", "1x2", "2x2"])
    p.add_argument("--workdir", type=Path, default=None, help="corpus, tokenizer and peer logs (default: --out/work)")
    args = p.parse_args()
    if not FORTUNES.is_dir() or not any(FORTUNES.iterdir()):
        print(f"no fortunes in {FORTUNES}: apt-get install fortunes", file=sys.stderr)
        sys.exit(2)
    steps, h, vocab, every, val = args.steps, args.inner_steps, args.vocab_size, args.eval_every, args.eval_batches
    if args.quick:
        steps, h, vocab, every, val = 16, 4, 1024, 2, 2
    if steps % h:
        p.error(f"--steps ({steps}) must be a multiple of --inner-steps ({h})")
    if args.global_batch < MICROBATCH * REPLICAS or args.global_batch % (MICROBATCH * REPLICAS):
        p.error(f"--global-batch must be a multiple of {MICROBATCH * REPLICAS}")
    seed = seed_or(args, 0)
    workdir = args.workdir or ((args.out / "work") if args.out else Path("/tmp") / "swarmgrad-lm-quality")
    report = Report("Real text: the Llama preset on Debian's fortunes", args.out)
    manifests = prepare(workdir, vocab, seed, steps, args.global_batch, h, every, val, args.activation_codec,
                        args.gradient_codec, args.tokenizer)
    outer = {k: v for k, v in (("lr", args.outer_lr), ("momentum", args.outer_momentum)) if v is not None}
    if args.outer_momentum == 0:
        outer["nesterov"] = False
    manifests = {n: mf.replace(outer=outer) if outer and n != "single" else mf for n, mf in manifests.items()}
    m = manifests["single"]
    corpus = text_corpus(m)
    report.print(f"corpus: Debian fortunes, {workdir / 'fortunes.jsonl'} ({len(corpus.shards)} shards); BPE vocab "
                 f"{m.model.vocab_size}; {steps} global steps of {args.global_batch} x {m.model.seq_len} tokens "
                 f"= {steps * args.global_batch * m.model.seq_len:,} tokens; swarm rounds of H = {h} inner steps; "
                 f"2x2 boundary codecs: activations {args.activation_codec}, gradients {args.gradient_codec}; "
                 f"outer lr {manifests['1x2'].outer.lr}, momentum {manifests['1x2'].outer.momentum}")
    results: dict[str, dict[str, Any]] = {}
    report.results = {"steps": steps, "global_batch": args.global_batch, "inner_steps": h,
                      "vocab_size": m.model.vocab_size, "seed": seed,
                      "activation_codec": args.activation_codec, "gradient_codec": args.gradient_codec,
                      "outer": {"lr": manifests["1x2"].outer.lr, "momentum": manifests["1x2"].outer.momentum},
                      "runs": results}
    # the swarms first: a replica that joins a round late trains rounds past the others' last one, so a
    # swarm trains somewhat more tokens than planned; the single process then trains as far as the
    # longest swarm and is scored at each swarm's own token count too (equal tokens, exactly)
    for name in [n for n in args.runs if n != "single"]:
        print(f"\n--- {name} ---", flush=True)
        shutil.rmtree(workdir / name, ignore_errors=True)  # a peer's events file is appended to: start clean
        try:
            run = run_swarm(manifests[name], workdir / name, steps // h, replicas=REPLICAS,
                            budget_s=max(1800.0, 60.0 * steps), label=name)
        except SwarmFailed as e:
            report.write()
            fail(e)
        results[name] = swarm_result(run)
        report.write()
    if "single" in args.runs:
        print("\n--- single ---", flush=True)
        per_step = args.global_batch * m.model.seq_len
        at = {math.ceil(r["tokens"] / per_step) for r in results.values()}
        results["single"] = train_single(m, max([steps, *at]), every * h, seed, steps, at | {steps})
    table(report, results)
    report.figure("curves.png", lambda fig: plot(fig, results))
    report.finish()


def table(report: Report, results: dict[str, dict[str, Any]]) -> None:
    single = results.get("single")
    order = ["single"] + [n for n in results if n != "single"] if single else list(results)
    rows = []
    for name in order:
        r = results[name]
        u = eval_units(r["nats"], r["val_tokens"], r["val_bytes"])
        base = None
        if single and name != "single":  # the single process at this swarm's tokens (its step rounded up)
            key = min((t for t in single["at"] if t >= r["tokens"]), default=None)
            base = single["at"].get(key) if key is not None else None
            r["single_at_tokens"] = [key, base]
        rel = (r["nats"] - base) / base if base else math.nan
        rows.append([name, f"{u.nats_per_token:.4f}", f"{u.perplexity:.2f}", f"{u.bits_per_byte:.4f}",
                     "—" if name == "single" else f"{100 * rel:+.2f} % (single {base:.4f} at equal tokens)"
                     + (" goal met" if rel <= GOAL else " goal missed") if base else "—",
                     f"{r['tokens']:,}", fmt(r["wall_s"], 0)])
        r["val_ppl"], r["val_bpb"], r["vs_single"] = u.perplexity, u.bits_per_byte, rel
    report.table(["run", "val nats/token", "val ppl", "val bits/byte", "vs single process", "tokens", "wall s"], rows)


def plot(fig, results: dict[str, dict[str, Any]]) -> None:  # type: ignore[no-untyped-def]
    ax = fig.subplots()
    for name, r in results.items():
        xs, ys = zip(*r["curve"])
        ax.plot(xs, ys, marker="o", markersize=3, label=name)
    ax.set_title("Llama CPU preset on Debian's fortunes: validation loss at equal tokens")
    ax.set_xlabel("tokens trained (whole swarm)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.legend()


if __name__ == "__main__":
    main()
