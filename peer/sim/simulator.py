"""A discrete-event simulator of placement: the policy of ``placement/rules.py``, unchanged, played over
hundreds to thousands of peers with churn (``swarmgrad simulate``). This file is the model (the
events and what they do); ``config.py`` holds the devices, the configuration and the result,
``report.py`` the PNG, the summary line and the command's entry point.

What is modelled. Peers draw a GPU from ``DEVICES`` (speed and memory), an efficiency, a link
bandwidth and an online time (log-normal, heavy-tailed); they arrive as a Poisson process whose
rate keeps the swarm at ``peers`` on average, and at mid-run ``mass_fraction`` of them leave at
once. Every ``snapshot_s`` the DHT view is rebuilt (rates measured with noise; a peer moving
shows LEAVING on its stage and JOINING on its target); peers act on that possibly stale view.
A newcomer picks its stage with ``choose_stage_for_newcomer`` and serves after downloading the
stage state and warming up. Every peer checks ``should_move`` at jittered intervals through its
own ``Confirmation`` (``EMPTY_CHECK_SHARE`` times as often while the view has an empty stage, for
at most ``EMPTY_QUICK_CHECKS`` checks that find nothing, as the daemon's rebalancer); a mover
keeps serving its old stage while it downloads (make-before-break), serves nothing during
warm-up, then serves the target. A share of peers may be pinned (``pinned_share``): they never
check, and no plan picks them.

Warm standbys (placement rule 7). Rounds end together every ``round_s``; every ``backup_every``
rounds each stage pushes its committed state to its ``backup_copies`` holders (ONLINE peers of
other stages, highest rendezvous hash first, as ``backup.backup_holders``), one copy after the
other from the group's first member as ``backup.BackupPusher`` does, or one copy per member at
once (``parallel_push``); a copy takes state bytes / the slower of the two links, and a push is
skipped while the last one is still going or its pacing (``backup_link_share``, as
``decisions.next_push_at``) has not let the next go. A copy is *fresh* from its arrival until the next
boundary (the stage has moved on); peers announce their fresh copies (``SnapshotReplica.fresh``), check
every ``fresh_check_s`` while they hold one, and a mover whose copy of its target is still fresh
when it decides joins without a download: it serves after the warm-up alone.

What is measured (every ``sample_s``): throughput = min over stages of the true rates of the
peers serving it; optimum = the fluid bound (``placement.optimum.fluid_bound``, memory-aware) over the
peers that could serve (everyone but newcomers still fetching their first state). The ratio of
the two is averaged over time; the bound is an upper bound, so the ratio is conservative. It is
also a tight one here: on snapshots of the 1000-peer runs a discrete assignment (greedy, then
local search) came within 1e-6 of it, so the gap to 1 is not the bound's.

Where the gap is: churn. A departure takes its capacity from one stage at once, and nothing
restores it before a repair (a newcomer or a mover) has downloaded the stage's state and warmed
up. ``reaction_limit`` measures that: the time-averaged ratio if every departure's loss were
repaired exactly ``reaction_s`` after it and no earlier (half a snapshot refresh to see it, plus
the switch time at the median link), on the same departures; ``reaction_limit_warm`` the same
with the warm-up alone (every repair from a fresh backup). They estimate what a policy without
foresight can reach, not bounds (a stage may hold a surplus when it loses a peer); the warm
one assumes repairs that add capacity, which a move (it takes a peer from a stage near T) does
not. ``paper_ratio`` is the assignment on paper (joiners and movers on their target) against
the bound: 0.972 for the full policy at 1000 peers, yet policies at 0.982–0.987 on paper served
no more (docs/placement.md): the gap is repair latency, not the imbalance on paper.
Stage costs, memory needs and state sizes come from ``placement.cost.stage_costs`` of
``sim_manifest()``: a 1.3B-parameter byte-level GPT in 8 stages of 3 or 2 blocks, whose 3-block
stages do not fit a 12 GB card, so memory shapes placement.
"""
from __future__ import annotations

import dataclasses
import hashlib
import heapq
import math
import random
from typing import Sequence

from swarmgrad.peer.manifest import Manifest
from swarmgrad.peer.placement.rules import (EMPTY_CHECK_SHARE, NO_MARGIN, SWARM_POLICY, Confirmation, EmptyStageChecks,
                                      PeerFigures, PlacementPolicy, check_interval, choose_stage_for_newcomer,
                                      expected_tenure, should_move, switch_time)
from swarmgrad.peer.placement.optimum import fits, fluid_bound
from swarmgrad.peer.placement.evidence import bound_claims
from swarmgrad.peer.placement.plan import JOINING, LEAVING, ONLINE, SnapshotReplica, Snapshot
from swarmgrad.peer.decisions import next_push_at
from swarmgrad.peer.sim.config import DEVICES, SimConfig, SimResult, sim_manifest
from swarmgrad.peer.placement.cost import StageCost, stage_costs


class _Peer:
    __slots__ = ("id", "speed", "bench", "memory", "bandwidth", "joined", "stage", "target", "phase", "token", "conf",
                 "copies", "pinned", "empties", "since")

    def __init__(self, pid: str, speed: float, bench: float, memory: int, bandwidth: float, joined: float,
                 confirmations: int, pinned: bool = False) -> None:
        self.id, self.speed, self.bench, self.memory, self.bandwidth = pid, speed, bench, memory, bandwidth
        self.joined = joined
        self.pinned = pinned
        """It never checks whether to move, and its records say so (SimConfig.pinned_share)."""
        self.empties = EmptyStageChecks()
        """When its next check comes soon, as the daemon's rebalancer decides it."""
        self.stage = self.target = -1
        self.since = 0.0
        """When it began serving its current stage (its first completed round there proves it)."""
        self.phase = "join"  # join (first fetch) | online | fetch (move download) | warm (move warm-up)
        self.token = 0
        self.conf = Confirmation(confirmations)
        self.copies: dict[int, int] = {}
        """Backups it holds: stage -> the round boundary whose committed state the copy is."""


class Simulation:
    def __init__(self, cfg: SimConfig, costs: Sequence[StageCost]) -> None:
        self.cfg, self.costs = cfg, tuple(costs)
        self.policy: PlacementPolicy = NO_MARGIN if cfg.policy == "no-margin" else (
            SWARM_POLICY if cfg.q is None else PlacementPolicy(q=cfg.q))
        if not cfg.confirm_warm:
            self.policy = dataclasses.replace(self.policy, confirm_warm=False)
        self.rng = random.Random(cfg.seed)
        if cfg.pinned_stage is not None and not 0 <= cfg.pinned_stage < len(costs):
            raise ValueError(f"SimConfig.pinned_stage {cfg.pinned_stage} is outside 0..{len(costs) - 1}")
        if cfg.forged_records and not 0 <= cfg.forged_stage < len(costs):
            raise ValueError(f"SimConfig.forged_stage {cfg.forged_stage} is outside 0..{len(costs) - 1}")
        self.c = tuple(sc.cost for sc in costs)
        self.flops = tuple(sc.flops_per_sample for sc in costs)
        self.need = tuple(sc.memory_bytes for sc in costs)
        self.state_bytes = tuple(sc.state_bytes for sc in costs)
        self.mean_flops = sum(self.flops) / len(self.flops)
        self.peers: dict[str, _Peer] = {}
        self.events: list[tuple[float, int, str, str, int]] = []
        self.seq = 0
        self.counter = 0
        self.now = 0.0
        self.snap = Snapshot(tuple(() for _ in costs), self.c, self.need, self.state_bytes)
        self.measured: dict[str, float] = {}
        self.moves = self.joins = self.leaves = self.refused = 0
        self.peer_seconds = 0.0
        self.series: list[tuple[float, float, float]] = []
        self.pinned_bound: list[float] = []
        """Samples of the bound with pinned peers kept in place over the free bound."""
        self.paper: list[float] = []
        """Samples of the on-paper ratio (``SimResult.paper_ratio``)."""
        self.departures: list[tuple[float, int, float]] = []
        """(time, stage, samples/s it served) of every peer that left while serving."""
        mean_state = round(sum(self.state_bytes) / len(self.state_bytes))
        # a repair's expected download: over the device mix, each class at its median link
        self.reaction_s = cfg.snapshot_s / 2 + sum(
            d.share * switch_time(mean_state, cfg.link_law(d)[0] * 1e6 / 8, cfg.warmup_s)
            for d in DEVICES) / sum(d.share for d in DEVICES)
        self.reaction_warm_s = cfg.snapshot_s / 2 + cfg.warmup_s
        self.unrepaired: list[float] = []
        self.unrepaired_warm: list[float] = []
        self.warm_moves = 0
        self.pushing_until = [0.0] * len(costs)
        """When each stage's backup push in flight ends (a push is skipped while one is going)."""
        self.push_due = [0.0] * len(costs)
        """When each stage's next push may start (SimConfig.backup_link_share)."""
        self.pushes: dict[int, tuple[int, int]] = {}
        """Push id -> (stage, round boundary) of copies on their way."""
        self.backup_bytes = 0.0
        self.averaging_bytes = 0.0
        self.boundaries = 0
        self.push_counter = 0
        mean_tenure = cfg.tenure_median_h * 3600 * math.exp(cfg.tenure_sigma ** 2 / 2)
        self.arrival_rate = cfg.peers / mean_tenure

    # ----------------------------------------------------------------- peers
    def _new_peer(self) -> _Peer:
        cfg, rng = self.cfg, self.rng
        dev = rng.choices(DEVICES, weights=[d.share for d in DEVICES])[0]
        speed = dev.tflops * 1e12 * cfg.mfu * math.exp(rng.gauss(0.0, cfg.efficiency_sigma))
        bench = speed * math.exp(rng.gauss(0.0, 0.1))  # a newcomer's own benchmark estimate
        median, cap = cfg.link_law(dev)
        bw = min(max(median * math.exp(rng.gauss(0.0, cfg.bandwidth_sigma)), 10.0), cap)
        pinned = cfg.pinned_share > 0 and rng.random() < cfg.pinned_share
        self.counter += 1
        return _Peer(f"p{self.counter:05d}", speed, bench, int(dev.memory_gb * 1e9 * cfg.memory_usable),
                     bw * 1e6 / 8, self.now, self.policy.confirmations, pinned)

    def _tenure(self) -> float:
        cfg = self.cfg
        return max(cfg.tenure_median_h * 3600 * math.exp(self.rng.gauss(0.0, cfg.tenure_sigma)), cfg.min_tenure_s)

    def _push(self, t: float, kind: str, pid: str = "", token: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, pid, token))

    def _rates(self, speed: float) -> tuple[float, ...]:
        return tuple(speed / f for f in self.flops)

    def _admit(self, p: _Peer, snapshot: Snapshot, online: bool) -> bool:
        me = PeerFigures(p.id, self._rates(p.bench), p.memory, p.bandwidth, expected_tenure(0.0), self.cfg.warmup_s)
        stage = choose_stage_for_newcomer(snapshot, me)
        if p.pinned and self.cfg.pinned_stage is not None:
            stage = self.cfg.pinned_stage if fits(p.memory, self.need[self.cfg.pinned_stage]) else None
        if stage is None:
            self.refused += 1
            return False
        p.stage = stage
        self.peers[p.id] = p
        self._push(self.now + self._tenure(), "leave", p.id)
        if not p.pinned:
            self._push(self.now + check_interval(self.cfg.check_s, self.rng), "check", p.id)
        if online:
            p.phase = "online"
            p.since = self.now
        else:
            self.joins += 1
            ready = switch_time(self.state_bytes[stage], p.bandwidth, self.cfg.warmup_s)
            self._push(self.now + ready, "ready", p.id, p.token)
        return True

    # ----------------------------------------------------------------- views
    def _snapshot(self) -> Snapshot:
        stages: list[list[SnapshotReplica]] = [[] for _ in self.c]
        gauss, noise = self.rng.gauss, self.cfg.noise
        self.measured = {}
        proven = self._proven()
        for p in self.peers.values():
            if p.phase == "join":
                stages[p.stage].append(SnapshotReplica(p.id, JOINING, p.bench / self.flops[p.stage], p.memory,
                                               pinned=p.pinned, proven=proven is None))
                continue
            if p.phase == "warm":
                stages[p.target].append(SnapshotReplica(p.id, JOINING, p.bench / self.flops[p.target], p.memory,
                                                        proven=proven is None))
                continue
            rate = p.speed / self.flops[p.stage] * math.exp(gauss(0.0, noise))
            self.measured[p.id] = rate
            shown = proven is None or p.id in proven
            if p.phase == "online":
                stages[p.stage].append(SnapshotReplica(p.id, ONLINE, rate, p.memory, fresh=self._fresh(p), pinned=p.pinned,
                                                       proven=shown))
            else:  # fetch: still serving its stage, announced as moving, JOINING on the target
                stages[p.stage].append(SnapshotReplica(p.id, LEAVING, rate, p.memory, moving=True, proven=shown))
                stages[p.target].append(SnapshotReplica(p.id, JOINING, rate * self.c[p.stage] / self.c[p.target], p.memory,
                                                        proven=proven is None))
        if self.cfg.forged_records:
            claim = self.cfg.forged_claim * max(d.tflops for d in DEVICES) * 1e12 * self.cfg.mfu
            stages[self.cfg.forged_stage].extend(
                SnapshotReplica(f"forged{i:04d}", ONLINE, claim / self.flops[self.cfg.forged_stage], 0,
                                proven=proven is None) for i in range(self.cfg.forged_records))
        snap = Snapshot(tuple(tuple(s) for s in stages), self.c, self.need, self.state_bytes)
        if proven is None:
            return snap
        return bound_claims(snap, self.cfg.claims_stage_share if self.cfg.claims == "stage" else None)

    def _proven(self) -> set[str] | None:
        """Who placement counts as proven (``SimConfig.claims``): a peer that has served its stage
        through a round boundary (its first completed round), in a stage of two or more serving
        (a lone replica never votes). None: every record counts ("trusted", or no boundary yet)."""
        if self.cfg.claims == "trusted" or self.now < self.cfg.round_s:
            return None
        serving: dict[int, list[_Peer]] = {}
        for p in self.peers.values():
            if p.phase in ("online", "fetch"):
                serving.setdefault(p.stage, []).append(p)
        now_round = self._round()
        return {p.id for peers in serving.values() if len(peers) >= 2 for p in peers
                if int(p.since // self.cfg.round_s) < now_round}

    def _round(self) -> int:
        return int(self.now // self.cfg.round_s)

    def _fresh(self, p: _Peer) -> frozenset[int]:
        """Stages whose state of the current round p holds (placement.plan.fresh_backups, with the
        round boundary standing for the majority's applied rounds)."""
        if not p.copies:
            return frozenset()
        k = self._round()
        return frozenset(s for s, held in p.copies.items()
                         if (held == k or self.cfg.holders_listen) and s != p.stage)

    def _holders(self, stage: int) -> list[_Peer]:
        """backup.backup_holders: ONLINE peers of other stages, highest rendezvous hash first."""
        ranked = [(hashlib.sha256(f"sim/{stage}/{p.id}".encode()).digest(), p) for p in self.peers.values()
                  if p.phase == "online" and p.stage != stage]
        ranked.sort(key=lambda x: x[0], reverse=True)
        return [p for _, p in ranked[:self.cfg.backup_copies]]

    def _boundary(self) -> None:
        """A round ends on every stage: averaging, then (every backup_every rounds) the group's
        first member pushes the committed state to the holders, one copy after the other, each at
        the slower of the two links (backup.BackupPusher)."""
        k, cfg = self._round(), self.cfg
        self.boundaries += 1
        for s in range(len(self.c)):
            serving = [p for p in self.peers.values() if p.phase in ("online", "fetch") and p.stage == s]
            self.averaging_bytes += 2 * len(serving) * self.state_bytes[s] / 8  # int8 of fp32 θ, θ+m = 8 B/param
            if not (cfg.backup_copies and cfg.backup_every and serving and k % cfg.backup_every == 0):
                continue
            if self.now < self.pushing_until[s] or self.now < self.push_due[s]:
                continue  # the previous push is still going, or what it took is not yet paid for
            pushers = sorted(serving, key=lambda p: p.id)
            end = self.now
            for i, holder in enumerate(self._holders(s)):
                # copy i goes from member i (by peer id) when parallel, else all from the first
                pusher = pushers[i % len(pushers)] if cfg.parallel_push else pushers[0]
                t = (self.now if cfg.parallel_push else end) + self.state_bytes[s] / min(pusher.bandwidth,
                                                                                       holder.bandwidth)
                end = max(end, t)
                self.push_counter += 1
                self.pushes[self.push_counter] = (s, k)
                self._push(t, "held", holder.id, self.push_counter)
                self.backup_bytes += self.state_bytes[s]
            self.pushing_until[s] = end
            self.push_due[s] = next_push_at(self.now, end - self.now, cfg.backup_link_share)

    def _held(self, p: _Peer, push: int) -> None:
        stage, k = self.pushes.pop(push)
        if p.stage != stage and p.copies.get(stage, -1) < k:
            p.copies[stage] = k

    def _sample(self) -> None:
        caps, paper = [0.0] * len(self.c), [0.0] * len(self.c)
        work, mem, fixed, all_work, all_mem = [], [], [], [], []
        for p in self.peers.values():
            if p.phase in ("online", "fetch"):
                caps[p.stage] += p.speed / self.flops[p.stage]
            on = p.target if p.phase in ("fetch", "warm") else p.stage
            paper[on] += p.speed / self.flops[on]
            all_work.append(p.speed / self.mean_flops)
            all_mem.append(p.memory)
            if p.phase != "join":
                work.append(p.speed / self.mean_flops)
                mem.append(p.memory)
                fixed.append(p.stage if p.pinned else -1)
        best = fluid_bound(work, self.c, mem, self.need) if work else 0.0
        if best > 0 and self.cfg.pinned_share > 0:
            self.pinned_bound.append(fluid_bound(work, self.c, mem, self.need, fixed) / best)
        self.series.append((self.now, min(caps), best))
        if all_work:
            self.paper.append(min(paper) / fluid_bound(all_work, self.c, all_mem, self.need))
        for reaction, out in ((self.reaction_s, self.unrepaired), (self.reaction_warm_s, self.unrepaired_warm)):
            lost = [0.0] * len(self.c)
            for t, stage, rate in reversed(self.departures):
                if t <= self.now - reaction:
                    break
                lost[stage] += rate
            # The optimum already lost the departed peer's share spread over all stages.
            out.append(min(max(lost) * (1 - 1 / len(self.c)) / best, 1.0) if best > 0 else 0.0)

    # ----------------------------------------------------------------- events
    def _check(self, p: _Peer) -> None:
        if p.phase != "online" or p.id not in self.measured:
            self._push(self.now + check_interval(self.cfg.check_s, self.rng), "check", p.id)
            return
        rates = tuple(self.measured[p.id] * self.c[p.stage] / c for c in self.c)
        me = PeerFigures(p.id, rates, p.memory, p.bandwidth, expected_tenure(self.now - p.joined), self.cfg.warmup_s)
        salt = int(self.now // 600)
        decision = p.conf.observe(should_move(self.snap, me, p.stage, salt=salt, policy=self.policy))
        base = self.cfg.confirm_s if p.conf.pending else self.cfg.check_s
        if p.empties.observe(self.snap.empty_stages, moved=decision is not None):
            base = min(base, self.cfg.check_s / EMPTY_CHECK_SHARE)
        if self.cfg.fresh_check_s and self._fresh(p):
            base = min(base, self.cfg.fresh_check_s)
        self._push(self.now + check_interval(base, self.rng), "check", p.id)
        if decision is None:
            return
        self.moves += 1
        p.target = decision.target
        p.token += 1
        if decision.target in self._fresh(p):  # joins from its local copy: warm-up only
            self.warm_moves += 1
            p.phase = "warm"
            self._push(self.now + self.cfg.warmup_s, "ready", p.id, p.token)
            return
        p.phase = "fetch"
        self._push(self.now + self.state_bytes[p.target] / p.bandwidth, "ready", p.id, p.token)

    def _ready(self, p: _Peer) -> None:
        if p.phase == "join":
            p.phase = "online"
            p.since = self.now
        elif p.phase == "fetch":
            p.phase = "warm"
            p.token += 1
            self._push(self.now + self.cfg.warmup_s, "ready", p.id, p.token)
        elif p.phase == "warm":
            p.phase, p.stage, p.target = "online", p.target, -1
            p.since = self.now
            p.conf.reset()

    def _leave(self, pid: str) -> None:
        p = self.peers.pop(pid, None)
        if p is not None:
            if p.phase in ("online", "fetch"):
                self.departures.append((self.now, p.stage, p.speed / self.flops[p.stage]))
            self.leaves += 1
            self.peer_seconds += self.now - p.joined

    def _mass_departure(self) -> None:
        ids = list(self.peers)
        for pid in self.rng.sample(ids, round(self.cfg.mass_fraction * len(ids))):
            self._leave(pid)
        self.snap = self._snapshot()  # everyone sees the loss at the next refresh; be prompt

    # ----------------------------------------------------------------- run
    def run(self) -> SimResult:
        cfg = self.cfg
        end = cfg.hours * 3600
        # Bootstrap: the initial swarm forms one peer at a time, each seeing the ones before.
        stages: list[list[SnapshotReplica]] = [[] for _ in self.c]
        for _ in range(cfg.peers):
            p = self._new_peer()
            snap = Snapshot(tuple(tuple(s) for s in stages), self.c, self.need, self.state_bytes)
            if self._admit(p, snap, online=True):
                stages[p.stage].append(SnapshotReplica(p.id, ONLINE, p.speed / self.flops[p.stage], p.memory,
                                               pinned=p.pinned))
        self.snap = self._snapshot()
        self._push(0.0, "sample")
        self._push(cfg.snapshot_s, "snapshot")
        self._push(self.rng.expovariate(self.arrival_rate), "arrive")
        self._push(cfg.round_s, "boundary")
        if cfg.mass_fraction > 0:
            self._push(end / 2, "mass")
        while self.events and self.events[0][0] <= end:
            self.now, _, kind, pid, token = heapq.heappop(self.events)
            if kind == "sample":
                self._sample()
                self._push(self.now + cfg.sample_s, "sample")
            elif kind == "snapshot":
                self.snap = self._snapshot()
                self._push(self.now + cfg.snapshot_s, "snapshot")
            elif kind == "arrive":
                self._admit(self._new_peer(), self.snap, online=False)
                self._push(self.now + self.rng.expovariate(self.arrival_rate), "arrive")
            elif kind == "mass":
                self._mass_departure()
            elif kind == "boundary":
                self._boundary()
                self._push(self.now + cfg.round_s, "boundary")
            elif kind == "leave":
                self._leave(pid)
            elif kind == "held" and pid not in self.peers:
                self.pushes.pop(token, None)
            elif pid in self.peers:
                p = self.peers[pid]
                if kind == "check":
                    self._check(p)
                elif kind == "ready" and token == p.token:
                    self._ready(p)
                elif kind == "held":
                    self._held(p, token)
        self.now = end
        self.peer_seconds += sum(end - p.joined for p in self.peers.values())
        return self._result(end)

    def _result(self, end: float) -> SimResult:
        ratios = [(t, tp / best if best > 0 else 1.0) for t, tp, best in self.series]
        mean = sum(r for _, r in ratios) / max(len(ratios), 1)
        recovery, worst = None, 1.0
        if self.cfg.mass_fraction > 0:
            after = [(t, r) for t, r in ratios if t >= end / 2]
            worst = min((r for _, r in after), default=1.0)
            recovery = next((t - end / 2 for t, r in after if r >= self.cfg.recover_ratio), None)
        hours = self.peer_seconds / 3600
        return SimResult(throughput_ratio=mean, moves_per_peer_hour=self.moves / hours if hours else 0.0,
                         recovery_s=recovery, moves=self.moves, joins=self.joins, leaves=self.leaves,
                         refused=self.refused, peer_hours=hours, min_ratio_after_departure=worst,
                         policy=self.cfg.policy, series=self.series,
                         reaction_limit=1 - sum(self.unrepaired) / max(len(self.unrepaired), 1),
                         reaction_s=self.reaction_s,
                         reaction_limit_warm=1 - sum(self.unrepaired_warm) / max(len(self.unrepaired_warm), 1),
                         warm_moves=self.warm_moves,
                         paper_ratio=sum(self.paper) / max(len(self.paper), 1),
                         pinned_bound_ratio=(sum(self.pinned_bound) / len(self.pinned_bound)
                                             if self.pinned_bound else 1.0),
                         backup_bytes_per_round=self.backup_bytes / max(self.boundaries, 1),
                         averaging_bytes_per_round=self.averaging_bytes / max(self.boundaries, 1))


def simulate(cfg: SimConfig, manifest: Manifest | None = None) -> SimResult:
    """Run one simulation; the same config (seed included) gives the same result."""
    return Simulation(cfg, stage_costs(manifest or sim_manifest())).run()
