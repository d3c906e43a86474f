"""The adaptive window (peer/pipeline/window.py), pure: Little's law over measured servers, its bounds,
the bottleneck it names, the estimator's summaries, the utilisation report and the memory bound."""
from __future__ import annotations

import math

import pytest

from swarmgrad.peer.pipeline.window import (COMPUTE, LINK, PipelineEstimator, PipelineMeasure, StepGaps, busy_rate, choose_window,
                                   memory_window, utilisation)

MB = 1 << 20


def measure(**kw: float | None) -> PipelineMeasure:
    base = dict(request_bytes=0.5 * MB, response_bytes=0.5 * MB, up_rate=2.5e6, down_rate=2.5e6, latency=0.05,
                local_compute=0.05, remote_compute=0.05)
    return PipelineMeasure(**{**base, **kw})  # type: ignore[arg-type]


def test_a_slow_link_needs_its_bandwidth_delay_product_in_flight() -> None:
    m = measure()
    c = choose_window(m, cap=64)
    up = 0.5 * MB / 2.5e6
    assert c.bottleneck == LINK and c.interval == pytest.approx(up)
    assert c.trip == pytest.approx(0.05 + up + 0.05 + 0.05 + up)
    assert c.needed == pytest.approx(c.trip / up)
    assert c.size == math.ceil(c.needed) + 1 and c.limited_by == "need"


def test_more_latency_asks_for_a_larger_window() -> None:
    sizes = [choose_window(measure(latency=lat), cap=1000).size for lat in (0.0, 0.1, 0.5, 2.0)]
    assert sizes == sorted(sizes) and sizes[-1] > sizes[0]


def test_a_fast_link_makes_compute_the_bottleneck_and_needs_few_in_flight() -> None:
    c = choose_window(measure(up_rate=1e9, down_rate=1e9, latency=0.001, local_compute=0.2, remote_compute=0.1),
                      cap=16)
    assert c.bottleneck == COMPUTE and c.interval == pytest.approx(0.2)
    # the trip is a little over the driver's compute + the next stage's: 2 in flight + 1 spare
    assert c.size == 3


def test_remote_compute_can_be_the_bottleneck() -> None:
    c = choose_window(measure(up_rate=1e9, down_rate=1e9, local_compute=0.01, remote_compute=0.3), cap=16)
    assert c.bottleneck == COMPUTE and c.interval == pytest.approx(0.3)


def test_the_cap_and_memory_bound_the_window() -> None:
    slow = measure(latency=5.0)
    assert choose_window(slow, cap=8).size == 8 and choose_window(slow, cap=8).limited_by == "cap"
    bounded = choose_window(slow, cap=8, memory_cap=3)
    assert bounded.size == 3 and bounded.limited_by == "memory"
    assert choose_window(slow, cap=8, memory_cap=0).size == 1  # one always fits: placement admitted us
    with pytest.raises(ValueError):
        choose_window(slow, cap=0)


def test_without_measurements_the_cap_probes() -> None:
    c = choose_window(PipelineEstimator().measure(), cap=5)
    assert c.size == 5 and c.limited_by == "cap" and math.isinf(c.needed)


def test_estimator_takes_medians_and_rates_over_busy_time() -> None:
    est = PipelineEstimator(window=8)
    for i in range(8):
        # one microbatch a second, each request taking 0.2 s of a 2.5 MB/s link and its answer 0.1 s
        est.observe_trip(request_bytes=500_000, response_bytes=250_000, trip_s=1.0, request_s=0.2,
                         response_s=0.1, serve_s=0.3, answered_at=10.0 + i)
        est.observe_compute(0.05 + 0.01 * i)
    m = est.measure()
    # the idle time between microbatches is not slowness
    assert m.up_rate == pytest.approx(500_000 / 0.2) and m.down_rate == pytest.approx(2.5e6)
    assert m.request_bytes == 500_000 and m.response_bytes == 250_000 and m.remote_compute == pytest.approx(0.3)
    assert m.latency == pytest.approx(1.0 - 0.2 - 0.3 - 0.1)
    assert m.local_compute == pytest.approx(0.09)  # the median of 0.05..0.12
    assert est.samples == 8


def test_overlapping_messages_share_the_link_and_buffered_ones_claim_no_more_than_it() -> None:
    """A link of 2.5 MB/s. Two 500 kB answers, the second starting 0.1 s after the first: they
    share the link while both are under way, and each takes 0.3 s (1.67 MB/s each). Then a 1 MB
    answer that shares its 0.5 s with a 250 kB one that waited whole in the buffers and is read
    in 20 ms (2 and 12.5 MB/s). Per message, a quantile said anything from 1.67 to 12.5 MB/s; over
    the busy time both say 2.5."""
    est = PipelineEstimator(window=32)
    for i in range(4):
        for offset in (0.0, 0.1):
            est.observe_trip(request_bytes=1000, response_bytes=500_000, trip_s=1.0, request_s=0.0,
                             response_s=0.3, serve_s=0.1, answered_at=i + offset)
    assert est.measure().down_rate == pytest.approx(2.5e6)
    est = PipelineEstimator(window=32)
    for i in range(4):
        est.observe_trip(request_bytes=1000, response_bytes=1_000_000, trip_s=1.0, request_s=0.0,
                         response_s=0.5, serve_s=0.1, answered_at=float(i))
        est.observe_trip(request_bytes=1000, response_bytes=250_000, trip_s=1.0, request_s=0.0,
                         response_s=0.02, serve_s=0.1, answered_at=i + 0.45)
    assert est.measure().down_rate == pytest.approx(2.5e6)


def test_request_spans_are_placed_before_the_serving_on_our_clock() -> None:
    """Requests sent back to back over one uplink, each reported read in 0.4 s: their spans,
    placed from the answers' arrival less the serving, do not overlap, so each one's rate is the
    link's; stacked on one another they would halve it."""
    est = PipelineEstimator()
    for i in range(6):
        serve = 0.05 + 0.1 * (i % 3)  # answers that took longer to serve arrived later
        est.observe_trip(request_bytes=1_000_000, response_bytes=1000, trip_s=2.0, request_s=0.4,
                         response_s=0.0, serve_s=serve, answered_at=0.4 * (i + 1) + serve)
    assert est.measure().up_rate == pytest.approx(2.5e6)
    assert busy_rate([]) is None and busy_rate([(1.0, 1.0, 10.0)]) is None
    assert busy_rate([(0.0, 1.0, 1.0), (0.2, 0.5, 1.0), (3.0, 4.0, 2.0)]) == pytest.approx(2.0)


def test_estimator_keeps_only_its_window_and_distrusts_claims_beyond_the_trip() -> None:
    est = PipelineEstimator(window=4)
    for _ in range(10):
        est.observe_trip(request_bytes=1000, response_bytes=1000, trip_s=1.0, request_s=0.5, response_s=0.2,
                         serve_s=0.1, answered_at=0.0)
    assert est.samples == 4
    # a peer claiming hours of serving cannot push the latency below 0 or the compute past the trip
    for _ in range(4):
        est.observe_trip(request_bytes=1000, response_bytes=1000, trip_s=1.0, request_s=0.0, response_s=0.0,
                         serve_s=3600.0, answered_at=0.0)
    m = est.measure()
    assert m.remote_compute == pytest.approx(1.0) and m.latency == 0.0
    est.observe_trip(request_bytes=1, response_bytes=1, trip_s=0.0, request_s=0.0, response_s=0.0, serve_s=0.0,
                     answered_at=0.0)
    assert est.samples == 4  # a trip of no length is no sample


def test_instant_transfers_do_not_claim_a_rate() -> None:
    est = PipelineEstimator()
    est.observe_trip(request_bytes=MB, response_bytes=MB, trip_s=0.01, request_s=1e-5, response_s=1e-5, serve_s=0.005,
                     answered_at=0.0)
    m = est.measure()
    assert m.up_rate is None and m.down_rate is None and m.up_s == 0.0
    assert choose_window(m, cap=4).bottleneck == COMPUTE


def test_utilisation_names_the_busier_resource() -> None:
    link_bound = utilisation(wall_s=10.0, up_bytes=24e6, down_bytes=10e6, up_rate=2.5e6, down_rate=2.5e6,
                             local_compute_s=3.0, remote_compute_s=4.0)
    assert link_bound.link == pytest.approx(0.96) and link_bound.compute == pytest.approx(0.4)
    assert link_bound.bottleneck == LINK
    compute_bound = utilisation(wall_s=10.0, up_bytes=1e6, down_bytes=1e6, up_rate=None, down_rate=None,
                                local_compute_s=9.0, remote_compute_s=20.0)
    assert compute_bound.link == 0.0 and compute_bound.compute == 1.0 and compute_bound.bottleneck == COMPUTE
    assert utilisation(wall_s=0.0, up_bytes=1, down_bytes=1, up_rate=1.0, down_rate=1.0, local_compute_s=1.0,
                       remote_compute_s=1.0).link == 0.0


def test_memory_window() -> None:
    assert memory_window(None, 100, 10) is None and memory_window(1000, 100, 0) is None
    assert memory_window(1000, 100, 100) == 9
    assert memory_window(150, 100, 100) == 1  # at least one


def test_driver_memory_window_from_the_stage_needs() -> None:
    from conftest import small_manifest

    from swarmgrad.peer.pipeline.driving_loop import driver_memory_window
    from swarmgrad.peer.placement.cost import stage_costs
    m = small_manifest(pipeline={"max_in_flight": 4})
    need = stage_costs(m)[0].memory
    # exactly what placement reserved for stage 0 holds max_in_flight microbatches; half of the
    # activations' share holds half as many; a huge offer is no bound worth the name
    assert driver_memory_window(m, need.total) == 4
    assert driver_memory_window(m, need.total - need.activations // 2) == 2
    assert driver_memory_window(m, 1 << 50) > 1000


def test_step_gaps_count_the_uplinks_wait_between_steps_within_a_round() -> None:
    g = StepGaps()
    g.starting(0, 0, 0.0)
    g.sent(0, 0, 0.5)
    g.starting(0, 0, 0.5)  # the same step: back to back, no wait
    g.sent(0, 0, 1.0)
    assert g.total == 0.0
    g.starting(1, 0, 1.4)  # the next step's first request, 0.4 s after the last one left
    g.sent(1, 0, 1.9)
    assert g.total == pytest.approx(0.4)
    g.starting(2, 1, 9.0)  # a round boundary in between: the round events account for it
    g.sent(2, 1, 9.5)
    assert g.total == pytest.approx(0.4)
    g.sent(1, 1, 9.6)  # a late request of an earlier step (a retry, or lookahead's order) does not move it back
    g.starting(3, 1, 9.7)
    assert g.total == pytest.approx(0.6)
    g.sent(3, 1, 10.0)
    g.starting(4, 1, 10.2)
    g.starting(4, 1, 10.9)  # the same request again (refused, retried): the wait was counted once
    assert g.total == pytest.approx(0.8)


def test_the_finer_microbatches_hint_only_where_the_waits_are_the_drivers_own() -> None:
    from swarmgrad.peer.pipeline.driving_loop import SHARED_CORE, STEP_GAP_HINT, pipeline_hint
    own = {"step_gap_share": 0.85, "core_share": 0.97}
    hint = pipeline_hint(own, 2, 16)
    assert hint is not None and "more, smaller microbatches per step shorten it" in hint and "now 2 × 16" in hint
    assert pipeline_hint({**own, "core_share": None}, 2, 16) == hint  # an accelerator: no core share
    # the demo: 4 peers on 2 cores, each compute thread on ~half a core; finer microbatches bought nothing
    shared = pipeline_hint({**own, "core_share": SHARED_CORE - 0.25}, 2, 16)
    assert shared is not None and "would not make the swarm faster here" in shared and "55% of a core" in shared
    assert pipeline_hint({**own, "step_gap_share": STEP_GAP_HINT - 0.01}, 2, 16) is None
    assert pipeline_hint(own, 32, 1) is None  # nothing finer to split into
