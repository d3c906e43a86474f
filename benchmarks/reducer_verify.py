"""What averaging.verify costs: bytes and seconds of one outer round, in one process.

    python -m benchmarks.reducer_verify [--groups 2,3,4] [--rounds 3] [--codec int8] [--numel 1048576]

Real Averagers over the tests' loopback RPC and in-memory DHT (tests/support, as
tests/test_reducer_audit.py uses them: no processes, no sockets), one stage of three tensors of
`--numel` values in all, for each group size with the reduce-scatter (gather_up_to 0) and the gather
exchange (gather_up_to = the group size), verify off and on. Bytes: every averaging request and
answer as serialised on the wire, per member per round (sent + received, averaged over members).
Seconds: the median round's wall time (all members in one event loop and, with the executor's
encodes, on this machine's cores: compare the columns of one run, not runs). docs/trust.md,
"Reducers", has the figures.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support.dht import MemoryDHT, announce, swarm_view  # noqa: E402
from support.rpc import LoopbackNetwork, LoopbackRPC  # noqa: E402
from support.swarm import peer_keys  # noqa: E402

from benchmarks.harness.report import Report, add_common_args, seed_or  # noqa: E402

from swarmgrad.peer.averaging.averager import Averager  # noqa: E402
from swarmgrad.peer.cli.launcher import small_manifest  # noqa: E402
from swarmgrad.peer.clock import RoundClock  # noqa: E402
from swarmgrad.peer.net.identity import peer_id_of  # noqa: E402

STAGE = 1


class CountingRPC(LoopbackRPC):
    """The loopback RPC, counting each call's request and answer bytes for the caller."""

    def __init__(self, net: LoopbackNetwork, me: str, counts: dict[str, int]):
        super().__init__(net, me)
        self.counts = counts

    async def call(self, peer, method, request, response_type, timeout):  # type: ignore[no-untyped-def]
        resp = await super().call(peer, method, request, response_type, timeout)
        size = request.ByteSize() + resp.ByteSize()
        self.counts[self.me] = self.counts.get(self.me, 0) + size  # sent + received by the caller
        self.counts[peer] = self.counts.get(peer, 0) + size  # received + sent by the reducer
        return resp


def shapes(numel: int) -> dict[str, tuple[int, ...]]:
    side = max(64, int((numel / 2) ** 0.5))
    return {"a": (side, side), "b": (side, side), "c": (side,)}


async def measure(n: int, gather: bool, verify: bool, rounds: int, codec: str, numel: int, seed: int = 0) -> tuple[float, float]:
    """(bytes per member per round, median round seconds)."""
    m = small_manifest(averaging={"codec": codec, "error_feedback": False, "verify": verify,
                                  "gather_up_to": n if gather else 0},
                       timeouts={"matchmaking": 2.0, "allreduce": 60.0})
    keys = sorted(peer_keys(n, "reducer-verify-bench"), key=peer_id_of)
    counts: dict[str, int] = {}
    seconds = []
    for r in range(rounds):  # a fresh group each round: round 0, nothing sent early, nothing left over
        net, dht = LoopbackNetwork(), MemoryDHT()
        avgs = []
        for key in keys:
            peer = peer_id_of(key)
            view = swarm_view(dht, peer, m)
            clock = RoundClock(m.rounds, counts_steps=False, max_rounds=0, epoch=None)
            avg = Averager(m, STAGE, peer, shapes(numel), CountingRPC(net, peer, counts), view, 1 << 26, clock,
                           key=key)  # type: ignore[arg-type]
            net.handlers[peer] = avg.reducer.handle
            avgs.append(avg)
            await announce(view, STAGE)
        deltas = [{k: torch.randn(s, generator=torch.Generator().manual_seed(seed + 100 * r + i)) for k, s in
                   shapes(numel).items()} for i in range(n)]
        started = time.perf_counter()
        results = await asyncio.gather(*(a.run_round(0, d, 10.0, "digest", 0) for a, d in zip(avgs, deltas)))
        seconds.append(time.perf_counter() - started)
        assert all(x.complete for x in results), [x.reason for x in results]
    return sum(counts.values()) / (n * rounds), statistics.median(seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", default="2,3,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--numel", type=int, default=1 << 20)
    add_common_args(ap, quick="groups of 2 and 3, 2 rounds of 65,536 values",
                    seed="offsets the seeds of the members' pseudo-gradients (default 0)")
    args = ap.parse_args()
    if args.quick:
        args.groups, args.rounds, args.numel = "2,3", 2, 1 << 16
    seed = seed_or(args, 0)
    report = Report("What averaging.verify costs", args.out)
    report.print(f"codec {args.codec}, {sum(torch.Size(s).numel() for s in shapes(args.numel).values()):,} values "
                 f"per stage, {args.rounds} rounds each")
    rows = []
    for n in (int(x) for x in args.groups.split(",")):
        for gather in (False, True):
            off = None
            for verify in (False, True):
                b, s = asyncio.run(measure(n, gather, verify, args.rounds, args.codec, args.numel, seed))
                off = off or (b, s)
                rows.append((n, "gather" if gather else "reduce", "on" if verify else "off", f"{b:,.0f}",
                             f"{b / off[0]:.2f}", f"{s:.3f}", f"{s / off[1]:.2f}"))
                print(rows[-1], flush=True)
    report.table(("members", "exchange", "verify", "bytes / member / round", "× off", "round s", "× off"), rows)
    report.write()


if __name__ == "__main__":
    main()
