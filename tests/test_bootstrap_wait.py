"""--bootstrap-wait: a peer launched with the one it joins through comes up in any order. The retry
rule against a fake start (no network), and once against a real p2pd whose initial peer never
answers, leaving none of its sockets behind (benchmarks/wan.py's smoke run, tests/test_wan_smoke.py, starts real peers together)."""
from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from swarmgrad.peer.cli.peer import BOOTSTRAP_RETRY_S, is_bootstrap_failure, start_dht, start_dht_waiting

pytestmark = pytest.mark.timeout(90)

PEER = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWGy1KgUuMX23UPCJDvF3HqUy7t3Sq8ueaRgEXZva3yCqx"
P2PD = "Daemon failed to start: 2026/12/02 16:21:46 failed to connect to bootstrap peers"
HIVEMIND = "DHTNode bootstrap failed: none of the initial_peers responded to a ping."


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def failing(errors: list[Exception], then: object = "dht") -> tuple[list[int], object]:
    calls: list[int] = []

    def start() -> object:
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return then
    return calls, start


def test_both_bootstrap_failures_are_recognised() -> None:
    assert is_bootstrap_failure(RuntimeError(P2PD)) and is_bootstrap_failure(RuntimeError(HIVEMIND))
    assert not is_bootstrap_failure(RuntimeError("p2pd runs as X, not as the identity key's Y"))


def test_a_peer_that_comes_up_late_is_waited_for() -> None:
    clock = Clock()
    calls, start = failing([RuntimeError(P2PD), RuntimeError(HIVEMIND)])
    assert start_dht_waiting(start, [PEER], 30.0, clock=clock, sleep=clock.sleep) == "dht"
    assert len(calls) == 3 and clock.sleeps == [BOOTSTRAP_RETRY_S] * 2


def test_the_wait_is_bounded_and_the_last_failure_is_raised() -> None:
    clock = Clock()
    calls, start = failing([RuntimeError(P2PD)] * 100)
    with pytest.raises(RuntimeError, match="bootstrap peers"):
        start_dht_waiting(start, [PEER], 5.0, clock=clock, sleep=clock.sleep)
    assert clock.sleeps == [2.0, 2.0, 1.0] and len(calls) == 4  # never past the deadline


def test_other_failures_and_a_new_swarm_are_not_retried() -> None:
    for peers, error in (([PEER], RuntimeError("p2pd runs as X, not as the identity key's Y")),
                         ([], RuntimeError(P2PD)), ([PEER], ValueError("bad multiaddr"))):
        clock = Clock()
        calls, start = failing([error])
        with pytest.raises(type(error)):
            start_dht_waiting(start, peers, 30.0, clock=clock, sleep=clock.sleep)
        assert len(calls) == 1 and clock.sleeps == []


def _dead_sockets() -> set[Path]:
    """p2pd control sockets in /tmp that nobody listens on (other programs' live daemons are not
    this test's)."""
    dead = set()
    for path in Path("/tmp").glob("hivemind-p2p*.sock"):
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(1.0)
                probe.connect(str(path))
        except ConnectionRefusedError:
            dead.add(path)
        except OSError:
            continue
    return dead


def test_a_real_start_retries_then_says_why(p2p_daemons: None, capsys: pytest.CaptureFixture[str]) -> None:
    """Nothing listens at the initial peer's address: p2pd refuses to start each time; after
    `bootstrap_wait` the error is raised, and each retry was said on stderr."""
    import hivemind  # noqa: F401  (imported before the clock starts: on a busy machine the import alone took 8 s)
    wait = 4.0  # an attempt takes ~1 s: at least one retry
    before = _dead_sockets()
    started = time.monotonic()
    with pytest.raises(Exception) as e:
        start_dht([PEER], ["/ip4/127.0.0.1/tcp/0"], [], None, 15.0, bootstrap_wait=wait)
    assert is_bootstrap_failure(e.value), e.value
    assert time.monotonic() - started >= wait
    assert capsys.readouterr().err.count("none of --initial-peers answered yet") >= 1
    left = _dead_sockets() - before
    assert not left, f"failed attempts left p2pd's sockets behind: {left}"
