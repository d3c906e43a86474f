"""StateSync.resync after a failed round, against a fake swarm view (no network): the outcome
votes (peer/averaging/averager.py) decide whether there is a donor to wait for; and what the round runner
announces while a stale replica re-syncs."""
from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from swarmgrad.peer.averaging.averager import RoundResult
from swarmgrad.peer.averaging.group import group_hash
from swarmgrad.peer.averaging.outcome import vote
from swarmgrad.peer.manifest import TimeoutsConfig
from swarmgrad.peer.net.errors import RPCFailed, SwarmUnavailable
from swarmgrad.peer.rounds.runner import RoundRunner
from swarmgrad.peer.state.phase import Phase, ReplicaPhase
from swarmgrad.peer.state.stage_state import CheckpointError
from swarmgrad.peer.state.sync import StateSync
from swarmgrad.peer.records import JOINING, LEAVING, ONLINE

from support.records import rec


class Swarm:
    def __init__(self, votes: dict[str, str], records: list[Any], abandoned: dict[str, str] | None = None):
        self.votes, self.records = votes, records
        self.abandoned = dict(abandoned or {})
        self.record_reads = 0

    async def round_checks(self, stage: int, round_no: int) -> dict[str, str]:
        return dict(self.votes)

    async def post_abandoned(self, stage: int, round_no: int, peer_id: str, group_hash: str) -> bool:
        self.abandoned[peer_id] = group_hash
        return True

    async def round_abandoned(self, stage: int, round_no: int) -> dict[str, str]:
        return dict(self.abandoned)

    async def stage_records(self, stage: int) -> list[Any]:
        self.record_reads += 1
        return list(self.records)

    async def swarm(self) -> dict[int, list[Any]]:
        return {1: list(self.records)}


def sync(swarm: Swarm, downloads: list[list[str]]) -> StateSync:
    s = StateSync(rpc=None, swarm=swarm, identity=None, peer_id="a", stage=1,  # type: ignore[arg-type]
                  state=SimpleNamespace(applied_rounds=5, digest="d"), worker=None, clock=SimpleNamespace(current=7),  # type: ignore[arg-type]
                  progress=None, events=SimpleNamespace(emit=lambda *a, **k: None),  # type: ignore[arg-type]
                  phase=ReplicaPhase(), timeouts=TimeoutsConfig(matchmaking=1.0, allreduce=2.0), max_numel=0)

    async def download(peers: list[str], expected: object = None) -> bool:
        downloads.append(list(peers))
        return True

    s.download = download  # type: ignore[method-assign]
    return s


def test_a_round_every_member_voted_failed_needs_no_wait() -> None:
    """Before the votes, every failed round waited here for the other members to announce a later
    round, which they only do after their own wait: seconds of stall on every member."""
    g = group_hash(("a", "b"))
    swarm = Swarm({"a": vote(g, None), "b": vote(g, None)}, [rec("a", round_no=7, applied=5), rec("b", round_no=7, applied=5)])
    downloads: list[list[str]] = []
    result = RoundResult(False, "part 0: stream ended", ("a", "b"), None)
    assert asyncio.run(sync(swarm, downloads).resync(7, result)) is False
    assert swarm.record_reads == 0 and not downloads


def test_a_member_that_voted_its_digest_takes_the_state_of_one_that_applied() -> None:
    g = group_hash(("a", "b"))
    swarm = Swarm({"a": vote(g, "m1"), "b": vote(g, "m1")},
                  [rec("a", round_no=7, applied=5), rec("b", round_no=8, applied=6, digest="e")])
    downloads: list[list[str]] = []
    result = RoundResult(False, "outcome vote: 1 member(s) posted no vote", ("a", "b"), None, voted_digest=True)
    assert asyncio.run(sync(swarm, downloads).resync(7, result)) is True
    assert downloads == [["b"]]


def test_a_group_that_excluded_us_may_have_applied_the_round() -> None:
    """Seen in a soak: matchmaking views differed, our group of three failed (its reducer refused us
    as GROUP_MISMATCH) while the two others completed as a group of two. Our own failed vote proves
    nothing about them: wait for them as donors, at once, instead of a round later as 'stale'."""
    ours, theirs = group_hash(("a", "b", "c")), group_hash(("b", "c"))
    swarm = Swarm({"a": vote(ours, None), "b": vote(theirs, "m1"), "c": vote(theirs, "m1")},
                  [rec("a", round_no=7, applied=5), rec("b", round_no=8, applied=6, digest="e"),
                   rec("c", round_no=8, applied=6, digest="e")])
    downloads: list[list[str]] = []
    result = RoundResult(False, "part 1 refused by b: GROUP_MISMATCH", ("a", "b", "c"), None)
    assert asyncio.run(sync(swarm, downloads).resync(7, result)) is True
    assert downloads == [["b"]]


def test_members_left_by_a_member_that_died_before_its_vote_settle_at_once() -> None:
    """Seen in the chaos soak: c was killed between the exchange and its vote, so a and b, who voted
    the same digest, both failed on the missing vote and re-synced, each waiting for the other to
    announce a later round, which it does only once its own wait is over: 11 s of stall on both,
    after which each kept its state anyway. Now each says it abandoned the round, and c, whose vote
    nobody could read by the end of the vote wait, is not waited for."""
    g = group_hash(("a", "b", "c"))
    records = [rec("a", round_no=7, applied=5), rec("b", round_no=7, applied=5), rec("c", round_no=7, applied=5)]
    swarm = Swarm({"a": vote(g, "m1"), "b": vote(g, "m1")}, records, abandoned={"b": g})
    downloads: list[list[str]] = []
    result = RoundResult(False, "outcome vote: 1 member(s) posted no vote", ("a", "b", "c"), None, voted_digest=True)
    assert asyncio.run(sync(swarm, downloads).resync(7, result)) is False
    assert swarm.record_reads == 1 and not downloads
    assert swarm.abandoned["a"] == g, "a tells the others it did not apply the round"


def test_a_member_that_voted_its_digest_and_said_nothing_more_is_waited_for() -> None:
    """b voted the same digest and has neither abandoned the round nor announced a later one: it
    may have read c's vote and applied, so a waits (the whole wait, here) for it to become a donor."""
    g = group_hash(("a", "b", "c"))
    records = [rec("a", round_no=7, applied=5), rec("b", round_no=7, applied=5), rec("c", round_no=7, applied=5)]
    swarm = Swarm({"a": vote(g, "m1"), "b": vote(g, "m1")}, records)
    downloads: list[list[str]] = []
    result = RoundResult(False, "outcome vote: 1 member(s) posted no vote", ("a", "b", "c"), None, voted_digest=True)
    assert asyncio.run(sync(swarm, downloads).resync(7, result)) is False
    assert swarm.record_reads >= 3 and not downloads
    # and had b applied it, a would have taken b's state
    swarm = Swarm({"a": vote(g, "m1"), "b": vote(g, "m1")},
                  [rec("a", round_no=7, applied=5), rec("b", round_no=8, applied=6, digest="e")])
    assert asyncio.run(sync(swarm, downloads).resync(7, result)) is True
    assert downloads == [["b"]]


class Flaky(Swarm):
    """A swarm view whose reads and writes named in `failing` raise `error`; `stage_records` fails
    its first `record_failures` reads (all of them if None) when it is named."""

    def __init__(self, votes: dict[str, str], records: list[Any], error: Exception, failing: set[str],
                 record_failures: int | None = None):
        super().__init__(votes, records)
        self.error, self.failing, self.record_failures = error, failing, record_failures

    def _check(self, name: str) -> None:
        if name in self.failing:
            raise self.error

    async def round_checks(self, stage: int, round_no: int) -> dict[str, str]:
        self._check("round_checks")
        return await super().round_checks(stage, round_no)

    async def post_abandoned(self, stage: int, round_no: int, peer_id: str, group_hash: str) -> bool:
        self._check("post_abandoned")
        return await super().post_abandoned(stage, round_no, peer_id, group_hash)

    async def round_abandoned(self, stage: int, round_no: int) -> dict[str, str]:
        self._check("round_abandoned")
        return await super().round_abandoned(stage, round_no)

    async def stage_records(self, stage: int) -> list[Any]:
        if "stage_records" in self.failing and (self.record_failures is None or self.record_failures > 0):
            self.record_reads += 1
            if self.record_failures is not None:
                self.record_failures -= 1
            raise self.error
        return await super().stage_records(stage)

    async def swarm(self) -> dict[int, list[Any]]:
        self._check("swarm")
        return {1: list(self.records)}


SYNC_LOG = "swarmgrad.peer.state.sync"


def logged(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == SYNC_LOG]


def test_a_resync_reads_past_the_networks_failures_and_warns_once_each(caplog: pytest.LogCaptureFixture) -> None:
    """Votes unreadable, the abandon unsaid, the records unreadable twice: the re-sync goes on
    without each (no votes: wait for a donor) and takes b's state once the records come back."""
    g = group_hash(("a", "b"))
    swarm = Flaky({"a": vote(g, None)}, [rec("a", round_no=7, applied=5), rec("b", round_no=8, applied=6, digest="e")],
                  SwarmUnavailable("reading run/round/1/7/check: no answer within 10s"),
                  {"round_checks", "post_abandoned", "stage_records"}, record_failures=2)
    downloads: list[list[str]] = []
    result = RoundResult(False, "part 0: stream ended", ("a", "b"), None)
    with caplog.at_level(logging.DEBUG, logger=SYNC_LOG):
        assert asyncio.run(sync(swarm, downloads).resync(7, result)) is True
    assert downloads == [["b"]] and swarm.record_reads == 3
    log = logged(caplog)
    warnings = [m for level, m in log if level == logging.WARNING]
    assert len(warnings) == 3, log  # votes, abandon, records: each once
    assert any("reading a failed round's votes" in m and "no answer within 10s" in m for m in warnings)
    assert any("saying a failed round was abandoned" in m for m in warnings)
    assert any("reading the stage's records to re-sync" in m for m in warnings)
    assert [level for level, m in log if "to re-sync" in m] == [logging.WARNING, logging.DEBUG, logging.INFO]


@pytest.mark.parametrize("failing", ["round_checks", "post_abandoned", "stage_records", "round_abandoned"])
def test_a_bug_in_a_resync_read_propagates(failing: str) -> None:
    """A TypeError is ours, not the network's: it is not read as 'the DHT did not answer'."""
    g = group_hash(("a", "b", "c"))
    records = [rec("a", round_no=7, applied=5), rec("b", round_no=7, applied=5), rec("c", round_no=7, applied=5)]
    swarm = Flaky({"a": vote(g, "m1"), "b": vote(g, "m1")}, records, TypeError("a refactoring's bug"), {failing})
    result = RoundResult(False, "outcome vote: 1 member(s) posted no vote", ("a", "b", "c"), None, voted_digest=True)
    with pytest.raises(TypeError):
        asyncio.run(sync(swarm, []).resync(7, result))


def test_a_joiner_that_cannot_re_read_the_records_keeps_its_download(caplog: pytest.LogCaptureFixture) -> None:
    down = Flaky({}, [], SwarmUnavailable("reading run/stage/1: no answer within 10s"), {"stage_records"})
    with caplog.at_level(logging.DEBUG, logger=SYNC_LOG):
        assert asyncio.run(sync(down, [])._superseded()) is None  # no quorum to download again from
    assert [level for level, _ in logged(caplog)] == [logging.WARNING]
    bug = Flaky({}, [], TypeError("a refactoring's bug"), {"stage_records"})
    with pytest.raises(TypeError):
        asyncio.run(sync(bug, [])._superseded())


@pytest.mark.parametrize("error", [RPCFailed("the coordinator's checkpoint of stage 1: CoordinatorUnavailable"),
                                   CheckpointError("its tensors are not this stage's")])
def test_an_empty_stage_without_its_checkpoint_restores_nothing(error: Exception) -> None:
    """The coordinator did not answer or sent something unusable: no restore, and the seed is no
    fallback (`_checkpoint_unknown`: the joiner waits for the coordinator)."""
    async def failing(stage: int) -> None:
        raise error

    s = sync(Swarm({}, []), [])
    s.checkpoints = failing  # type: ignore[assignment]
    assert asyncio.run(s.restore_backup()) is False
    assert s._checkpoint_unknown


def test_an_unreadable_swarm_leaves_the_checkpoint_and_bugs_propagate(caplog: pytest.LogCaptureFixture) -> None:
    async def none(stage: int) -> None:
        return None

    async def buggy(stage: int) -> None:
        raise TypeError("a refactoring's bug")

    s = sync(Flaky({}, [], SwarmUnavailable("reading run/stage/0: no answer within 10s"), {"swarm"}), [])
    s.checkpoints = none  # type: ignore[assignment]
    with caplog.at_level(logging.DEBUG, logger=SYNC_LOG):
        assert asyncio.run(s.restore_backup()) is False  # nothing to restore, and known to be nothing
    assert not s._checkpoint_unknown
    assert [(level, "reading the swarm to find backups" in m) for level, m in logged(caplog)] == [(logging.WARNING, True)]
    for swarm, checkpoints in ((Flaky({}, [], TypeError("a refactoring's bug"), {"swarm"}), none),
                               (Swarm({}, []), buggy)):
        s = sync(swarm, [])
        s.checkpoints = checkpoints  # type: ignore[assignment]
        with pytest.raises(TypeError):
            asyncio.run(s.restore_backup())


class Presence:
    """What the runner's presence record announces: the phase's status, at each store."""
    def __init__(self, phase: ReplicaPhase) -> None:
        self.phase = phase
        self.announced: list[str] = []

    @property
    def status(self) -> str:
        return self.phase.status

    async def announce(self) -> bool:
        self.announced.append(self.status)
        return True


class Resync:
    """StateSync.resync's stand-in: records the status our record had while it ran."""
    def __init__(self, presence: Presence, outcome: bool) -> None:
        self.presence, self.outcome = presence, outcome
        self.seen: list[str] = []

    async def resync(self, round_no: int, result: RoundResult, overlapped: bool = False) -> bool:
        self.seen.append(self.presence.status)
        return self.outcome


def runner_resync(status: str, result: RoundResult, outcome: bool) -> tuple[bool, Presence, Resync]:
    """The runner's _resync in a round (phase AVERAGING) whose record says `status`."""
    phase = ReplicaPhase()
    phase.enter(Phase.SERVING)
    phase.enter(Phase.AVERAGING)  # a failed round ends at its boundary, worker paused
    if status == LEAVING:
        phase.enter(Phase.LEAVING)
    assert phase.status == status
    presence = Presence(phase)
    sync_ = Resync(presence, outcome)
    runner = RoundRunner.__new__(RoundRunner)  # only what _resync touches
    runner.presence, runner.sync, runner.phase = presence, sync_, phase  # type: ignore[assignment]
    done = asyncio.run(runner._resync(7, result))
    if status != LEAVING:
        assert phase.current is Phase.AVERAGING, "back to the phase the re-sync interrupted"
    return done, presence, sync_


def test_a_stale_replica_is_joining_while_it_resyncs() -> None:
    """Its ONLINE record would keep the others' matchmaking waiting for it (every ONLINE replica
    must register) while they refuse it the state it waits for: announce JOINING first, and be
    ONLINE again afterwards (stored with the round's report)."""
    stale = RoundResult(False, "b already applied this round without us: our θ_global is superseded", ("b",), None,
                        stale=True)
    for outcome in (True, False):
        done, presence, sync_ = runner_resync(ONLINE, stale, outcome)
        assert done is outcome and sync_.seen == [JOINING] and presence.announced == [JOINING]
        assert presence.status == ONLINE


def test_a_failed_round_that_was_not_stale_stays_online() -> None:
    """Every member failed together (a lost part, a refused vote): each may be a donor or in the
    next group, so nothing is announced."""
    failed = RoundResult(False, "part 0: stream ended", ("a", "b"), None)
    done, presence, sync_ = runner_resync(ONLINE, failed, True)
    assert done and sync_.seen == [ONLINE] and presence.announced == []


def test_a_leaving_replica_stays_leaving() -> None:
    stale = RoundResult(False, "superseded", ("b",), None, stale=True)
    _, presence, sync_ = runner_resync(LEAVING, stale, True)
    assert sync_.seen == [LEAVING] and presence.announced == [] and presence.status == LEAVING
