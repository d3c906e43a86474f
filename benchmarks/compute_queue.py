"""What waits on a stage's compute thread, and behind what: a 2-stage pipeline of real peers in one
process (tests/support's in-memory DHT and loopback transport), one driver and one stage-1
replica over a shaped link.

    python -m benchmarks.compute_queue [--microbatches 4] [--size 16] [--max-in-flight 4] [--mbit 20]
                                       [--delay-ms 25] [--rounds 4] [--forward-first]

Every call a replica submits to its compute thread (peer/compute/thread.py) is timed from its
submission to its start; a call that waited more than 5 ms is counted under the kind of call that
ran just before it. So it says whether a forward (what feeds the link) waits behind a backward, the
wait an overlap of one microbatch's backward with the next one's forward and send would remove,
and prints the driver's `pipeline` reports (link and compute use, the uplink's waits between inner
steps) and the driver's samples/s after its first round. `--forward-first` sets
pipeline.forward_first (forwards before waiting backwards). The model: 4 layers of d=128, 128 tokens. All peers share this machine's cores: read the
waits as shares of the compute time (core_share in the reports).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.swarm import InProcessSwarm, LinkSpec, step_manifest  # noqa: E402

from benchmarks.harness.report import Report, add_common_args, seed_or  # noqa: E402

from swarmgrad.peer.compute import thread  # noqa: E402

WAITED_S = 0.005
REPORT = ("window", "window_needed", "bottleneck", "link_util", "driver_compute_util", "step_gap_share",
          "local_compute_s", "remote_s", "core_share")


class QueueProbe:
    """Wraps ComputeThread.run: per thread and kind of call, the waits; what a waiting call followed."""

    def __init__(self) -> None:
        self.waits: dict[str, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
        self.behind: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.names: dict[int, str] = {}
        self.last: dict[int, str] = {}

    def install(self) -> None:
        original = thread.ComputeThread.run
        probe = self

        async def run(self: thread.ComputeThread, fn: Callable[..., Any], *args: Any, first: bool = False) -> Any:
            submitted, kind = time.perf_counter(), probe.kind(fn, args)
            name = probe.names.setdefault(id(self), f"replica {len(probe.names)}")

            def timed(*a: Any) -> Any:
                wait = time.perf_counter() - submitted
                probe.waits[name][kind].append(wait)
                if wait > WAITED_S and id(self) in probe.last:
                    probe.behind[(name, kind, probe.last[id(self)])] += 1
                try:
                    return fn(*a)
                finally:
                    probe.last[id(self)] = kind
            return await original(self, timed, *args, first=first)
        thread.ComputeThread.run = run  # type: ignore[method-assign]

    @staticmethod
    def kind(fn: Callable[..., Any], args: tuple) -> str:
        if getattr(fn, "__name__", "") in ("timed", "counted") and args:
            return getattr(args[0], "__name__", "?")
        return getattr(fn, "__name__", "?")


async def measure(args: argparse.Namespace, probe: QueueProbe, report: Report) -> None:
    m = step_manifest(5, seed=seed_or(args, 0), model={"d_model": 128, "n_layers": 4, "n_heads": 4, "seq_len": 128},
                      inner={"microbatch_size": args.size, "microbatches_per_step": args.microbatches},
                      pipeline={"max_in_flight": args.max_in_flight, "forward_first": args.forward_first},
                      timeouts={"microbatch": 30.0, "min_microbatch": 5.0}, data={"eval_every": 100, "eval_batches": 1})
    link = LinkSpec(delay=args.delay_ms / 1e3, bandwidth=args.mbit * 1e6 / 8)
    async with InProcessSwarm(m, link=link) as swarm:
        swarm.start(1, max_rounds=args.rounds)
        driver = swarm.start(0, max_rounds=args.rounds)
        await swarm.wait_exit(600)
        for report_ in driver.events("pipeline")[1:]:
            report.print(str({k: report_.get(k) for k in REPORT}))
        rounds = driver.events("round")
        samples = sum(e["samples"] for e in rounds[1:])
        report.print(f"driver: {samples} samples in rounds 2-{len(rounds)}, "
              f"{samples / (rounds[-1]['time'] - rounds[0]['time']):.1f} samples/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--size", type=int, default=16)
    p.add_argument("--max-in-flight", type=int, default=4)
    p.add_argument("--mbit", type=float, default=20.0)
    p.add_argument("--delay-ms", type=float, default=25.0)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--forward-first", action="store_true")
    add_common_args(p, quick="two rounds instead of --rounds", seed="the manifest's seed (default 0)")
    args = p.parse_args()
    if args.quick:
        args.rounds = 2
    report = Report("What waits on a stage's compute thread", args.out)
    probe = QueueProbe()
    probe.install()
    asyncio.run(measure(args, probe, report))
    rows = []
    roles = {name: "stage 1" if "forward_loss_grads" in kinds else "stage 0 (driver)"
             for name, kinds in probe.waits.items()}
    probe.behind = collections.Counter({(roles[n], k, b): c for (n, k, b), c in probe.behind.items()})
    for name, kinds in probe.waits.items():
        for kind, waits in sorted(kinds.items(), key=lambda kv: -len(kv[1])):
            ordered = sorted(waits)
            rows.append((roles[name], kind, len(waits), f"{1e3 * sum(waits) / len(waits):.1f}",
                         f"{1e3 * ordered[int(0.9 * len(ordered))]:.1f}"))
    report.table(("replica", "call", "calls", "mean wait ms", "p90 wait ms"), rows)
    report.print(f"waited > {1e3 * WAITED_S:.0f} ms, (replica, call, behind): {dict(probe.behind.most_common())}")


if __name__ == "__main__":
    main()
