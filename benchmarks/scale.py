"""Does the machinery hold at sizes that matter? State downloads, averaging rounds, memory and
codec speed of a model's stages, each against the limit that should decide it.

For every manifest given (the Llama presets: examples/llama-cpu.toml, examples/llama-125m.toml, ...)
it measures, in real peer processes (each in its own network namespace with a shaped link when this
machine allows it, else on loopback, said in the report):

- **state download**: a third peer joins stage 1 of a running 2-stage swarm and downloads its state
  (θ_global + outer momentum, fp32); seconds from its `started` event to its `state_loaded` event,
  against bytes / link rate. Goal: ≤ 1.2 × that limit + 10 s.
- **averaging round**: the first round the two replicas of stage 1 average together; its
  `averaging_s` against the bytes each member sent while averaging / link rate. Goal: ≤ 1.3 × + 2 s.
- **memory**: each peer's peak RSS (`stopped` event) against placement's estimate for its stage
  (peer/placement/cost.py, computed for float32 on the CPU) plus the runtime (the peak RSS of a
  process that imported torch, hivemind and swarmgrad, and holds no model). Goal: within 20 %. Backups are off
  (`averaging.backup_every = 0`): a peer holding other stages' backups needs more, and the
  estimate is of one replica.
- **codec**: int8 encode + decode of the model's largest tensor on one core, GB/s of fp32 input.
  Goal: ≥ 1 GB/s per core.
- **tokens/s**: the 2-stage swarm's drivers (tokens trained per second of their rounds, before the
  joiner came) against one process training the whole model with the same optimiser on the same
  cores (both CPU cores, `torch.set_num_threads(2)`), on random tokens.

To fit 2 CPU cores, every manifest is run with one sample per microbatch, two microbatches per
step, four inner steps per round and `--seq-len` tokens (default 128; the figures that decide scale,
bytes and memory of weights, do not depend on it). On this machine a 125M-parameter stage takes
several seconds per microbatch.

    python -m benchmarks.scale --manifests examples/llama-cpu.toml examples/llama-125m.toml --out runs/scale
    python -m benchmarks.scale --quick     # the built-in tiny GPT, loopback: a smoke run (~1 minute)
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import REPO
from benchmarks.harness.netns import NetnsSwarm, WanNet, why_unavailable
from benchmarks.harness.report import Report, add_common_args, fmt, seed_or
from swarmgrad.compression import parse_codec_spec
from swarmgrad.peer.cli.launcher import LocalSwarm, PeerProcess, stop_on_signals
from swarmgrad.peer.manifest import Manifest, dumps, load
from swarmgrad.peer.model import from_manifest
from swarmgrad.peer.placement.cost import stage_costs

MBIT = 1e6 / 8
"""Bytes per second of one Mbit/s."""


@dataclass
class ScaleFigures:
    name: str
    params: int
    link: str
    state_bytes: int = 0
    join_s: float = math.nan
    join_limit_s: float = math.nan
    avg_bytes: int = 0
    avg_s: float = math.nan
    avg_limit_s: float = math.nan
    rss: dict[str, int] = field(default_factory=dict)
    estimate: dict[str, int] = field(default_factory=dict)
    """Placement's estimate of each peer's stage plus the runtime a peer process has before any model."""
    runtime: int = 0
    codec_numel: int = 0
    codec_gbs: float = math.nan
    swarm_tokens_s: float = math.nan
    single_tokens_s: float = math.nan
    notes: list[str] = field(default_factory=list)

    def goals(self) -> dict[str, bool | None]:
        def ok(x: float, limit: float) -> bool | None:
            return None if not (math.isfinite(x) and math.isfinite(limit)) else x <= limit
        rss = [abs(self.rss[k] / self.estimate[k] - 1) <= 0.2 for k in self.rss if self.estimate.get(k)]
        return {"join": ok(self.join_s, 1.2 * self.join_limit_s + 10),
                "averaging": ok(self.avg_s, 1.3 * self.avg_limit_s + 2),
                "memory": all(rss) if rss else None,
                "codec": None if not math.isfinite(self.codec_gbs) else self.codec_gbs >= 1.0}


def bench_manifest(m: Manifest, seq_len: int) -> Manifest:
    """The manifest as this benchmark runs it on 2 CPU cores (module docstring)."""
    return m.replace(model={"seq_len": min(seq_len, m.model.seq_len)},
                     stages={"count": 2, "layers": []},
                     inner={"microbatch_size": 1, "microbatches_per_step": 2, "microbatch_sizes": []},
                     rounds={"inner_steps": 4, "round_seconds": 0.0, "max_rounds": 0},
                     pipeline={"max_in_flight": 2},
                     averaging={"backup_every": 0},
                     data={"eval_every": 0, "eval_batches": 1},
                     timeouts={"state_download": 900.0, "allreduce": 600.0, "microbatch": 300.0,
                               "min_microbatch": 60.0, "matchmaking": 30.0, "join_hold": 120.0})


def codec_gbs(numel: int, spec: str = "int8", repeats: int = 3) -> float:
    """GB/s of fp32 input through encode + decode on one core (the best of `repeats`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        codec = parse_codec_spec(spec)
        x = torch.randn(numel)
        best = math.inf
        for _ in range(repeats):
            t = time.perf_counter()
            type(codec).decode_encoded(codec.encode(x), numel)
            best = min(best, time.perf_counter() - t)
        return 4 * numel / best / 1e9
    finally:
        torch.set_num_threads(threads)


RUNTIME_PROBE = ("import resource, torch, hivemind, swarmgrad.peer.node.peer, swarmgrad.peer.cli.peer; "
                 "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")


def runtime_bytes() -> int:
    """Peak RSS of a process that has imported what a peer imports (torch, hivemind, swarmgrad) and
    holds no model: the part of a peer's memory placement's estimate (tensors only) leaves out."""
    import subprocess
    out = subprocess.run([sys.executable, "-c", RUNTIME_PROBE], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def largest_tensor(m: Manifest) -> int:
    model = from_manifest(m)
    return max(p.numel() for s in range(model.n_stages) for p in model.build_stage(s).parameters())


def single_process_tokens_s(m: Manifest, steps: int, threads: int = 2) -> float:
    """Tokens/s of one process training the whole model (all stages in a row), AdamW, on `threads` cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = from_manifest(m)
        whole = torch.nn.Sequential(*[model.build_stage(s) for s in range(model.n_stages)])
        opt = torch.optim.AdamW(whole.parameters(), lr=m.inner.lr)
        g = torch.Generator().manual_seed(0)
        n, t_len = m.inner.microbatch_size, m.model.seq_len
        vocab = min(m.model.vocab_size, 256)

        def step() -> None:
            for _ in range(m.inner.microbatches_per_step):
                tokens = torch.randint(0, vocab, (n, t_len + 1), generator=g)
                model.loss_fn(whole(tokens[:, :-1]), tokens[:, 1:]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()  # warm-up: allocations, AdamW's state
        start = time.perf_counter()
        for _ in range(steps):
            step()
        return steps * m.inner.microbatches_per_step * n * t_len / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)


def _first(peer: PeerProcess, kind: str) -> dict[str, Any] | None:
    return next(iter(peer.events(kind)), None)


def run_swarm(m: Manifest, workdir: Path, rate_mbit: float | None, budget_s: float) -> dict[str, Any]:
    """Stage 0 and stage 1 train; once stage 1 completed a round, a third peer joins stage 1; stop
    after its first round averaged with two members. The figures of the module docstring."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "manifest.toml"
    path.write_text(dumps(m))
    net = None
    if rate_mbit is not None:
        net = WanNet(f"scale{int(time.time()) % 10000}", 3, f"{rate_mbit:g}mbit", subnet=91)
        net.__enter__()
    try:
        swarm: LocalSwarm = NetnsSwarm(path, workdir, net.endpoints) if net else LocalSwarm(path, workdir)
        with stop_on_signals(), swarm:
            deadline = time.monotonic() + budget_s
            driver = swarm.start_first(0)
            first = swarm.start(1)
            swarm.wait_for(first, lambda e: e["event"] == "round" and e["complete"], budget_s, "a first round")
            joiner = swarm.start(1)
            notes = []
            try:
                swarm.wait_for(joiner, lambda e: e["event"] == "round" and e["complete"] and e["group_size"] == 2,
                               max(10.0, deadline - time.monotonic()), "the joiner's first round of two members")
            except TimeoutError:  # a finding, not a crash: the table says so and keeps the other figures
                notes.append("the joiner never averaged with the other stage-1 replica within --budget "
                             "(its rounds were all of one member): no averaging figure")
            swarm.close(grace=60.0)
        peers = {"driver": driver, "stage1": first, "joiner": joiner}
        started, loaded = _first(joiner, "started"), _first(joiner, "state_loaded")
        paired = next((e for e in joiner.events("round") if e["complete"] and e["group_size"] == 2), None)
        drive = [e for e in driver.events("round") if e["time"] < started["time"]] or driver.events("round")
        return {
            "join_s": loaded["time"] - started["time"] if loaded else math.nan,
            "avg_s": paired["averaging_s"] if paired else math.nan,
            "avg_bytes": max(paired["avg_bytes_sent"], paired["avg_bytes_recv"]) if paired else 0,
            "notes": notes,
            "rss": {k: (_first(p, "stopped") or {}).get("peak_rss", 0) for k, p in peers.items()},
            "driver_tokens_s": sum(e["samples"] for e in drive) * m.model.seq_len / max(1e-9, sum(e["round_s"] for e in drive)),
        }
    finally:
        if net is not None:
            net.close()


def measure(path: Path, args: argparse.Namespace, workdir: Path, report: Report) -> ScaleFigures:
    m = bench_manifest(load(path), args.seq_len)
    m = m.replace(seed=seed_or(args, m.seed)) if args.seed is not None else m
    costs = stage_costs(m, from_manifest(m) if m.model.kind == "entry_point" else None, compute_dtype="float32")
    rate = None if args.loopback else args.link_mbit
    unavailable = why_unavailable() if rate is not None else None
    if unavailable:
        rate = None
    fig = ScaleFigures(name=path.stem, params=sum(c.params for c in costs),
                       link=f"{args.link_mbit:g} Mbit (netns)" if rate else "loopback (unshaped)")
    if unavailable:
        fig.notes.append(f"links not shaped: {unavailable}")
    fig.state_bytes = costs[1].state_bytes
    fig.runtime = runtime_bytes()
    fig.estimate = {"driver": costs[0].memory_bytes + fig.runtime, "stage1": costs[1].memory_bytes + fig.runtime,
                    "joiner": costs[1].memory_bytes + fig.runtime}
    report.print(f"\n## {fig.name}: {fig.params / 1e6:.1f}M parameters, link {fig.link}")
    fig.codec_numel = largest_tensor(m)
    fig.codec_gbs = codec_gbs(fig.codec_numel)
    report.print(f"int8 encode+decode of the largest tensor ({fig.codec_numel / 1e6:.1f}M floats): "
                 f"{fig.codec_gbs:.2f} GB/s per core")
    fig.single_tokens_s = single_process_tokens_s(m, steps=1 if args.quick else 3)
    report.print(f"one process, 2 cores: {fig.single_tokens_s:.1f} tokens/s")
    got = run_swarm(m, workdir / fig.name, rate, args.budget)
    fig.join_s, fig.avg_s, fig.avg_bytes, fig.rss = got["join_s"], got["avg_s"], got["avg_bytes"], got["rss"]
    fig.swarm_tokens_s = got["driver_tokens_s"]
    fig.notes.extend(got["notes"])
    link_bps = (rate or math.inf) * MBIT
    fig.join_limit_s = fig.state_bytes / link_bps if rate else math.nan
    fig.avg_limit_s = fig.avg_bytes / link_bps if rate else math.nan
    return fig


def print_table(report: Report, figs: list[ScaleFigures]) -> None:
    gb = lambda b: f"{b / 2**30:.2f}"  # noqa: E731
    report.print("\n### Against their limits")
    rows = []
    for f in figs:
        goals = f.goals()
        mark = lambda k: "" if goals[k] is None else (" ✓" if goals[k] else " ✗")  # noqa: E731
        rows.append([f.name, f"{f.params / 1e6:.1f}M", f.link,
                     f"{fmt(f.join_s)} s / {fmt(f.join_limit_s)} s ({f.state_bytes / 1e6:.0f} MB){mark('join')}",
                     f"{fmt(f.avg_s, 2)} s / {fmt(f.avg_limit_s, 2)} s ({f.avg_bytes / 1e6:.1f} MB){mark('averaging')}",
                     f"{fmt(f.codec_gbs, 2)} GB/s{mark('codec')}",
                     f"{fmt(f.swarm_tokens_s)} / {fmt(f.single_tokens_s)} = {fmt(f.swarm_tokens_s / f.single_tokens_s, 2)}"])
    report.table(["model", "params", "link", "join: measured / bytes÷rate", "averaging round: measured / bytes÷rate",
                  "int8 codec, 1 core", "tokens/s: swarm / one process"], rows)
    report.print("\n### Peak RSS against placement's estimate + the runtime (GiB)")
    report.print("The runtime is the peak RSS of a process that imported torch, hivemind and swarmgrad "
                 f"and holds no model ({', '.join(f'{f.name}: {gb(f.runtime)}' for f in figs)} GiB).")
    report.table(["model", "peer", "peak RSS", "estimate", "ratio"],
                 [[f.name, k, gb(f.rss[k]), gb(f.estimate[k]), fmt(f.rss[k] / f.estimate[k], 2) if f.estimate[k] else "n/a"]
                  for f in figs for k in f.rss])
    for f in figs:
        for note in f.notes:
            report.print(f"- {f.name}: {note}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, quick="the built-in tiny GPT on loopback: a smoke run of every measurement",
                    seed="the manifests' seed (default: each manifest's own)")
    parser.add_argument("--manifests", nargs="+", type=Path, default=None,
                        help="manifests to measure (default: examples/llama-cpu.toml and examples/llama-125m.toml "
                             "where they exist)")
    parser.add_argument("--link-mbit", type=float, default=100.0, help="each peer's upload, shaped with tbf (default 100)")
    parser.add_argument("--loopback", action="store_true", help="do not shape links (no namespaces)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sample (default 128; capped by the manifest's)")
    parser.add_argument("--budget", type=float, default=1800.0, help="seconds one swarm may take (default 1800)")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.loopback = True
        manifests = args.manifests or [REPO / "examples" / "tiny-gpt.toml"]
    else:
        manifests = args.manifests or [p for p in (REPO / "examples" / "llama-cpu.toml",
                                                   REPO / "examples" / "llama-125m.toml") if p.exists()]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="swarmgrad-scale-"))
    report = Report("The machinery at scale: downloads, averaging, memory, codec, tokens/s", args.out)
    figs = []
    for path in manifests:
        figs.append(measure(Path(path), args, workdir, report))
        report.results = [f.__dict__ | {"goals": f.goals()} for f in figs]
        report.write()
    print_table(report, figs)
    report.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
