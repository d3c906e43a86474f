"""Overlapped rounds (peer/rounds/overlap.py) in one process: the round runner with a real worker and
stage state, and an in-memory group of two replicas in place of the network averager.

What must hold: the worker trains while the mean travels; both replicas end each round with the
same θ_global, the plain round's θ_global; θ_local lands on θ_global_new + the progress since
the snapshot; a mean that arrives before any inner step gives the plain round's result bit for
bit; a round that applied nothing carries its samples; a re-sync keeps the progress; the lr
schedule counts the samples in flight; utilisation is reported in both modes; with
rounds.overlap_steps the worker trains that many steps and then waits for the mean.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from swarmgrad.peer.evidence import EvidenceLedger
from swarmgrad.peer.rounds import overlap
from swarmgrad.peer.averaging.averager import RoundResult
from swarmgrad.peer.clock import RoundClock
from swarmgrad.peer.events import EventLog
from swarmgrad.peer.manifest import InnerOptConfig, OuterOptConfig, RoundsConfig, ScheduleConfig, TimeoutsConfig
from swarmgrad.peer.records import ReplicaStats
from swarmgrad.peer.rounds.runner import RoundRunner
from swarmgrad.peer.net.rpc import Traffic
from swarmgrad.peer.compute.schedule import TrainingProgress
from swarmgrad.peer.state.phase import Phase, ReplicaPhase
from swarmgrad.peer.state.stage_state import StageState
from swarmgrad.peer.compute.worker import NotReady, StageWorker

pytestmark = pytest.mark.timeout(60)

H = 2


# --- the pure pieces ---------------------------------------------------------------------------
def test_rebase_keeps_the_progress_since_the_snapshot() -> None:
    torch.manual_seed(0)
    module = nn.Linear(3, 2)
    anchor = overlap.snapshot_local(module)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p))  # progress made after the snapshot
    progress = {n: p.detach() - anchor[n] for n, p in module.named_parameters()}
    new_global = {n: torch.randn_like(a) for n, a in anchor.items()}
    shift = overlap.into_shift({n: a.clone() for n, a in anchor.items()}, new_global)
    overlap.rebase(module, shift, new_global, moved=True)
    for n, p in module.named_parameters():
        torch.testing.assert_close(p.detach(), new_global[n] + progress[n])


def test_rebase_without_progress_is_the_plain_copy_bit_for_bit() -> None:
    module = nn.Linear(3, 2)
    anchor = overlap.snapshot_local(module)
    new_global = {n: torch.randn_like(a) for n, a in anchor.items()}
    overlap.rebase(module, overlap.into_shift(anchor, new_global), new_global, moved=False)
    for n, p in module.named_parameters():
        assert torch.equal(p.detach(), new_global[n])


def test_the_last_round_and_a_leaving_replica_wait_for_their_mean() -> None:
    assert overlap.is_last_round(leaving=True, max_rounds=0, rounds_done=0)
    assert overlap.is_last_round(leaving=False, max_rounds=3, rounds_done=2)
    assert not overlap.is_last_round(leaving=False, max_rounds=3, rounds_done=1)
    assert not overlap.is_last_round(leaving=False, max_rounds=0, rounds_done=100)


# --- the runner with an in-memory group ----------------------------------------------------------
class Group:
    """Two replicas' averaging in memory: the weighted mean of both Δ once both have sent, handed
    to both once `release` is set for that round (the test holds the mean back to see the worker
    train meanwhile). `fail` rounds come back incomplete for both."""

    def __init__(self, members: int = 2, hold: bool = True):
        self.members = members
        self.hold = hold
        self.sent: dict[int, list[tuple[float, dict[str, torch.Tensor]]]] = {}
        self.ready: dict[int, asyncio.Event] = {}
        self.release: dict[int, asyncio.Event] = {}
        self.fail: set[int] = set()

    def _events(self, round_no: int) -> tuple[asyncio.Event, asyncio.Event]:
        ready = self.ready.setdefault(round_no, asyncio.Event())
        release = self.release.setdefault(round_no, asyncio.Event())
        if not self.hold:
            release.set()
        return ready, release

    async def run_round(self, round_no: int, delta: dict[str, torch.Tensor], weight: float) -> RoundResult:
        ready, release = self._events(round_no)
        self.sent.setdefault(round_no, []).append((weight, {n: t.clone() for n, t in delta.items()}))
        if len(self.sent[round_no]) == self.members:
            ready.set()
        await ready.wait()
        await release.wait()
        if round_no in self.fail:
            return RoundResult(False, "failed on purpose", ("a", "b"), None)
        total = sum(w for w, _ in self.sent[round_no])
        mean = {n: sum(w * d[n] for w, d in self.sent[round_no]) / total for n in delta}
        return RoundResult(True, "", ("a", "b"), mean, total_weight=total)


@dataclass
class Member:
    """The averager as the runner sees it, backed by the shared Group."""
    group: Group
    patience: float = 5.0
    resets: int = 0
    ledger: EvidenceLedger = field(default_factory=lambda: EvidenceLedger(1))
    """Where the runner records the rounds it applied (peer/evidence.py), as the real averager's."""

    async def run_round(self, round_no: int, delta: dict[str, torch.Tensor], weight: float, digest: str,
                        applied_rounds: int) -> RoundResult:
        return await self.group.run_round(round_no, delta, weight)

    def reset_feedback(self) -> None:
        self.resets += 1


@dataclass
class FakeSync:
    donor: StageState | None = None
    """If set, a failed round re-syncs to this state."""
    served: dict[str, float] = field(default_factory=dict)
    """Nobody downloads: no boundary is held for joiners (tests/test_join_hold.py)."""

    async def resync(self, round_no: int, result: RoundResult, overlapped: bool = False) -> bool:
        if self.donor is None:
            return False
        snap = self.donor.snapshot
        assert snap is not None
        self.state.load(snap.params, snap.momentum, snap.round + 1, snap.applied_rounds, snap.trained_samples)
        self.progress.adopt(snap.trained_samples)
        return True


class FakePresence:
    def __init__(self) -> None:
        self.stats = ReplicaStats()

    def set_stats(self, **values: object) -> None:
        for name, value in values.items():
            setattr(self.stats, name, value)

    async def announce(self) -> None:
        pass


class Replica:
    def __init__(self, group: Group, overlapped: bool, seed: int, schedule: ScheduleConfig = ScheduleConfig(),
                 inner_steps: int = H, overlap_steps: int = 0):
        self.clock = RoundClock(RoundsConfig(inner_steps=inner_steps, round_seconds=0.0, overlap=overlapped,
                                             overlap_steps=overlap_steps), counts_steps=True, max_rounds=0, epoch=None)
        torch.manual_seed(0)  # the same initial θ on every replica, as the manifest's seed gives
        module = nn.Linear(4, 4)
        self.progress = TrainingProgress(schedule)
        self.worker = StageWorker(module, InnerOptConfig(lr=0.05, microbatches_per_step=1), torch.device("cpu"),
                                  lambda y, t: nn.functional.mse_loss(y, t), self.clock, self.progress)
        self.state = StageState(module, OuterOptConfig(lr=0.7, momentum=0.9))
        self.sync = FakeSync()
        self.sync.state, self.sync.progress = self.state, self.progress  # type: ignore[attr-defined]
        self.averager = Member(group)
        self.events: list[dict] = []
        self.phase = ReplicaPhase()
        timeouts = TimeoutsConfig()
        self.runner = RoundRunner(stage=0, clock=self.clock, worker=self.worker, state=self.state,
                                  averager=self.averager, sync=self.sync, presence=FakePresence(),  # type: ignore[arg-type]
                                  phase=self.phase, swarm=None, progress=self.progress,  # type: ignore[arg-type]
                                  traffic=Traffic(), events=EventLog(None, sink=self.events.append),
                                  schedule_outer=False, save_dir=None, peer_id=f"peer-{seed}",
                                  join_hold=timeouts.join_hold, dht_timeout=timeouts.dht,
                                  matchmaking=timeouts.matchmaking, overlap=overlapped, overlap_steps=overlap_steps)
        self.runner.serve()  # ONLINE, as Replica.start leaves it
        self.data = torch.Generator().manual_seed(100 + seed)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(3, 4, generator=self.data), torch.randn(3, 4, generator=self.data)

    async def train_one(self) -> None:
        x, t = self.batch()
        async with self.worker.admitted(wait=True):
            await self.worker.forward_loss(x, t)
        await self.worker.maybe_step()

    def local(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.worker.module.named_parameters()}

    def rounds(self) -> list[dict]:
        return [e for e in self.events if e["event"] == "round"]


async def run_boundary(replicas: list[Replica]) -> None:
    """Train each replica up to its H-step boundary and end the round on all of them at once."""
    for r in replicas:
        while not r.worker.paused:
            await r.train_one()
    rnd = replicas[0].clock.current
    await asyncio.gather(*(r.runner.run_round(rnd) for r in replicas))


def test_overlapped_round_trains_while_the_mean_travels_and_lands_on_the_plain_global() -> None:
    async def main() -> None:
        group = Group()
        reps = [Replica(group, True, seed) for seed in (1, 2)]
        plain_group = Group(hold=False)
        plain = [Replica(plain_group, False, seed) for seed in (1, 2)]
        await run_boundary(reps)
        await run_boundary(plain)
        # round 0 ended; its mean is held back, and the workers train on regardless
        assert all(not r.worker.paused for r in reps) and all(r.phase.current is Phase.OVERLAPPED for r in reps)
        anchors = [{n: a.clone() for n, a in r.runner._in_flight.anchor.items()} for r in reps]
        g0 = reps[0].state.params["weight"].detach().clone()
        for r in reps:
            await r.train_one()  # one inner step of round 1 before the mean is there
        assert all(not r.rounds() for r in reps), "no round event before the mean has landed"
        before = [r.local() for r in reps]
        group.release[0].set()
        for r in reps:
            await r.runner._in_flight.task
        assert all(r.phase.current is Phase.SERVING for r in reps + plain), "landed mid-round: serving again"
        # θ_global: bit-identical on both, and what the plain round computed from the same Δs
        assert reps[0].state.digest == reps[1].state.digest
        assert torch.equal(reps[0].state.params["weight"], plain[0].state.params["weight"])
        assert plain[0].state.digest == reps[0].state.digest
        assert not torch.equal(reps[0].state.params["weight"], g0), "the outer step moved θ_global"
        for r in reps:
            ev = r.rounds()[0]
            assert ev["complete"] and ev["overlapped"] and 0 < ev["utilisation"] <= 1
            assert r.progress.trained == ev["swarm_samples"] == 2 * H * 3 and r.progress.pending == 0
        # the worker was idle when the mean landed, so θ_local moved at once: onto θ_global_new +
        # the progress since the snapshot
        for r, anchor, pre in zip(reps, anchors, before):
            assert r.worker.take_rebase() is None
            for n, t in r.local().items():
                torch.testing.assert_close(t, r.state.params[n].detach() + (pre[n] - anchor[n]))
        # an idle worker moves at once; a busy one right after its next inner step, in its critical section
        w = reps[0].worker
        await w.rebase(lambda: setattr(reps[0], "rebased_at", w.steps_total))
        assert reps[0].rebased_at == w.steps_total
        x, t = reps[0].batch()
        async with w.admitted(wait=True):
            await w.forward_loss(x, t)
            await w.rebase(lambda: setattr(reps[0], "rebased_at", w.steps_total))
        steps = w.steps_total
        await w.maybe_step()
        assert reps[0].rebased_at == steps + 1 and w.take_rebase() is None
        for r in reps + plain:
            r.worker.close()
    asyncio.run(main())


def test_a_mean_before_any_inner_step_gives_the_plain_rounds_bit_for_bit() -> None:
    """With the mean delivered before the worker's next step, overlap changes nothing: three
    rounds of overlapped and plain replicas end with equal θ_global, momentum and θ_local."""
    async def main() -> None:
        over = [Replica(Group(hold=False), True, seed) for seed in (1, 2)]
        over[1].averager.group = over[0].averager.group
        plain = [Replica(Group(hold=False), False, seed) for seed in (1, 2)]
        plain[1].averager.group = plain[0].averager.group
        for _ in range(3):
            await run_boundary(over)
            for r in over:  # let the mean land before any microbatch of the next round
                await r.runner._in_flight.task
            await run_boundary(plain)
        for r in over:
            await r.runner._finish_in_flight()  # the boundary's flush: θ_local ← θ_global_new
        for o, p in zip(over, plain):
            assert o.state.digest == p.state.digest
            for n, t in o.local().items():
                assert torch.equal(t, p.local()[n]), n
            assert o.progress.trained == p.progress.trained
        for r in over + plain:
            assert all(e["complete"] and 0 <= e["utilisation"] <= 1 for e in r.rounds())
            r.worker.close()
    asyncio.run(main())


def test_a_round_that_applies_nothing_carries_its_samples_and_keeps_the_work() -> None:
    async def main() -> None:
        group = Group(hold=False)
        group.fail.add(0)
        reps = [Replica(group, True, seed) for seed in (1, 2)]
        g0 = reps[0].state.digest
        await run_boundary(reps)
        for r in reps:
            await r.runner._in_flight.task
        assert all(r.state.digest == g0 for r in reps), "a failed round changes no θ_global"
        assert all(r.worker.take_rebase() is None for r in reps), "and does not move θ_local"
        assert all(r.runner._carried == H * 3 and r.progress.pending == H * 3 for r in reps)
        await run_boundary(reps)
        weights = [w for w, _ in group.sent[1]]
        assert weights == [2 * H * 3, 2 * H * 3], "round 1 weighs both rounds' samples"
        for r in reps:
            await r.runner._in_flight.task
            assert r.state.applied_rounds == 1 and r.progress.trained == 2 * 2 * H * 3
            r.worker.close()
    asyncio.run(main())


def test_a_resync_moves_theta_local_onto_the_donor_keeping_the_progress() -> None:
    async def main() -> None:
        group = Group()
        group.fail.add(0)
        reps = [Replica(group, True, seed) for seed in (1, 2)]
        donor = StageState(nn.Linear(4, 4), OuterOptConfig())
        donor.trained_samples = 1000
        donor.commit(0)
        reps[0].sync.donor = donor
        await run_boundary(reps)
        anchor = {n: a.clone() for n, a in reps[0].runner._in_flight.anchor.items()}
        await reps[0].train_one()
        pre = reps[0].local()
        group.release[0].set()
        for r in reps:
            await r.runner._in_flight.task
        assert reps[0].state.digest == donor.digest and reps[0].averager.resets == 1
        assert reps[0].progress.trained == 1000 and reps[0].progress.pending == 0
        assert reps[0].worker.take_rebase() is None, "an idle worker moved at once"
        for n, t in reps[0].local().items():
            torch.testing.assert_close(t, donor.params[n].detach() + pre[n] - anchor[n])
        for r in reps:
            r.worker.close()
    asyncio.run(main())


def test_the_lr_counts_the_samples_whose_mean_is_in_flight() -> None:
    async def main() -> None:
        sched = ScheduleConfig(kind="linear", warmup_samples=0, total_samples=1000, min_lr_ratio=0.0)
        group = Group()
        reps = [Replica(group, True, seed, schedule=sched) for seed in (1, 2)]
        for r in reps:
            r.progress.expect_group(2)
        await run_boundary(reps)
        r = reps[0]
        assert r.progress.trained == 0 and r.progress.pending == H * 3
        await r.train_one()
        # the position is the agreed samples (none yet) + ours in flight and in this round, / share
        assert r.worker.lr == pytest.approx(0.05 * (1 - (H * 3 + 3) / 0.5 / 1000))
        group.release[0].set()
        for x in reps:
            await x.runner._in_flight.task
            x.worker.close()
    asyncio.run(main())


def test_utilisation_counts_a_plain_rounds_wait_and_not_an_overlapped_ones() -> None:
    async def main() -> None:
        for overlapped in (False, True):
            group = Group()
            reps = [Replica(group, overlapped, seed) for seed in (1, 2)]
            for r in reps:
                while not r.worker.paused:
                    await r.train_one()
            ends = asyncio.gather(*(r.runner.run_round(0) for r in reps))
            await asyncio.sleep(0.6)  # the mean takes 0.6 s to arrive
            group.release[0].set()
            await ends
            for r in reps:
                if overlapped:
                    await r.runner._in_flight.task
                ev = r.rounds()[0]
                compute = r.worker.compute_total
                if overlapped:  # resumed at once: the wait is not in the round
                    assert ev["round_s"] < 0.6 and ev["utilisation"] == pytest.approx(compute / ev["round_s"], rel=0.2)  # round_s is rounded to ms
                else:
                    assert ev["round_s"] >= 0.6 and ev["utilisation"] <= compute / 0.6 + 1e-3
                r.worker.close()
    asyncio.run(main())


# --- rounds.overlap_steps: how many steps may run before the mean lands -------------------------
async def gate_closed(r: Replica, seconds: float = 0.3) -> bool:
    """Does a training microbatch wait (for `seconds`) instead of being admitted?"""
    try:
        await asyncio.wait_for(r.train_one(), seconds)
    except asyncio.TimeoutError:
        return True
    return False


def test_a_bound_on_overlap_waits_for_the_mean_after_that_many_steps() -> None:
    async def main() -> None:
        group = Group()
        reps = [Replica(group, True, seed, inner_steps=4, overlap_steps=2) for seed in (1, 2)]
        await run_boundary(reps)
        anchors = [{n: a.clone() for n, a in r.runner._in_flight.anchor.items()} for r in reps]
        for r in reps:
            await r.train_one()
            steps = r.worker.steps_total
            await r.train_one()  # the second step of the bound: taken, and then the gate closes
            assert r.worker.steps_total == steps + 1
        before = [r.local() for r in reps]
        for r, pre in zip(reps, before):
            with pytest.raises(NotReady, match="mean"):  # a later stage's caller: refused, not held
                async with r.worker.admitted(wait=False):
                    pass
            steps = r.worker.steps_total
            assert await gate_closed(r), "a third step ran before the mean landed"
            assert r.worker.steps_total == steps
            assert all(torch.equal(t, pre[n]) for n, t in r.local().items()), "θ_local moved with the gate closed"
        group.release[0].set()
        for r in reps:
            await r.runner._in_flight.task
        for r, anchor, pre in zip(reps, anchors, before):
            # the move ran once the mean landed: θ_global_new + the two steps' progress
            assert r.worker.take_rebase() is None
            for n, t in r.local().items():
                torch.testing.assert_close(t, r.state.params[n].detach() + (pre[n] - anchor[n]))
            ev = r.rounds()[0]
            assert ev["complete"] and ev["overlapped"] and ev["mean_wait_s"] >= 0.25, ev
            assert not await gate_closed(r, 5.0), "the gate opened with the move"
            r.worker.close()
    asyncio.run(main())


def test_a_mean_that_lands_within_the_bound_is_not_waited_for() -> None:
    async def main() -> None:
        group = Group()
        reps = [Replica(group, True, seed, inner_steps=4, overlap_steps=2) for seed in (1, 2)]
        await run_boundary(reps)
        for r in reps:
            await r.train_one()
        group.release[0].set()
        for r in reps:
            await r.runner._in_flight.task
            for _ in range(2):  # the bound was for that mean only: the rest of the round trains on
                assert not await gate_closed(r, 5.0)
            assert r.rounds()[0]["mean_wait_s"] == 0.0
            r.worker.close()
    asyncio.run(main())


def test_a_failed_round_or_a_dropped_one_opens_the_gate_without_a_move() -> None:
    async def main() -> None:
        group = Group()
        group.fail.add(0)
        reps = [Replica(group, True, seed, inner_steps=4, overlap_steps=1) for seed in (1, 2)]
        await run_boundary(reps)
        for r in reps:
            await r.train_one()
            assert await gate_closed(r)
        before = [r.local() for r in reps]
        group.release[0].set()
        for r, pre in zip(reps, before):
            await r.runner._in_flight.task
            assert r.worker.take_rebase() is None and r.runner._carried == 4 * 3
            assert all(torch.equal(t, pre[n]) for n, t in r.local().items()), "nothing applied: θ_local kept"
            assert not await gate_closed(r, 5.0)
        # a round dropped while the gate is closed (the runner stops) opens it and leaves no move behind
        await run_boundary(reps)
        r = reps[0]
        await r.train_one()
        assert await gate_closed(r)
        await r.runner._drop_in_flight()
        assert r.worker.take_rebase() is None
        assert not await gate_closed(r, 5.0)
        for x in reps:
            await x.runner._drop_in_flight()
            x.worker.close()
    asyncio.run(main())
