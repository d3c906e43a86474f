"""Chaos soak: 6 peers on 2 stages, one SIGKILLed every few seconds and replaced at once.

    python -m benchmarks.chaos [--minutes M] [--kill-every S] [--manifest PATH] [--workdir DIR]
                               [--seed N] [--verbose-peers] [--quick] [--link loopback|unshaped|20mbit]
                               [--out DIR]

Not a CI test (the "Chaos soak" item of the hostile-peers issue). Six peers on 127.0.0.1, three
replicas of each of 2 fixed stages (`--stage N`, so no rebalancing moves; the three stage-0
replicas are the drivers), train the tests' small manifest (a 2-layer d=32 GPT, 4 s wall-clock
rounds) unless `--manifest` says otherwise. Once every peer is online and each stage completed a
round, every `--kill-every` seconds for `--minutes` a random live peer's whole process group
(peer, DHT child, p2pd) is SIGKILLed and a replacement starts on the same stage at once, joining
through a live peer (the swarm's first peer is killed too, so the address new peers join through is
refreshed from live peers' `started` events before every start). `--link 20mbit` (root: network
namespaces, benchmarks/harness/netns.py) puts each peer in a namespace slot of its own on a bridge, with
`tbf rate 20mbit` on every slot's egress (`unshaped`: the namespaces without tbf); a replacement
takes its victim's slot: slow links are where a round's DHT read can finish as the round fails,
which loopback rarely shows. A peer is only killed if its stage keeps another
online replica, so no stage, and not every driver, is ever gone at once. A peer that exits by itself
(a crash) is reported with its log tail and replaced the same way. At the end, once the last
replacements are online (at most `--join-limit` s: a peer signalled while it still imports dies of
the signal, since the daemon installs its handlers only once it runs), every live peer gets SIGTERM
and must exit 0 within 20 s; `LocalSwarm` then kills every process group it started,
whatever happened (also on SIGTERM/SIGINT of this script), and the script checks that no process of
those groups is left.

The report (one markdown table, then one JSON line; with --out also report.md and results.json) is
computed from the peers' JSON-lines events:
- hangs: a live peer with no `round` event for more than 3 round durations (from its `online`
  event, between round events, or until it was killed or stopped), a peer not online
  `--join-limit` s after it started, or a peer that did not exit within 20 s of SIGTERM. Each is
  listed with the peer, its stage, when, and the last lines of its log.
- rounds: per stage, rounds that at least one replica completed, and rounds that no replica
  completed; "replica rounds incomplete" counts every replica's incomplete round events.
- microbatches lost / retried: the drivers' `lost` and `retry` events (evaluation microbatches
  included; a retry event is one re-send).
- duplicated microbatches: exact, from the `committed` lists of stage-1 round events (every
  microbatch a replica trained on, "driver:id"; commit on acknowledgement): an id committed n > 1
  times over all stage-1 replicas counts n - 1. (Commits after a replica's last round event, i.e.
  just before it was killed, are not reported.) The old estimate is kept beside it: stage-1
  samples minus stage-0 samples over rounds in which no peer was killed, crashed or came online,
  divided by the microbatch size.
- replicas bit-identical: every (stage, round) that several replicas completed has one digest.
- validation loss: the swarm's first evaluation (before training), its last one before the first
  kill, and the mean of the last one of each driver alive at the end.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import psutil

from benchmarks.harness import netns
from benchmarks.harness.report import Report, add_common_args, fmt, markdown_table, seed_or
from swarmgrad.peer.cli.launcher import LocalSwarm, PeerProcess, small_manifest
from swarmgrad.peer.manifest import Manifest, dumps, load

STAGES = 2
REPLICAS = 3
STALL_ROUNDS = 3  # a live peer without a round event for this many round durations hangs
SHUTDOWN_S = 20.0
LINKS = {"loopback": None, "unshaped": None, "20mbit": "20mbit"}
"""--link: loopback (every peer on 127.0.0.1) or one namespace per slot, shaped by tbf or not."""


def chaos_manifest() -> Manifest:
    """The tests' small run (swarmgrad.peer.cli.launcher.small_manifest: 2-layer d=32 GPT, 4 s rounds)."""
    return small_manifest(run_id="chaos", stages={"count": STAGES})


# pure decisions and figures ------------------------------------------------------------------------
def choose_victim(live: Sequence[tuple[str, int, bool]], rng: random.Random) -> str | None:
    """A random live peer whose stage keeps at least one *other* online replica after the kill, so
    no stage (and never every driver: they are stage 0) is emptied. `live`: (name, stage, online)
    of every live peer. None when every stage is down to its last online replica."""
    online = Counter(stage for _, stage, on in live if on)
    candidates = [name for name, stage, on in live if online[stage] - on >= 1]
    return rng.choice(candidates) if candidates else None


def find_stalls(progress: Sequence[float], end: float, limit: float) -> list[tuple[float, float]]:
    """(start, seconds) of every gap longer than `limit` between a peer's successive progress times
    (its `online` event, then its round events) and from the last one to `end` (killed, exited, or
    SIGTERM). Empty if the peer never came online (that is judged separately)."""
    times = sorted(progress)
    return [(a, b - a) for a, b in zip(times, times[1:] + [end]) if b - a > limit]


def _eval_name(summary: dict[str, Any]) -> str:
    after = summary.get("val_loss_chaos_start_after_round")
    return "the start evaluation" if after is None else f"after round {after}"


def duplicated(committed: Sequence[Sequence[str]]) -> tuple[int, int]:
    """(microbatches trained more than once, microbatches trained) over one stage's round events'
    `committed` lists: an id seen n times counts n - 1."""
    counts = Counter(mb for ids in committed for mb in ids)
    return sum(n - 1 for n in counts.values()), len(counts)


def duplicate_estimate(rounds: dict[int, dict[int, int]], disturbed: set[int]) -> tuple[int, int]:
    """(stage-1 samples minus stage-0 samples over undisturbed rounds, how many such rounds).
    `rounds[stage][round]` = samples summed over that stage's replicas' round events."""
    clean = [r for r in rounds.get(0, {}) if r in rounds.get(1, {}) and r not in disturbed]
    return sum(rounds[1][r] - rounds[0][r] for r in clean), len(clean)


@dataclass
class Incident:
    kind: str  # "stall", "not online", "shutdown", "crash", "exit code"
    peer: str
    stage: int
    at: float  # unix time
    detail: str
    log_tail: str = ""
    gap: float = 0.0  # a stall's length in seconds


@dataclass
class Soak:
    swarm: LocalSwarm
    m: Manifest
    rng: random.Random
    join_limit: float
    spawned: dict[str, float] = field(default_factory=dict)
    ended: dict[str, float] = field(default_factory=dict)  # killed / exited / SIGTERM time
    kills: list[tuple[float, str, int, str]] = field(default_factory=list)  # time, victim, stage, replacement
    incidents: list[Incident] = field(default_factory=list)
    deferred: int = 0
    chaos_t0: float = 0.0  # unix time the chaos phase began

    slots: dict[str, int] = field(default_factory=dict)
    """Each peer's namespace slot (--link unshaped/20mbit); a replacement takes its victim's."""

    def start(self, stage: int, slot: int | None = None) -> PeerProcess:
        self._refresh_initial_peers()
        if isinstance(self.swarm, SlotSwarm):
            self.swarm.next_slot = len(self.slots) if slot is None else slot
        peer = self.swarm.start(stage)
        self.spawned[peer.name] = time.time()
        if isinstance(self.swarm, SlotSwarm):
            self.slots[peer.name] = self.swarm.next_slot
        return peer

    def live(self) -> list[PeerProcess]:
        return [p for p in self.swarm.peers if p.name not in self.ended and p.alive]

    def _refresh_initial_peers(self) -> None:
        """Join through live online peers: the first peer (or any later one) may be dead by now. Up
        to 3 of them, so that one killed while the newcomer still starts does not strand it."""
        online = [p for p in self.live() if p.events("online")]
        if online:
            self.swarm.initial_peers = [a for p in online[:3] for a in self._maddrs(p)]

    @staticmethod
    def _maddrs(peer: PeerProcess) -> list[str]:
        started = peer.events("started")
        addrs = started[0]["maddrs"] if started else []
        return [a for a in addrs if "/127.0.0.1/" in a] or addrs

    def kill_one(self, t0: float) -> bool:
        live = self.live()
        name = choose_victim([(p.name, p.stage, bool(p.events("online"))) for p in live], self.rng)
        if name is None:
            self.deferred += 1
            return False
        victim = next(p for p in live if p.name == name)
        victim.kill_group(signal.SIGKILL)
        self.ended[victim.name] = time.time()
        new = self.start(victim.stage, self.slots.get(victim.name))
        self.kills.append((self.ended[victim.name], victim.name, victim.stage, new.name))
        print(f"  t={time.time() - t0:6.1f}s kill {victim.name} (stage {victim.stage}) -> {new.name}", flush=True)
        return True

    def reap_crashes(self) -> None:
        """A peer that exited without being killed crashed: report it and replace it."""
        for p in self.swarm.peers:
            if p.name not in self.ended and not p.alive:
                self.ended[p.name] = time.time()
                self.incidents.append(Incident("crash", p.name, p.stage, time.time(),
                                               f"exited by itself with code {p.proc.returncode}", p.log_tail(30)))
                new = self.start(p.stage, self.slots.get(p.name))
                print(f"  CRASH {p.name} (stage {p.stage}, code {p.proc.returncode}) -> {new.name}", flush=True)

    def stop_all(self) -> dict[str, tuple[int | None, float]]:
        """SIGTERM every live peer at once; (exit code, seconds) of each, None if still running."""
        live = self.live()
        t = time.time()
        for p in live:
            p.signal(signal.SIGTERM)
            self.ended[p.name] = t
        out = {}
        for p in live:
            try:
                code = p.proc.wait(max(0.1, t + SHUTDOWN_S - time.time()))
            except subprocess.TimeoutExpired:  # judged below
                code = None
            out[p.name] = (code, time.time() - t)
            if code is None:
                self.incidents.append(Incident("shutdown", p.name, p.stage, t,
                                               f"still running {SHUTDOWN_S:.0f}s after SIGTERM", p.log_tail(30)))
            elif code != 0:
                self.incidents.append(Incident("exit code", p.name, p.stage, t,
                                               f"exited {code} after SIGTERM", p.log_tail(30)))
        return out

    def judge_stalls(self) -> None:
        limit = STALL_ROUNDS * self.m.rounds.round_seconds
        for p in self.swarm.peers:
            end = self.ended.get(p.name, time.time())
            online = p.events("online")
            if not online:
                if end - self.spawned[p.name] > self.join_limit:
                    self.incidents.append(Incident("not online", p.name, p.stage, self.spawned[p.name],
                                                   f"not online {end - self.spawned[p.name]:.0f}s after start",
                                                   p.log_tail(20)))
                continue
            progress = [online[0]["time"]] + [e["time"] for e in p.events("round")]
            for start, gap in find_stalls(progress, end, limit):
                self.incidents.append(Incident("stall", p.name, p.stage, start,
                                               f"no round event for {gap:.1f}s from t={start:.1f} "
                                               f"({'until it ended' if start + gap >= end - 1e-6 else 'recovered'})",
                                               _log_window(p, start, start + gap), round(gap, 1)))


class SlotSwarm(netns.NetnsSwarm):
    """A swarm in namespace slots: the peer started next runs in slot `next_slot` (the soak picks
    a free one: its victim's), listening on that slot's address, with a data seed of its own."""

    def __init__(self, manifest: Path, workdir: Path, endpoints: list[netns.Endpoint], env: dict[str, str],
                 verbose: bool):
        super().__init__(manifest, workdir, endpoints)
        self.env, self.verbose = env, verbose
        self.next_slot = 0
        self._slot_of: dict[int, int] = {}

    def command_prefix(self, index: int) -> list[str]:
        self._slot_of[index] = self.next_slot
        return self.endpoints[self.next_slot].exec_prefix()

    def peer_args(self, index: int, name: str) -> list[str]:
        address = self.endpoints[self._slot_of[index]].address
        return ["--host-maddrs", f"/ip4/{address}/tcp/0", "--data-seed", str(index)]


def _log_window(peer: PeerProcess, start: float, end: float, max_lines: int = 14) -> str:
    """The peer's log lines stamped (HH:MM:SS, local time) from 2 s before `start` to 2 s after
    `end`, at most `max_lines` of them (the last ones), or its tail when none is stamped there."""
    def sod(t: float) -> int:
        lt = time.localtime(t)
        return lt.tm_hour * 3600 + lt.tm_min * 60 + lt.tm_sec
    lo, hi = sod(start - 2), sod(end + 2)
    picked = []
    for line in peer.log_tail(100_000).splitlines():
        stamp = line[:8]
        if len(stamp) == 8 and stamp[2] == stamp[5] == ":" and stamp.replace(":", "").isdigit():
            s = int(stamp[:2]) * 3600 + int(stamp[3:5]) * 60 + int(stamp[6:])
            if (lo <= s <= hi) if lo <= hi else (s >= lo or s <= hi):
                picked.append(line)
    return "\n".join(picked[-max_lines:]) or peer.log_tail(max_lines)


# the report ----------------------------------------------------------------------------------------
def summarize(soak: Soak, wall_s: float, chaos_s: float, shutdown: dict[str, tuple[int | None, float]],
              leftover: list[int]) -> dict[str, Any]:
    peers = soak.swarm.peers
    events = {p.name: p.events() for p in peers}
    stage_of = {p.name: p.stage for p in peers}
    rounds = [e for n in events for e in events[n] if e["event"] == "round"]
    complete: dict[tuple[int, int], list[str]] = defaultdict(list)
    seen: set[tuple[int, int]] = set()
    samples: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for e in rounds:
        seen.add((e["stage"], e["round"]))
        samples[e["stage"]][e["round"]] += e["samples"]
        if e["complete"]:
            complete[(e["stage"], e["round"])].append(e["digest"])
    compared = [d for d in complete.values() if len(d) >= 2]
    mismatched = sorted(k for k, d in complete.items() if len(set(d)) > 1)
    drivers = [n for n in events if stage_of[n] == 0]
    evals = {n: [e for e in events[n] if e["event"] == "eval" and e.get("val_loss") is not None] for n in drivers}
    # start: the swarm's first evaluation (before training); at chaos start: the swarm's last one
    # before the first kill (one driver per round evaluates, data.evaluators; the start one when the
    # chaos began before the first due round); end: the last one of
    # each driver alive at the end (its final evaluation)
    ordered = sorted((e for n in drivers for e in evals[n]), key=lambda e: e["time"])
    val_start = ordered[0]["val_loss"] if ordered else float("nan")
    before_chaos = [e for e in ordered if e["time"] <= soak.chaos_t0]
    val_chaos = before_chaos[-1]["val_loss"] if before_chaos else float("nan")
    # None: the start evaluation (the chaos began before the first due round's evaluation)
    val_chaos_round = before_chaos[-1].get("after_round") if before_chaos else None
    val_end = _mean([evals[n][-1]["val_loss"] for n in drivers if n in shutdown and evals[n]])
    dup, clean = duplicate_estimate(samples, _disturbed_rounds(soak, rounds))
    dup_exact, trained = duplicated([e.get("committed", []) for e in rounds if e["stage"] == 1])
    hangs = [i for i in soak.incidents if i.kind in ("stall", "not online", "shutdown")]
    stalls = [i for i in hangs if i.kind == "stall"]
    return {
        "bench": "chaos", "wall_s": round(wall_s, 1), "chaos_s": round(chaos_s, 1), "kills": len(soak.kills),
        "kills_deferred": soak.deferred, "peers_started": len(peers),
        "hangs": len(hangs), "stalls_recovered": sum("recovered" in i.detail for i in stalls),
        "longest_stall_s": max((i.gap for i in stalls), default=0.0), "crashes": sum(i.kind == "crash" for i in soak.incidents),
        "bad_exit_codes": sum(i.kind == "exit code" for i in soak.incidents),
        "shutdown_max_s": round(max((s for _, s in shutdown.values()), default=0.0), 1),
        "shutdown_exit_codes": sorted(Counter(str(c) for c, _ in shutdown.values()).items()),
        "leftover_processes": len(leftover),
        "rounds_completed": {s: len({r for (st, r) in complete if st == s}) for s in range(STAGES)},
        "rounds_incomplete": {s: len({r for (st, r) in seen if st == s} - {r for (st, r) in complete if st == s})
                              for s in range(STAGES)},
        "replica_rounds_incomplete": sum(not e["complete"] for e in rounds),
        "incomplete_reasons": Counter(str(e["reason"])[:60] for e in rounds if not e["complete"]).most_common(4),
        "lost": sum(e["event"] == "lost" for n in drivers for e in events[n]),
        "retried": sum(e["event"] == "retry" for n in drivers for e in events[n]),
        "duplicated": dup_exact, "stage1_microbatches": trained,
        "duplicated_estimate": round(dup / soak.m.inner.microbatch_size, 1), "duplicate_clean_rounds": clean,
        "rounds_compared": len(compared), "digest_mismatches": mismatched,
        "val_loss_start": round(val_start, 3), "val_loss_chaos_start": round(val_chaos, 3),
        "val_loss_chaos_start_after_round": val_chaos_round,
        "val_loss_end": round(val_end, 3), "val_loss_fell": val_end < val_start,
    }


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _disturbed_rounds(soak: Soak, rounds: list[dict[str, Any]]) -> set[int]:
    """Rounds during which (give or take a round) a peer was killed, crashed, or came online."""
    span: dict[int, tuple[float, float]] = {}
    for e in rounds:
        lo, hi = span.get(e["round"], (e["time"], e["time"]))
        span[e["round"]] = (min(lo, e["time"]), max(hi, e["time"]))
    moments = [t for t, *_ in soak.kills] + [i.at for i in soak.incidents if i.kind == "crash"]
    moments += [p.events("online")[0]["time"] for p in soak.swarm.peers if p.events("online")]
    pad = soak.m.rounds.round_seconds
    return {r for r, (lo, hi) in span.items() if any(lo - 2 * pad <= t <= hi + pad for t in moments)}


def report(s: dict[str, Any], microbatch_size: int, round_s: float) -> str:
    stages = range(STAGES)
    rows = [
        ("wall time (chaos phase)", f"{s['wall_s']:.0f} s ({s['chaos_s']:.0f} s)"),
        ("kills (SIGKILL of a process group) / deferred", f"{s['kills']} / {s['kills_deferred']}"),
        ("peers started in all", s["peers_started"]),
        ("hangs (must be 0)", f"{s['hangs']} ({s['stalls_recovered']} stalls that recovered, longest "
                              f"{s['longest_stall_s']:.1f} s = {s['longest_stall_s'] / round_s:.1f} rounds)"),
        ("crashes / non-zero exits after SIGTERM", f"{s['crashes']} / {s['bad_exit_codes']}"),
        ("SIGTERM at the end: exit codes, slowest", f"{dict(s['shutdown_exit_codes'])}, {s['shutdown_max_s']:.1f} s"),
        ("processes left behind", s["leftover_processes"]),
        ("rounds completed per stage", ", ".join(f"stage {i}: {s['rounds_completed'][i]}" for i in stages)),
        ("rounds no replica completed", ", ".join(f"stage {i}: {s['rounds_incomplete'][i]}" for i in stages)),
        ("replica rounds incomplete", s["replica_rounds_incomplete"]),
        ("microbatches lost / retried (drivers)", f"{s['lost']} / {s['retried']}"),
        ("duplicated microbatches (stage 1, by id)",
         f"{s['duplicated']} of {s['stage1_microbatches']} (estimate from samples: {s['duplicated_estimate']:+.1f} "
         f"over {s['duplicate_clean_rounds']} undisturbed rounds)"),
        ("replicas bit-identical after every complete round",
         f"{'yes' if not s['digest_mismatches'] else 'NO: ' + str(s['digest_mismatches'][:5])} "
         f"({s['rounds_compared']} rounds with >= 2 replicas)"),
        ("validation loss start -> last before the chaos -> end (bits/byte)",
         f"{fmt(s['val_loss_start'], 3)} -> {fmt(s['val_loss_chaos_start'], 3)} ({_eval_name(s)}) -> "
         f"{fmt(s['val_loss_end'], 3)} ({'falls' if s['val_loss_fell'] else 'DOES NOT FALL'})"),
    ]
    return markdown_table(["chaos soak", "value"], rows)


def leftover_processes(pgids: Sequence[int]) -> list[int]:
    """Live (non-zombie) processes still in any of these process groups."""
    out = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(proc.pid) in pgids and proc.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return out


# the run -------------------------------------------------------------------------------------------
def _wait_ready(soak: Soak, timeout: float) -> None:
    """Every first peer online and a complete round on every stage, or RuntimeError."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        soak.reap_crashes()
        peers = soak.live()
        done = {e["stage"] for p in peers for e in p.events("round") if e["complete"]}
        if all(p.events("online") for p in peers) and done >= set(range(STAGES)):
            return
        time.sleep(1.0)
    raise RuntimeError(f"the swarm did not assemble within {timeout:.0f}s:\n" +
                       "\n".join(f"--- {p.name} ---\n{p.log_tail(10)}" for p in soak.live()))


def _wait_online(soak: Soak, timeout: float) -> None:
    """Let the last replacements come online before SIGTERM: the end checks how running peers stop.
    (A peer signalled while still importing dies of the signal: cli.py installs its handlers late.)"""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(p.events("online") for p in soak.live()):
        soak.reap_crashes()
        time.sleep(0.5)


def _progress(soak: Soak, t0: float) -> None:
    live = soak.live()
    latest = {s: max((e["round"] for p in live if p.stage == s for e in p.events("round") if e["complete"]),
                     default=None) for s in range(STAGES)}
    # one driver per round evaluates (data.evaluators): the swarm's latest figure, whoever made it
    evals = sorted((e for p in live if p.stage == 0 for e in p.events("eval") if e.get("val_loss")),
                   key=lambda e: e["time"])
    last_val = f"{evals[-1]['val_loss']:.2f}" if evals else "-"
    print(f"  t={time.time() - t0:6.1f}s live {len(live)} (online {sum(bool(p.events('online')) for p in live)}), "
          f"latest complete round {latest}, kills {len(soak.kills)}, last val {last_val}", flush=True)


def run(args: argparse.Namespace, m: Manifest, workdir: Path) -> dict[str, Any]:
    path = workdir / "manifest.toml"
    path.write_text(dumps(m))
    started = time.monotonic()
    env = {"HIVEMIND_LOGLEVEL": os.environ.get("HIVEMIND_LOGLEVEL", "WARNING")}
    with contextlib.ExitStack() as stack:
        if args.link == "loopback":
            swarm: LocalSwarm = LocalSwarm(path, workdir, env=env, verbose=args.verbose_peers)
        else:  # the swarm exits (its peers killed) before the namespaces go
            net = stack.enter_context(netns.WanNet("chaos", STAGES * REPLICAS, LINKS[args.link], subnet=60))
            swarm = SlotSwarm(path, workdir, net.endpoints, env, args.verbose_peers)
        stack.enter_context(swarm)
        soak, chaos_s, shutdown = _soak(args, m, swarm, workdir, started)
    pgids = [p.proc.pid for p in swarm.peers]
    return summarize(soak, time.monotonic() - started, chaos_s, shutdown, leftover_processes(pgids)) | \
        {"incidents": [asdict(i) for i in soak.incidents]}


def _soak(args: argparse.Namespace, m: Manifest, swarm: LocalSwarm, workdir: Path,
          started: float) -> tuple[Soak, float, dict[str, tuple[int | None, float]]]:
    """Start the swarm, kill and replace peers for --minutes, stop every peer: (soak, chaos seconds,
    each peer's exit after SIGTERM)."""
    soak = Soak(swarm, m, random.Random(seed_or(args, 0)), args.join_limit)
    first = swarm.start_first(0, timeout=180)
    soak.spawned[first.name] = time.time()
    if isinstance(swarm, SlotSwarm):
        soak.slots[first.name] = 0
    for i in range(1, STAGES * REPLICAS):
        soak.start(i % STAGES)
    _wait_ready(soak, 300)
    t0 = soak.chaos_t0 = time.time()
    print(f"swarm ready after {time.monotonic() - started:.0f}s; chaos for {args.minutes:g} min, "
          f"a kill every {args.kill_every:g}s, link {args.link} (logs: {workdir})", flush=True)
    next_kill, next_note = t0 + args.kill_every, t0 + 30
    while time.time() < t0 + args.minutes * 60:
        soak.reap_crashes()
        if time.time() >= next_kill:
            next_kill += args.kill_every if soak.kill_one(t0) else 1.0
        if time.time() >= next_note:
            _progress(soak, t0)
            next_note += 30
        time.sleep(0.25)
    chaos_s = time.time() - t0
    soak.reap_crashes()
    _wait_online(soak, args.join_limit)
    shutdown = soak.stop_all()
    soak.judge_stalls()
    return soak, chaos_s, shutdown


def _raise_on_term(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through LocalSwarm.__exit__, which reaps every peer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap, quick="a smoke run: 2 minutes, a kill every 20 s", seed="the victim choice (default 0)")
    ap.add_argument("--minutes", type=float, default=None, help="length of the chaos phase (default 10; 2 with --quick)")
    ap.add_argument("--kill-every", type=float, default=20.0, help="seconds between kills (default 20)")
    ap.add_argument("--manifest", type=Path, default=None, help="default: the tests' small manifest")
    ap.add_argument("--workdir", type=Path, default=None, help="logs and events (default runs/chaos-TIME)")
    ap.add_argument("--join-limit", type=float, default=120.0,
                    help="a peer not online this many seconds after it started counts as a hang")
    ap.add_argument("--verbose-peers", action="store_true", help="peers log at DEBUG (swarmgrad -v)")
    ap.add_argument("--link", choices=tuple(LINKS), default="loopback",
                    help="loopback, or one network namespace per peer slot: unshaped, or tbf 20mbit (root)")
    args = ap.parse_args()
    if args.minutes is None:
        args.minutes = 2.0 if args.quick else 10.0
    if args.minutes <= 0 or args.kill_every <= 0:
        ap.error("--minutes and --kill-every must be > 0")
    m = load(args.manifest) if args.manifest else chaos_manifest()
    if m.stages.count != STAGES or m.rounds.round_seconds <= 0:
        ap.error(f"the manifest needs stages.count = {STAGES} and rounds.round_seconds > 0 (stalls are counted in rounds)")
    if args.link != "loopback":
        why = netns.why_unavailable()
        if why:
            print(f"SKIP: --link {args.link} needs network namespaces: {why}")
            sys.exit(0)
        netns.remove_stale()
    workdir = args.workdir or Path("runs") / time.strftime("chaos-%Y%m%d-%H%M%S")
    workdir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _raise_on_term)
    s = run(args, m, workdir)
    print()
    out = Report("Chaos soak", args.out)
    out.print(report(s, m.inner.microbatch_size, m.rounds.round_seconds))
    for i in s["incidents"]:
        out.print(f"\n{i['kind'].upper()}: {i['peer']} (stage {i['stage']}) at "
                  f"{time.strftime('%H:%M:%S', time.localtime(i['at']))}: {i['detail']}\n{i['log_tail']}")
    print(json.dumps({k: v for k, v in s.items() if k != "incidents"} |
                     {"incidents": [{k: v for k, v in i.items() if k != "log_tail"} for i in s["incidents"]]}))
    out.results = s
    out.finish()
    ok = s["hangs"] == 0 and s["duplicated"] == 0 and s["crashes"] == 0 and s["bad_exit_codes"] == 0 and not s["leftover_processes"] \
        and not s["digest_mismatches"] and s["val_loss_fell"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
