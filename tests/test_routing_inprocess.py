"""Measured routing wired into real peers in one event loop (tests/support/swarm.py): a driver and
two stage-1 replicas, one of them behind a link 40× slower. The driver's `Downstream` measures
each replica from its own answers and sends the slow one only what it can take; every microbatch
is trained exactly once (the replicas' committed ids) and the replicas agree after every round."""
from __future__ import annotations

from collections import Counter

import pytest

from support.swarm import InProcessSwarm, LinkSpec, assert_replicas_agree, step_manifest

pytestmark = pytest.mark.timeout(120)

FAST = LinkSpec(delay=0.005)
SLOW = LinkSpec(delay=0.005, bandwidth=40_000)
"""A microbatch's 8 kB of fp16 activations (4 × 32 × 32) take 0.2 s each way: 40× the fast link."""


def test_the_driver_sends_a_replica_behind_a_slow_link_only_what_it_takes(inprocess) -> None:
    manifest = step_manifest(4, inner={"microbatch_size": 4, "microbatches_per_step": 4},
                             pipeline={"max_in_flight": 4, "routing": "measured"})

    async def scenario() -> None:
        async with InProcessSwarm(manifest, link=FAST) as swarm:
            fast = swarm.start(1, max_rounds=6)
            slow = swarm.start(1, max_rounds=6)
            driver = swarm.start(0, max_rounds=6)
            swarm.set_link(driver, slow, SLOW)
            await swarm.wait_exit(90)
            history = swarm.history()
            assert all(p.events("stopped") for p in swarm.peers), history
            assert_replicas_agree(swarm.peers, 1)
            committed = {p.name: [c for e in p.events("round") for c in e["committed"]] for p in (fast, slow)}
            every = committed[fast.name] + committed[slow.name]
            assert len(every) == len(set(every)), "a microbatch trained twice"  # exactly once
            # measured, it gets the microbatches sent before anything was measured and a probe at a
            # time until its first answer (pipeline.routing = "announced" gave it 8 of 64 in 4 rounds,
            # a share that does not shrink with the run)
            counts = Counter({k: len(v) for k, v in committed.items()})
            assert counts[slow.name] <= 6 and counts[slow.name] / len(every) < 0.1, (counts, history)
            assert not driver.events("lost"), history
            # the driver's reports say where its microbatches went and what it measured of each
            reports = [e["routes"] for e in driver.events("pipeline")]
            assert reports and all(abs(sum(r["share"] for r in routes.values()) - 1) < 0.01 for routes in reports)
            # its 8 kB messages arrive in one piece, so no link rate is measured, but its trips are 20× longer
            s, f = slow.peer_id[-8:], fast.peer_id[-8:]
            both = [r for r in reports if s in r and f in r]
            assert both and all(r[s]["trip_s"] > 5 * r[f]["trip_s"] for r in both), reports

    inprocess(scenario)


def test_forward_first_trains_every_microbatch_once_and_replicas_agree(inprocess) -> None:
    """pipeline.forward_first reorders each replica's compute thread (forwards before waiting
    backwards): two drivers and two stage-1 replicas still train each microbatch once, and each
    stage's replicas hold one θ_global after every round."""
    manifest = step_manifest(3, inner={"microbatch_size": 4, "microbatches_per_step": 4},
                             pipeline={"max_in_flight": 4, "forward_first": True, "routing": "measured"})

    async def scenario() -> None:
        async with InProcessSwarm(manifest, link=FAST) as swarm:
            servers = [swarm.start(1, max_rounds=4) for _ in range(2)]
            drivers = [swarm.start(0, max_rounds=4) for _ in range(2)]
            await swarm.wait_exit(90)
            history = swarm.history()
            assert all(p.events("stopped") for p in swarm.peers), history
            for stage in (0, 1):
                assert_replicas_agree(swarm.peers, stage)
            committed = [c for p in servers for e in p.events("round") for c in e["committed"]]
            assert committed and len(committed) == len(set(committed)), "a microbatch trained twice"
            assert not any(d.events("lost") for d in drivers), history

    inprocess(scenario)
