"""A round held for a joiner whose download outlasts a round (timeouts.join_hold, decisions.join_hold).

Over a link slower than a round, a donor that applied a round while a joiner downloaded its state
superseded the download every time: two replicas took 23-52 rounds to pair over 20 Mbit. Now a
replica whose state was downloaded holds its next boundary (worker paused, state still served,
nothing averaged) until the downloader is ONLINE with its digest, so the joiner's first round is
one the two average together.

Two whole-model drivers joined by a 1 Mbit link, where the state (~0.3 MB) takes ~2.5 s and a
round well under one: in one event loop over a paced loopback link (tests/support/swarm.py), and,
with `make test-slow` (SWARMGRAD_SLOW_TESTS=1), as real processes in network namespaces joined by
a tbf-shaped veth pair (skipped, with the reason, where namespaces cannot be made: not root, no
iproute2)."""
from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any, Iterator

import pytest

from swarmgrad.peer.manifest import TimeoutsConfig, dumps
from swarmgrad.peer.state.phase import Phase, ReplicaPhase
from swarmgrad.peer.state.sync import StateSync
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.framing import ProtocolError
from swarmgrad.protocol.validation import RunIdentity, envelope

from benchmarks.harness import netns
from conftest import small_manifest
from support.state import trained
from support.swarm import InProcessSwarm, LinkSpec
from support.swarm import assert_replicas_agree as replicas_agree
from test_swarm import assert_replicas_agree, round_history

WHY = netns.why_unavailable()
ID = RunIdentity("run", "h" * 32)


# --- serving while the boundary is held (one process) ------------------------------------------
def test_a_paused_replica_serves_its_state_only_while_it_holds_for_joiners() -> None:
    """At a boundary the worker is paused (phase AVERAGING): averaging is about to change the state,
    so a download is refused NOT_READY, unless the boundary is held for joiners (HOLDING: nothing
    averages then). A served download is remembered with the time of the peer's first request."""
    async def scenario() -> None:
        state = trained(seed=3)
        phase = ReplicaPhase()
        sync = StateSync(rpc=None, swarm=None, identity=ID, peer_id="me", stage=1, state=state,  # type: ignore[arg-type]
                         worker=None, clock=None, progress=None, events=None,  # type: ignore[arg-type]
                         phase=phase, timeouts=TimeoutsConfig(), max_numel=1 << 22)
        phase.enter(Phase.SERVING)
        phase.enter(Phase.AVERAGING)
        request = pb.StateRequest(envelope=envelope(ID, 1))
        with pytest.raises(ProtocolError) as refused:
            await sync.handle(request, "joiner")  # type: ignore[arg-type]
        assert refused.value.status == pb.NOT_READY and not sync.served
        phase.enter(Phase.HOLDING)
        resp = await sync.handle(request, "joiner")  # type: ignore[arg-type]
        assert resp.status == pb.OK and resp.state_digest == state.digest
        first = sync.served["joiner"]
        await sync.handle(request, "joiner")  # type: ignore[arg-type]
        assert sync.served == {"joiner": first}  # the hold counts from the first request
        sync.forget_served(["joiner", "nobody"])
        assert not sync.served

    asyncio.run(asyncio.wait_for(scenario(), 30))


# --- two drivers over a 1 Mbit link -------------------------------------------------------------
ONE_MBIT = LinkSpec(delay=0.001, bandwidth=1e6 / 8)
"""bytes/s of the namespace test's tbf 1mbit, with a millisecond of latency each way."""


def _check_first_round_paired(a_events: list[dict], b_events: list[dict], b_id: str, history: str) -> None:
    """What both versions of the test assert of A's and B's events."""
    loaded = [e for e in b_events if e["event"] == "state_loaded"]
    assert len(loaded) == 1 and not [e for e in b_events if e["event"] == "resynced"], \
        f"B's download was superseded\n{history}"
    holds = [e for e in a_events if e["event"] == "join_hold" and b_id in e["joiners"]]
    assert holds and b_id in holds[0]["joined"], f"A did not hold its boundary for B: {holds}\n{history}"
    # the joiner's first round, in the round its download said, is averaged with its donor
    first = [e for e in b_events if e["event"] == "round"][0]
    assert first["round"] == loaded[0]["round"], history
    assert first["complete"] and first["group_size"] == 2, f"B's first round was not with A\n{history}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_a_joiner_over_a_slow_link_pairs_in_its_first_round_in_process(inprocess, overlap: bool) -> None:
    """The namespace test below (test_a_joiner_over_a_slow_link_pairs_in_its_first_round, now only in
    `make test-slow`) over a loopback link paced at 1 Mbit: the same peers, manifest and assertions."""
    async def scenario() -> None:
        async with InProcessSwarm(_manifest(overlap)) as swarm:
            a = swarm.start(0, max_rounds=0)  # until stopped
            await swarm.wait_for(a, lambda e: e["event"] == "round" and e["round"] >= 3, 30, "A's third round alone")
            b = swarm.start(0, max_rounds=6, linger=5.0)
            swarm.set_link(a, b, ONE_MBIT)
            await swarm.wait_exit(40, [b])
            await swarm.stop(a)
            assert b.events("stopped")
            # the download really crossed the slow link: longer than a round alone took A
            loaded = b.events("state_loaded")[0]
            download_s = loaded["time"] - b.events("started")[0]["time"]
            assert download_s > 1.0, download_s
            _check_first_round_paired(a.events(), b.events(), b.peer_id, swarm.history())
            replicas_agree([a, b], 0)

    inprocess(scenario)


PORT = 31340


@pytest.fixture
def slow_net() -> Iterator[netns.WanNet]:
    netns.remove_stale()
    with netns.WanNet("jh", 2, rate="1mbit", subnet=242) as net:
        yield net


def _manifest(overlap: bool) -> Any:
    """Whole-model drivers, 2-step rounds (~0.1 s alone), the default timeouts.join_hold. With
    join_hold = 0 the joiner failed every round for the 2 minutes it was given (superseded)."""
    return small_manifest(stages={"count": 1}, rounds={"round_seconds": 0.0, "inner_steps": 2, "overlap": overlap},
                          data={"max_bytes": 300_000, "eval_every": 0, "eval_batches": 2})


@pytest.mark.skipif(WHY is not None, reason=f"no network namespaces: {WHY}")
@pytest.mark.skipif(not os.environ.get("SWARMGRAD_SLOW_TESTS"),
                    reason="real processes over a shaped link (~25 s each; the in-process version above runs by "
                           "default): set SWARMGRAD_SLOW_TESTS=1 or run `make test-slow`")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_a_joiner_over_a_slow_link_pairs_in_its_first_round(slow_net: netns.WanNet, tmp_path: Path,
                                                            overlap: bool) -> None:
    manifest = tmp_path / "manifest.toml"
    manifest.write_text(dumps(_manifest(overlap)))
    with netns.NetnsSwarm(manifest, tmp_path / "swarm", slow_net.endpoints, port=PORT) as swarm:
        a = swarm.start_first(0, "--max-rounds", "0")  # until stopped: B's start takes a while
        swarm.wait_for(a, lambda e: e["event"] == "round" and e["round"] >= 3, 60, "A's third round alone")
        b = swarm.start(0, "--max-rounds", "6", "--linger", "5")
        swarm.wait_for(b, lambda e: e["event"] == "stopped", 120, "B's end")
        a.signal(signal.SIGTERM)
        codes = swarm.wait_exit(30)
        history = round_history(swarm.peers, 0)
        logs = "\n".join(f"--- {p.name}\n{p.log_tail(15)}" for p in swarm.peers)
        assert codes == [0, 0], logs
    _check_first_round_paired(a.events(), b.events(), b.events("started")[0]["peer"], history)
    assert_replicas_agree([a, b], 0)
