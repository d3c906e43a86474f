"""How many microbatches a driver keeps in flight, and what limits its pipeline: pure decisions
over measurements, no network.

A microbatch's trip visits servers in turn: the driver's compute (its forward, later its
backward), its uplink (the request), the later stages' compute, the downlink (the answer), plus a
latency that is none of those (propagation, stream set-up). Each server takes some seconds per
microbatch; the slowest one sets the pipeline's rate, one microbatch every `interval` seconds.
By Little's law the pipeline runs at that rate only with trip / interval microbatches in flight:
fewer leave the bottleneck idle while a microbatch travels (the bandwidth-delay product, plus the
compute on the way), more only queue in front of it (activations held in memory, later answers,
longer deadlines) without one microbatch/s more. So the window is that ratio, rounded up, plus
one for jitter, within the manifest's cap (`pipeline.max_in_flight`) and what memory holds.

The driver measures (peer/pipeline/driver.py): bytes per request and answer and the time each took on the
link (the next stage reports how long our request took to arrive, first frame to last, and how
long it took to answer once it had it; we time the answer's arrival), and its own compute per
microbatch. A link's rate is the bytes of recent messages over the time that direction was busy
with at least one of them (the union of their spans, on our clock), not a per-message rate:
overlapping messages share the link and each sees a part of it, while a small message that
waited whole in the daemons' buffers is read in a blink and would claim more than the link
carries (tapered steps' 2-sample microbatches did: 4.7 MB/s over 2.5). The next stage's time per
microbatch is a low quantile of its answer times: an answer also counts the wait behind the
microbatches ahead of it there, which is queueing, not service.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

LINK, COMPUTE = "link", "compute"


@dataclass(frozen=True)
class PipelineMeasure:
    """Per-microbatch figures of one driver's pipeline (seconds, bytes, bytes/s)."""
    request_bytes: float
    response_bytes: float
    up_rate: float | None
    """Bytes/s our requests reached the next stage at (None: not measured yet)."""
    down_rate: float | None
    """Bytes/s the answers reached us at (None: not measured yet)."""
    latency: float
    """Seconds of a trip that were neither transfer nor compute."""
    local_compute: float
    """The driver's compute per microbatch (forward and backward)."""
    remote_compute: float
    """The later stages' time per microbatch, from the whole request read to the answer, without
    queueing (a low quantile of the answer times)."""

    @property
    def up_s(self) -> float:
        return self.request_bytes / self.up_rate if self.up_rate else 0.0

    @property
    def down_s(self) -> float:
        return self.response_bytes / self.down_rate if self.down_rate else 0.0


@dataclass(frozen=True)
class WindowChoice:
    size: int
    """Microbatches to keep in flight."""
    needed: float
    """trip / interval: what Little's law asks for before rounding and bounds."""
    interval: float
    """Seconds per microbatch of the slowest server: the pipeline's best rate is 1 / interval."""
    trip: float
    """Seconds one microbatch takes through an idle pipeline."""
    bottleneck: str
    """LINK or COMPUTE: the kind of the slowest server."""
    limited_by: str
    """"need", "cap" or "memory": what set `size`."""


def choose_window(m: PipelineMeasure, cap: int, memory_cap: int | None = None, slack: int = 1) -> WindowChoice:
    """The window for measurements `m`, at most `cap` (the manifest's max_in_flight) and
    `memory_cap` (microbatches whose activations fit; None: unknown), at least 1.

    Without any measurement (a fresh driver) the trip and interval are both 0: the cap is used,
    so the first microbatches probe the pipeline as a fixed window did."""
    if cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    servers = {COMPUTE: max(m.local_compute, m.remote_compute), LINK: max(m.up_s, m.down_s)}
    bottleneck = LINK if servers[LINK] > servers[COMPUTE] else COMPUTE
    interval = servers[bottleneck]
    trip = m.local_compute + m.up_s + m.latency + m.remote_compute + m.down_s
    if interval <= 0:
        needed, size, limited_by = math.inf, cap, "cap"
    else:
        needed = trip / interval
        size, limited_by = math.ceil(needed - 1e-9) + slack, "need"
        if size >= cap:
            size, limited_by = cap, "cap"
    if memory_cap is not None and size > max(1, memory_cap):
        size, limited_by = max(1, memory_cap), "memory"
    return WindowChoice(max(1, size), needed, interval, trip, bottleneck, limited_by)


@dataclass(frozen=True)
class Utilisation:
    link: float
    """The busier direction's bytes/s over its measured rate (0 when no rate is known)."""
    compute: float
    """The busier of the driver's compute and the later stages' (share of wall time, at most 1)."""
    bottleneck: str
    """LINK or COMPUTE, whichever is busier."""


def utilisation(*, wall_s: float, up_bytes: float, down_bytes: float, up_rate: float | None,
                down_rate: float | None, local_compute_s: float, remote_compute_s: float) -> Utilisation:
    """How busy the link and the compute were over `wall_s` seconds, from what moved and ran then.

    `remote_compute_s`: the later stages' service time summed over the microbatches they
    answered in the window (trips × PipelineMeasure.remote_compute)."""
    if wall_s <= 0:
        return Utilisation(0.0, 0.0, COMPUTE)
    link = max(up_bytes / wall_s / up_rate if up_rate else 0.0, down_bytes / wall_s / down_rate if down_rate else 0.0)
    compute = min(1.0, max(local_compute_s, remote_compute_s) / wall_s)
    link = min(1.0, link)
    return Utilisation(link, compute, LINK if link > compute else COMPUTE)


def busy_rate(transfers: Iterable[tuple[float, float, float]]) -> float | None:
    """Bytes per second over the time at least one transfer was under way: `transfers` are
    (start, end, bytes) on one clock. Overlapping transfers share a link, so their union, not
    the sum of their spans, is the time the bytes took; the gaps between them were idle, not
    slow. None for no transfer or no time."""
    total, busy, reach = 0.0, 0.0, -math.inf
    for start, end, size in sorted(transfers):
        total += size
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return total / busy if busy > 0 else None


def _quantile(values: deque, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class PipelineEstimator:
    """Recent per-microbatch samples, summarised as a PipelineMeasure (medians; link rates over
    their busy time, see busy_rate; the next stage's service at the 10th percentile). `window`
    samples are kept of each figure."""
    window: int = 32
    min_transfer_s: float = 1e-3
    """A transfer shorter than this says nothing about a rate (an unshaped link): not sampled."""
    _request: deque = field(default_factory=deque)
    _response: deque = field(default_factory=deque)
    _up: deque = field(default_factory=deque)
    _down: deque = field(default_factory=deque)
    _latency: deque = field(default_factory=deque)
    _remote: deque = field(default_factory=deque)
    _local: deque = field(default_factory=deque)

    def _add(self, samples: deque, value: float) -> None:
        samples.append(value)
        while len(samples) > self.window:
            samples.popleft()

    @property
    def samples(self) -> int:
        return len(self._latency)

    def observe_trip(self, *, request_bytes: int, response_bytes: int, trip_s: float, request_s: float,
                     response_s: float, serve_s: float, answered_at: float) -> None:
        """One answered microbatch: bytes each way, the whole trip (request started to answer
        read), the request's arrival span as the next stage reported it, the answer's arrival
        span as we read it, the next stage's answer time, and when the answer's first frame
        reached us (our monotonic clock). Reported times are clamped to the trip (a peer's claim
        cannot make a trip longer than we saw).

        The request's span is placed on our clock just before the serving that preceded the
        answer; that omits the answer's one-way latency, which shifts every request alike and so
        leaves the overlaps, and the busy time, as they were."""
        if not trip_s > 0:
            return
        request_s, serve_s = min(max(0.0, request_s), trip_s), min(max(0.0, serve_s), trip_s)
        response_s = min(max(0.0, response_s), trip_s)
        self._add(self._request, float(request_bytes))
        self._add(self._response, float(response_bytes))
        if request_s >= self.min_transfer_s:
            read_at = answered_at - serve_s
            self._add(self._up, (read_at - request_s, read_at, float(request_bytes)))
        if response_s >= self.min_transfer_s:
            self._add(self._down, (answered_at, answered_at + response_s, float(response_bytes)))
        self._add(self._remote, serve_s)
        self._add(self._latency, max(0.0, trip_s - request_s - serve_s - response_s))

    def observe_compute(self, seconds_per_microbatch: float) -> None:
        if seconds_per_microbatch >= 0:
            self._add(self._local, seconds_per_microbatch)

    def measure(self) -> PipelineMeasure:
        med = lambda d: _quantile(d, 0.5) if d else 0.0  # noqa: E731
        return PipelineMeasure(
            request_bytes=med(self._request), response_bytes=med(self._response),
            up_rate=busy_rate(self._up), down_rate=busy_rate(self._down),
            latency=med(self._latency), local_compute=med(self._local),
            remote_compute=_quantile(self._remote, 0.1) if self._remote else 0.0)


@dataclass
class StepGaps:
    """Seconds the uplink waited between inner steps: from the moment one step's last request was
    on the wire to the moment the next step's first request went out, within a round. Exact steps
    cost that much each (the last answer, the driver's backward and step, the next forward), however
    wide the window: neither the link nor the compute can be saturated across it, and more, smaller
    microbatches per step are what shorten it. Round boundaries are not counted (the round events
    report those). Requests go out one at a time (the driver's send slot), in step order."""
    total: float = 0.0
    _step: int | None = None
    _round: int | None = None
    _sent_at: float = 0.0

    def starting(self, step: int, round_no: int, now: float) -> None:
        """A request of inner step `step` (the worker's step count) of `round` takes the link now."""
        if self._step is not None and step > self._step and round_no == self._round:
            self.total += max(0.0, now - self._sent_at)
            self._step, self._sent_at = step, now  # once per step: a retry of this request adds nothing

    def sent(self, step: int, round_no: int, now: float) -> None:
        """That request is on the wire."""
        if self._step is None or (round_no, step) >= (self._round, self._step):
            self._step, self._round, self._sent_at = step, round_no, now


def memory_window(offered_bytes: int | None, fixed_bytes: int, activation_bytes_per_microbatch: int) -> int | None:
    """Microbatches in flight whose activations fit in what a peer offers, after its stage's
    fixed needs (weights, θ_global, optimiser states, gradients). None when either is unknown;
    at least 1 (placement admitted the peer to the stage, so one microbatch fits)."""
    if not offered_bytes or activation_bytes_per_microbatch <= 0:
        return None
    return max(1, (offered_bytes - fixed_bytes) // activation_bytes_per_microbatch)
