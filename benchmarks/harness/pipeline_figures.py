"""What one run of a pipeline swarm measured, from its peers' JSON-lines events and interface byte
counters, and the goals of issue 45 as arithmetic on those figures. Pure: no processes, no network
(benchmarks/pipeline_wan.py runs the swarms and hands their events here; tests hand it synthetic ones).

Every run is counted from each peer's first `round` event to its last: the first round (start-up,
the start evaluation, late joiners) is left out of rates and utilisations, and is in `samples`.
"""
from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

MBIT = 1e6 / 8
"""Bytes per second of one Mbit/s."""
LINK_GOAL = 0.95
"""At 20 Mbit: samples/s at least this share of the unshaped run of the same row..."""
LOSS_GOAL = 0.01
"""...at most this much validation loss above the reference row at equal samples (relative)."""
BYTES_GOAL = 32.0
"""Boundary bytes per sample at least this many times below fp32 (at LOSS_GOAL)."""
SLOW_GOAL = 0.9
"""With one slow replica: samples/s at least this share of what the others carry plus its share."""


def rate_bytes(link: str | None) -> float | None:
    """'20mbit' -> bytes/s; None (unshaped) -> None."""
    if link is None:
        return None
    if not link.endswith("mbit"):
        raise ValueError(f"a link rate is written like 20mbit (got {link!r})")
    return float(link[:-4]) * MBIT


@dataclass
class PeerEvents:
    """One peer of a run: the stage it was started on, its egress's tbf rate (bytes/s; None:
    unshaped) and the events it wrote."""
    stage: int
    rate: float | None
    events: list[dict[str, Any]]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == kind]


@dataclass
class RunFigures:
    samples: int = 0
    """Samples the drivers trained, all rounds."""
    samples_per_s: float = math.nan
    """Σ over drivers of (samples of rounds 2..n) / (time of round n's event - time of round 1's)."""
    link_util: dict[int, float] = field(default_factory=dict)
    """Per stage: mean over its peers of egress bytes/s (interface counters) / the tbf rate."""
    up_mbps: dict[int, float] = field(default_factory=dict)
    """Per stage: mean over its peers of egress Mbit/s (interface counters: all traffic)."""
    compute_util: dict[int, float] = field(default_factory=dict)
    """Per stage: mean over its peers and counted rounds of the round event's `utilisation`
    (compute seconds / round seconds)."""
    bottleneck: str = ""
    """The drivers' `pipeline` events' most frequent bottleneck over the counted rounds."""
    driver_link_util: float = math.nan
    driver_compute_util: float = math.nan
    up_bytes_per_sample: float = math.nan
    """Boundary bytes per sample the drivers sent (their trips' requests: activations, targets)."""
    down_bytes_per_sample: float = math.nan
    """Boundary bytes per sample that came back (the answers: the activations' gradients, the loss)."""
    val_loss: float = math.nan
    """Mean of the drivers' final validation losses (bits per byte)."""
    losses: list[tuple[float, float]] = field(default_factory=list)
    """(seconds since the first driver started driving, mean of the drivers' training loss) per round."""
    compute_rate: list[float] = field(default_factory=list)
    """Per peer (start order): mean over counted rounds of its announced compute rate (samples/s)."""
    incomplete_rounds: int = 0
    """Round events of any peer with `complete` false (a round that did not average as a group)."""
    lost: int = 0
    """Microbatches the drivers gave up on (their final `eval` events' `lost`)."""
    retries: int = 0
    """Microbatch attempts the drivers re-sent (their final `eval` events' `retries`)."""
    one_stage_each: bool = True
    """Every peer's round events were all of the stage it was started on, and none moved."""
    notes: list[str] = field(default_factory=list)

    @property
    def boundary_bytes_per_sample(self) -> float:
        return self.up_bytes_per_sample + self.down_bytes_per_sample


def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.fmean(xs) if xs else math.nan


def summarise(peers: Sequence[PeerEvents], tx_between: Callable[[int, float, float], float]) -> RunFigures:
    """The figures of one run. `tx_between(i, t0, t1)`: bytes peer i's interface sent between two
    wall-clock times (nan when unknown)."""
    f = RunFigures()
    drivers = [p for p in peers if p.stage == 0]
    rates, up, down, samples_counted, link_u, comp_u, bottlenecks = [], 0.0, 0.0, 0, [], [], Counter()
    stage_link: dict[int, list[float]] = {}
    stage_mbps: dict[int, list[float]] = {}
    stage_comp: dict[int, list[float]] = {}
    for i, p in enumerate(peers):
        rounds = sorted(p.of("round"), key=lambda e: e["time"])
        if any(e.get("stage", p.stage) != p.stage for e in rounds) or any(e.get("moves") for e in p.of("stopped")) \
                or p.of("moved"):
            f.one_stage_each = False
            f.notes.append(f"peer {i} (started on stage {p.stage}) served another stage")
        counted = rounds[1:]
        f.compute_rate.append(_mean([e.get("rate", math.nan) for e in counted]))
        stage_comp.setdefault(p.stage, []).extend(e.get("utilisation", math.nan) for e in counted)
        if len(rounds) >= 2:
            t0, t1 = rounds[0]["time"], rounds[-1]["time"]
            sent = tx_between(i, t0, t1)
            stage_mbps.setdefault(p.stage, []).append(sent / (t1 - t0) / MBIT)
            if p.rate:
                stage_link.setdefault(p.stage, []).append(sent / (t1 - t0) / p.rate)
        if p.stage != 0:
            continue
        trained(rounds, [e["time"] for e in p.of("resynced")])
        f.samples += sum(e["trained"] for e in rounds)
        if len(rounds) < 2:
            f.notes.append(f"driver {i} reported {len(rounds)} round(s): no rate")
            continue
        rates.append(sum(e["trained"] for e in counted) / (rounds[-1]["time"] - rounds[0]["time"]))
        # the k-th pipeline event reports the trips since the (k-1)-th: skip the first, as the first round
        pipe = sorted(p.of("pipeline"), key=lambda e: e["time"])
        for prev, e in zip(pipe, pipe[1:]):
            dt = e["time"] - prev["time"]
            up += e["up_bytes_per_s"] * dt
            down += e["down_bytes_per_s"] * dt
            link_u.append(e["link_util"])
            comp_u.append(e["compute_util"])
            bottlenecks[e["bottleneck"]] += 1
        if len(pipe) >= 2:  # a round's event comes just before its pipeline event: pair them by time
            samples_counted += sum(e["trained"] for e in rounds if pipe[0]["time"] < e["time"] <= pipe[-1]["time"])
    f.samples_per_s = sum(rates) if rates and len(rates) == len(drivers) else math.nan
    f.link_util = {s: _mean(v) for s, v in sorted(stage_link.items())}
    f.up_mbps = {s: _mean(v) for s, v in sorted(stage_mbps.items())}
    f.compute_util = {s: _mean(v) for s, v in sorted(stage_comp.items())}
    f.driver_link_util, f.driver_compute_util = _mean(link_u), _mean(comp_u)
    f.bottleneck = bottlenecks.most_common(1)[0][0] if bottlenecks else ""
    if samples_counted:
        f.up_bytes_per_sample, f.down_bytes_per_sample = up / samples_counted, down / samples_counted
    f.incomplete_rounds = sum(1 for p in peers for e in p.of("round") if e.get("complete") is False)
    final_evals = [e for p in drivers for e in p.of("eval") if e.get("final")]
    f.lost = sum(e.get("lost", 0) for e in final_evals)
    f.retries = sum(e.get("retries", 0) for e in final_evals)
    for n, what in ((f.incomplete_rounds, "incomplete round(s)"), (f.lost, "microbatch(es) given up"),
                    (f.retries, "microbatch retries")):
        if n:
            f.notes.append(f"{n} {what}")
    finals = [e["val_loss"] for e in final_evals if e.get("val_loss") is not None]
    f.val_loss = _mean(finals)
    if len(finals) < len(drivers):
        f.notes.append(f"{len(drivers) - len(finals)} driver(s) without a final evaluation")
    f.losses = loss_curve(drivers)
    return f


def trained(rounds: list[dict[str, Any]], resyncs: Sequence[float]) -> None:
    """Set each round event's `trained`: the samples trained in that round. A round that did not
    complete carries its work (and its samples) into the next round's event unless the replica
    re-synced at its end (peer/rounds/runner.py: `_carried`; the `resynced` event comes before that
    round's `round` event), so such a next round trained its `samples` less the carried ones.
    `rounds` sorted by time."""
    carried, prev_t = 0, -math.inf
    for e in rounds:
        e["trained"] = max(0, e["samples"] - carried)
        resynced = any(prev_t < t <= e["time"] for t in resyncs)
        carried = e["samples"] if e.get("complete") is False and not resynced else 0
        prev_t = e["time"]


def loss_curve(drivers: Sequence[PeerEvents]) -> list[tuple[float, float]]:
    """Per round number: (seconds from the first `driving` event to the latest driver's event of
    that round, mean of the drivers' training losses in it); rounds not every driver reported are
    left out."""
    starts = [e["time"] for p in drivers for e in p.of("driving")]
    if not starts:
        return []
    start, by_round = min(starts), {}
    for p in drivers:
        for e in p.of("round"):
            if e.get("train_loss") is not None and math.isfinite(e["train_loss"]):
                by_round.setdefault(e["round"], []).append((e["time"], e["train_loss"]))
    return [(max(t for t, _ in v) - start, statistics.fmean(x for _, x in v))
            for _, v in sorted(by_round.items()) if len(v) == len(drivers)]


def time_to(losses: Sequence[tuple[float, float]], target: float) -> float:
    """Seconds until the first round whose mean training loss is at or below `target` (nan: never)."""
    return next((t for t, loss in losses if loss <= target), math.nan)


def final_train_loss(losses: Sequence[tuple[float, float]]) -> float:
    return losses[-1][1] if losses else math.nan


def fp32_boundary_bytes(seq_len: int, d_model: int) -> int:
    """Bytes per sample an fp32 boundary carries between two stages: the activations (seq_len ×
    d_model floats) forward and their gradient back; targets and framing not counted."""
    return 2 * 4 * seq_len * d_model


@dataclass(frozen=True)
class SlowShare:
    """The slow-replica goal's denominator, and what it is made of."""
    others: float
    """Samples/s of the same swarm without the slow replica (measured in its own run)."""
    link_limited: float
    """The slow replica's tbf rate / the boundary bytes per sample it must send (the stage-0 side
    sends activations, the stage-1 side their gradients), measured in the slow run."""
    compute: float
    """The slow replica's own announced compute rate (samples/s of its forward+backward)."""
    all_fast: float = math.nan
    """Samples/s of the same four peers with every link at the others' rate (nan: not run)."""

    @property
    def share(self) -> float:
        return min(self.link_limited, self.compute)

    @property
    def ideal(self) -> float:
        """What the others carry plus the slow replica's share, never above what four fast peers carried."""
        total = self.others + self.share
        return min(total, self.all_fast) if math.isfinite(self.all_fast) else total

    def ratio(self, swarm: float) -> float:
        return swarm / self.ideal if self.ideal > 0 else math.nan


def slow_share(others: float, slow_rate: float, bytes_per_sample: float, compute: float,
               all_fast: float = math.nan) -> SlowShare:
    link = slow_rate / bytes_per_sample if bytes_per_sample > 0 else math.inf
    return SlowShare(others, link, compute if math.isfinite(compute) and compute > 0 else math.inf, all_fast)


def verdict(ok: bool | None) -> str:
    return "" if ok is None else ("met" if ok else "not met")


def within(loss: float, reference: float, goal: float = LOSS_GOAL) -> bool | None:
    """Loss at most `goal` above the reference (relative); None when either is unknown."""
    if not (math.isfinite(loss) and math.isfinite(reference)):
        return None
    return loss <= reference * (1 + goal)
