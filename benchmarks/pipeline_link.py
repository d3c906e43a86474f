"""Does the 2-stage pipeline fill its link? Samples/s and link utilisation of the same pipeline run by
the code before the adaptive window, by the code now, and by the code now with pipeline.lookahead,
side by side, unshaped and over 20 Mbit.

    python -m benchmarks.pipeline_link [--links unshaped,20mbit] [--variants before,after,lookahead,...]
                                       [--before REV] [--rounds N] [--quick] [--seed N] [--out DIR]

Two peers, one per stage (a driver on stage 0, the loss on stage 1), each in its own network
namespace on one veth pair (benchmarks/harness/netns.py, namespaces named `window-<pid>-...`); "20mbit"
puts `tbf rate 20mbit burst 32kb latency 50ms` on both ends' egress. The task is the reference
model (examples/reference.toml: byte-level GPT d 128, 4 layers, seq 128) split in two stages, fp16
activations and gradients, microbatches of 16, 4 per inner step, pipeline.max_in_flight 4 (issue 9
item 5's configuration; --codecs, --shape and --max-in-flight change it), rounds of H = 10 inner steps.

Variants, in one run: `before` runs `git archive REV` (default: the commit before the adaptive
window), `after` the working tree, both from the same manifest, and `lookahead` the working tree
with `pipeline.lookahead = true` (the next inner step's microbatches go out while this one drains;
peer/compute/lookahead.py). `unpaced` pushes each stage's backup after every round
(`averaging.backup_link_share` 1, as before pacing), `paced` keeps the pushes to 5 % of the time
(0.05; the default, 0.2, still pushes every round of this configuration) and `no-backups` never
(`backup_every` 0). `tapered` runs the working tree with `inner.microbatch_sizes` = --taper (default
2,8,8,8,8,8,8,8,4,2: the same 64 samples per step as 4 x 16 or 16 x 4, small microbatches where a
step fills and drains the pipeline, full ones between); the others run --shape. Each runs until
the driver has reported 1 + N rounds; the first (start-up, the first evaluation) is not counted.
The ratio column divides by the first variant listed.

Figures, over the counted rounds (from the driver's round events): samples/s; MB/s each way and
link utilisation (bytes of the `wan0` interface counters, all traffic, over the link's rate; unshaped
links have no rate); `idle` is the share of 100 ms samples in which stage 0's uplink carried less
than 10 % of its rate (the link waiting on something else). With the code that reports it, the
driver's own `pipeline` events add the window it chose, its measured compute utilisation, the
bottleneck it names, and the share of the time its uplink waited between inner steps (the last
round's event).

Root is needed for the namespaces; without it the script says why and exits 0. Only ratios measured
in one run mean anything: the machine is shared.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness import REPO, netns
from benchmarks.harness.report import Report, add_common_args, fmt, markdown_table
from swarmgrad.peer.manifest import Manifest, dumps, load

BEFORE = "6b832a8"
"""The last commit before the adaptive window and ordered sending (what `before` runs by default)."""
LINKS = {"unshaped": None, "20mbit": "20mbit"}
VARIANTS = ("before", "after", "lookahead", "unpaced", "paced", "no-backups", "tapered")
TAPER = "2,8,8,8,8,8,8,8,4,2"
CHANGES: dict[str, dict[str, Any]] = {
    "lookahead": {"pipeline": {"lookahead": True}},
    "unpaced": {"averaging": {"backup_link_share": 1.0}},
    "paced": {"averaging": {"backup_link_share": 0.05}},
    "no-backups": {"averaging": {"backup_every": 0}},
}
"""What each working-tree variant changes in the manifest (`after` changes nothing)."""
RATE_BYTES = {"20mbit": 20e6 / 8}
NS_PREFIX = "window-"
SAMPLE_S = 0.1


def tapered(sizes: list[int]) -> dict[str, Any]:
    """The manifest change of the `tapered` variant: one step's microbatches of these sizes."""
    return {"inner": {"microbatch_size": max(sizes), "microbatches_per_step": len(sizes), "microbatch_sizes": sizes}}


def manifest(inner_steps: int, per_step: int, size: int, cap: int, codecs: tuple[str, str] = ("fp16", "fp16"),
             seed: int | None = None) -> Manifest:
    m = load(REPO / "examples" / "reference.toml")
    return m.replace(
        run_id="pipeline-link", seed=m.seed if seed is None else seed, stages={"count": 2},
        inner={"microbatch_size": size, "microbatches_per_step": per_step},
        pipeline={"activation_codec": codecs[0], "gradient_codec": codecs[1], "max_in_flight": cap},
        rounds={"inner_steps": inner_steps, "max_rounds": 0},
        data={"eval_every": 0, "eval_batches": 2})


@dataclass
class Row:
    variant: str
    link: str
    samples: int = 0
    seconds: float = math.nan
    up_bps: float = math.nan
    down_bps: float = math.nan
    idle: float = math.nan
    pipeline: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    repeat: int = 0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else math.nan

    def utilisation(self, bps: float) -> float:
        rate = RATE_BYTES.get(self.link)
        return bps / rate if rate else math.nan


def run_one(variant: str, link: str, code: Path | None, rounds: int, m: Manifest, workdir: Path,
            subnet: int, timeout_s: float) -> Row:
    row = Row(variant, link)
    workdir.mkdir(parents=True)
    text = dumps(m)
    (workdir / "manifest.toml").write_text(text if code is None else for_old_code(text, code))
    with netns.WanNet(f"{variant[:3]}{subnet}", 2, LINKS[link], subnet=subnet, name_prefix=NS_PREFIX) as net, \
            netns.NetnsSwarm(workdir / "manifest.toml", workdir, net.endpoints) as swarm:
        if code is not None:  # the `before` snapshot first on the path, ahead of the editable install
            swarm.env["PYTHONPATH"] = str(code)
        sampler = netns.TxSampler(net, SAMPLE_S)
        sampler.start()
        try:
            driver = swarm.start_first(0)
            swarm.start(1)
            deadline = time.monotonic() + timeout_s
            seen: list[tuple[float, dict[str, Any]]] = []  # (monotonic time seen, round event)
            while len(seen) < rounds + 1:
                events = driver.events("round")
                for e in events[len(seen):]:
                    # event times are wall clock; the sampler's are monotonic: map through now
                    seen.append((time.monotonic() - (time.time() - e["time"]), e))
                if any(not p.alive for p in swarm.peers) or time.monotonic() > deadline:
                    dead = [p for p in swarm.peers if not p.alive]
                    row.error = (f"{dead[0].name} exited" if dead else f"timeout {timeout_s:.0f}s") + \
                        f" after {len(seen)} rounds: " + (dead or swarm.peers)[0].log_tail(4).replace("\n", " | ")
                    break
                time.sleep(0.2)
            if not row.error:
                (t0, _), (t1, _) = seen[0], seen[-1]
                row.samples = sum(e["samples"] for _, e in seen[1:])
                row.seconds = t1 - t0
                row.up_bps = (sampler.at(t1, 0) - sampler.at(t0, 0)) / row.seconds
                row.down_bps = (sampler.at(t1, 1) - sampler.at(t0, 1)) / row.seconds
                rate = RATE_BYTES.get(link)
                if rate:
                    row.idle = sampler.idle_share(t0, t1, 0, rate)
                last = t1 - time.monotonic() + time.time()
                first = t0 - time.monotonic() + time.time()
                pipe = [e for e in driver.events("pipeline") if first < e["time"] <= last + 0.5]
                if pipe:
                    row.pipeline = pipe[-1]
        finally:
            sampler.stop.set()
            sampler.join(5)
            # the interface counters over time, for a look at when the link was busy
            (workdir / "tx.jsonl").write_text("".join(json.dumps([t, v]) + "\n" for t, v in sampler.samples))
    return row


def for_old_code(text: str, code: Path) -> str:
    """The manifest without the fields the snapshot's code does not know (its loader refuses
    them): fields added since run with that code's own behaviour, which is what `before` means."""
    probe = ("import dataclasses, json; from swarmgrad.peer import manifest as m; "
             "print(json.dumps({n: [f.name for f in dataclasses.fields(c)] for n, c in m._SECTIONS.items()}))")
    known = json.loads(subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(code)},
                                      capture_output=True, text=True, check=True).stdout)
    out, section = [], None
    for line in text.splitlines():
        if line.startswith("["):
            section = line.strip("[]")
        elif section is not None and "=" in line and line.split("=")[0].strip() not in known.get(section, ()):
            continue
        out.append(line)
    return "\n".join(out) + "\n"


def snapshot(rev: str) -> Path:
    """`git archive REV` of the three packages, laid out as an importable `swarmgrad` package."""
    snap = Path(tempfile.mkdtemp(prefix="window-pipeline-link-code-"))
    (snap / "swarmgrad").mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "peer", "protocol", "compression"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(snap / "swarmgrad")], input=archive, check=True)
    return snap


def table(rows: list[Row], first: str) -> str:
    """One row per run; the ratio is to the `first` variant's run of the same link and repeat."""
    base = {(r.link, r.repeat): r for r in rows if r.variant == first and not r.error}
    out = []
    for r in rows:
        b = base.get((r.link, r.repeat))
        p = r.pipeline
        out.append([r.variant, r.link, fmt(r.samples_per_s, 1),
                    fmt(r.samples_per_s / b.samples_per_s, 2) if b else "",
                    fmt(r.up_bps / 1e6, 2), fmt(r.down_bps / 1e6, 2),
                    fmt(r.utilisation(r.up_bps), 2), fmt(r.utilisation(r.down_bps), 2), fmt(r.idle, 2),
                    f"{p['window']} ({fmt(p['window_needed'] or math.nan, 1)})" if p else "",
                    f"{p['bottleneck']} (link {p['link_util']:.2f}, compute {p['compute_util']:.2f})" if p else "",
                    fmt(p["step_gap_share"], 2) if p and "step_gap_share" in p else "",
                    f"FAILED: {r.error[:300]}" if r.error else ""])
    header = ["code", "link", "samples/s", f"ratio to {first}", "up MB/s", "down MB/s", "up util", "down util",
              "uplink idle", "window (needed)", "driver's report: bottleneck (utilisation)",
              "uplink waits between steps", "note"]
    return markdown_table(header, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p, quick="smoke run: 1 round of 2 steps per run",
                    seed="the manifest's seed: weights and data (default: the manifest's)")
    p.add_argument("--links", default="unshaped,20mbit", help="comma-separated, of unshaped,20mbit")
    p.add_argument("--variants", default="before,after,lookahead",
                   help="comma-separated, of before,after,lookahead,unpaced,paced,no-backups,tapered "
                        "(ratios are to the first)")
    p.add_argument("--before", default=BEFORE, help=f"git revision the `before` variant runs (default {BEFORE})")
    p.add_argument("--rounds", type=int, default=4, help="rounds counted per run (after one start-up round)")
    p.add_argument("--inner-steps", type=int, default=10, help="H: inner steps per round")
    p.add_argument("--shape", default="4x16", help="microbatches per step x samples per microbatch (default 4x16)")
    p.add_argument("--taper", default=TAPER, help=f"the tapered variant's microbatch sizes per step (default {TAPER})")
    p.add_argument("--max-in-flight", type=int, default=4, help="pipeline.max_in_flight (default 4)")
    p.add_argument("--codecs", default="fp16;fp16", help="activation and gradient codecs, ';' between them (default "
                   "fp16;fp16; the demo's: 'lowrank:rank=32;hadamard:bits=4,stochastic=true')")
    p.add_argument("--backup-every", type=int, default=None,
                   help="averaging.backup_every (default: the reference manifest's, 1; 0: no backups)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each variant per link, alternating (default 1)")
    p.add_argument("--workdir", default=None, help="keep every peer's log and events here")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # finally blocks remove the namespaces
    links, variants = args.links.split(","), args.variants.split(",")
    for name, got, allowed in (("--links", links, LINKS), ("--variants", variants, VARIANTS)):
        if any(x not in allowed for x in got):
            p.error(f"{name}: choose from {','.join(allowed)}")
    why = netns.why_unavailable()
    if why:
        print(f"SKIP: benchmarks.pipeline_link needs network namespaces: {why}")
        return 0
    rounds, steps = (1, 2) if args.quick else (args.rounds, args.inner_steps)
    per_step, size = (int(x) for x in args.shape.split("x"))
    try:
        taper = [int(x) for x in args.taper.split(",")]
    except ValueError:
        p.error(f"--taper: comma-separated integers (got {args.taper!r})")
    changes = {**CHANGES, "tapered": tapered(taper)}
    codecs = args.codecs.split(";")
    if len(codecs) != 2:
        p.error(f"--codecs: two codec specs with ';' between them (got {args.codecs!r})")
    m = manifest(steps, per_step, size, args.max_in_flight, (codecs[0], codecs[1]), args.seed)
    if args.backup_every is not None:
        m = m.replace(averaging={"backup_every": args.backup_every})
    tmp = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="window-pipeline-link-"))
    code = snapshot(args.before) if "before" in variants else None
    print(f"load average {os.getloadavg()[0]:.1f}; before = {args.before}, after = working tree, lookahead = "
          f"working tree with pipeline.lookahead; "
          f"{rounds} rounds of {steps} steps of {per_step} x {size} samples per run, max_in_flight "
          f"{args.max_in_flight}, boundaries {codecs[0]} / {codecs[1]}"
          + (f"; tapered = {taper}" if "tapered" in variants else ""), flush=True)
    rows: list[Row] = []
    try:
        for li, link in enumerate(links):
            # variants alternate, repeat after repeat: a load that comes and goes on a shared machine
            # then falls on both rather than on whichever ran during it
            for rep in range(args.repeats):
                for vi, variant in enumerate(variants):
                    print(f"--- {variant} over {link} ({rep + 1}/{args.repeats})", flush=True)
                    try:
                        vm = m.replace(**changes.get(variant, {}))
                        row = run_one(variant, link, code if variant == "before" else None, rounds, vm,
                                      tmp / f"{link}-{variant}-{rep}", subnet=200 + len(VARIANTS) * li + vi,
                                      timeout_s=120 + 60 * rounds)
                    except Exception as e:  # one broken run must not lose the others' rows
                        row = Row(variant, link, error=f"{type(e).__name__}: {e}")
                    row.repeat = rep
                    rows.append(row)
                    print(f"  {fmt(row.samples_per_s, 1)} samples/s, up {fmt(row.up_bps / 1e6, 2)} MB/s, down "
                          f"{fmt(row.down_bps / 1e6, 2)} MB/s" + (f" FAILED: {row.error}" if row.error else ""),
                          flush=True)
    finally:
        if code is not None:
            shutil.rmtree(code, ignore_errors=True)
        if not args.workdir:
            shutil.rmtree(tmp, ignore_errors=True)
    print()
    report = Report("Does the 2-stage pipeline fill its link?", args.out)
    report.print(table(rows, variants[0]))
    for link in links:
        for variant in variants[1:]:
            ratios = sorted(r.samples_per_s / b.samples_per_s for r in rows for b in rows
                            if r.link == b.link == link and r.repeat == b.repeat and r.variant == variant
                            and b.variant == variants[0] and not (r.error or b.error))
            if ratios:
                report.print(f"{link}: {variant} / {variants[0]} samples/s per repeat "
                             f"{', '.join(f'{x:.2f}' for x in ratios)} (median {statistics.median(ratios):.2f})")
    report.print(f"\nload average after {os.getloadavg()[0]:.1f}")
    report.results = {"before": args.before, "rounds": rounds, "inner_steps": steps, "shape": args.shape,
                      "rows": [dataclasses.asdict(r) | {"samples_per_s": r.samples_per_s} for r in rows]}
    report.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
