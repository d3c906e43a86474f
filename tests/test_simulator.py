"""The placement simulator: deterministic for a seed, sane figures, a valid PNG, the CLI line."""
from __future__ import annotations

import importlib.util
import json
import struct

import pytest

from swarmgrad.peer.placement.rules import EMPTY_CHECK_SHARE, EMPTY_QUICK_CHECKS
from swarmgrad.peer.placement.plan import ONLINE, SnapshotReplica, Snapshot
from swarmgrad.peer.sim.config import SimConfig, SimResult, sim_manifest
from swarmgrad.peer.sim.report import write_png
from swarmgrad.peer.sim.simulator import Simulation, simulate
from swarmgrad.peer.placement.cost import stage_costs
from support.imports import hide_package


def small(**kw) -> SimConfig:
    return SimConfig(**{"peers": 80, "hours": 0.5, "seed": 3, **kw})


def test_same_seed_same_run_and_another_seed_differs() -> None:
    a, b = simulate(small()), simulate(small())
    assert a.summary() == b.summary() and a.series == b.series
    assert simulate(small(seed=4)).series != a.series


def test_figures_are_sane() -> None:
    for policy in ("full", "no-margin"):
        r = simulate(small(policy=policy))
        assert 0.5 < r.throughput_ratio <= 1.0 + 1e-9
        assert all(tp <= best * (1 + 1e-9) for _, tp, best in r.series)  # the bound bounds
        assert 0.5 < r.paper_ratio <= 1.0 + 1e-9  # the bound of all peers bounds any assignment of them
        assert r.moves_per_peer_hour >= 0 and r.joins > 0 and r.leaves > 0
        assert r.min_ratio_after_departure < 1.0  # the mass departure is felt


def test_png_is_valid(tmp_path) -> None:
    image = pytest.importorskip("matplotlib.image")
    path = tmp_path / "plot.png"
    assert write_png(str(path), [(0.0, 1.0, 2.0), (10.0, 1.5, 2.0), (20.0, 2.0, 2.0)], width=640, height=320)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, tag = struct.unpack(">I4s", data[8:16])
    assert tag == b"IHDR" and struct.unpack(">II", data[16:24]) == (640, 320)
    pixels = image.imread(path)  # decodes the whole file
    assert pixels.shape[:2] == (320, 640) and pixels.shape[2] in (3, 4)
    assert len({tuple(p) for p in pixels.reshape(-1, pixels.shape[2])[::5]}) > 2  # something was drawn


def test_without_matplotlib_the_plot_is_skipped_in_one_line_and_the_figures_still_print(tmp_path, monkeypatch,
                                                                                        capsys) -> None:
    from swarmgrad.peer.cli.main import main
    hide_package(monkeypatch, "matplotlib")
    assert main(["simulate", "--peers", "40", "--hours", "0.3", "--seed", "1", "--json",
                 "--plot", str(tmp_path / "p.png")]) == 0
    captured = capsys.readouterr()
    assert "throughput_ratio" in json.loads(captured.out.strip().splitlines()[-1])
    assert captured.err.strip().splitlines() == [
        "swarmgrad simulate: --plot skipped: matplotlib is not installed (pip install 'swarmgrad[bench]')"]
    assert not (tmp_path / "p.png").exists()


def test_cli_prints_the_figures(capsys, tmp_path) -> None:
    from swarmgrad.peer.cli.main import main
    assert main(["simulate", "--peers", "40", "--hours", "0.3", "--seed", "1", "--json",
                 "--plot", str(tmp_path / "p.png")]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"throughput_ratio", "moves_per_peer_hour", "recovery_s"} <= set(out)
    if importlib.util.find_spec("matplotlib") is not None:  # without it: the test above
        assert (tmp_path / "p.png").stat().st_size > 100
    assert main(["simulate", "--peers", "40", "--hours", "0.3", "--policy", "no-margin"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "throughput_ratio=" in last and "moves_per_peer_hour=" in last


def test_reaction_limit_counts_departures_only_until_repaired() -> None:
    r = simulate(small())
    assert r.reaction_s > 0 and 0.5 < r.reaction_limit <= 1.0
    assert r.reaction_limit < 1.0  # departures happened, the mass one included
    calm = simulate(small(mass_fraction=0.0, tenure_median_h=1e6))  # nobody leaves
    assert calm.leaves == 0 and calm.reaction_limit == 1.0
    slower = simulate(small(warmup_s=300.0))  # a longer repair leaves more unrepaired
    assert slower.reaction_limit < r.reaction_limit


def test_warm_standbys_join_without_a_download_only_from_fresh_copies() -> None:
    warm = simulate(small())
    assert warm.warm_moves > 0 and warm.backup_bytes_per_round > 0
    cold = simulate(small(backup_copies=0))  # no backups: every mover downloads
    assert cold.warm_moves == 0 and cold.backup_bytes_per_round == 0
    # a copy that takes longer than a round to arrive (1.3 GB at 10 Mbit/s: ~17 min) is of a round
    # the stage has already left when it lands: pushed, never fresh, never joined from
    slow = simulate(small(round_s=300, bandwidth_median_mbit=10, bandwidth_sigma=0.0, hosted_bandwidth_median_mbit=0))
    assert slow.backup_bytes_per_round > 0 and slow.warm_moves == 0
    assert warm.reaction_limit_warm > warm.reaction_limit  # a warm-up is shorter than download + warm-up


def test_listening_holders_stay_fresh_after_the_round_their_copy_is_of() -> None:
    from swarmgrad.peer.sim.config import sim_manifest
    from swarmgrad.peer.sim.simulator import Simulation, _Peer
    from swarmgrad.peer.placement.cost import stage_costs
    costs = stage_costs(sim_manifest())
    for listen, expected in ((False, frozenset()), (True, frozenset({1}))):
        sim = Simulation(small(holders_listen=listen), costs)
        p = _Peer("p1", 1e12, 1e12, 0, 1e7, 0.0, 2)
        p.stage, p.copies = 0, {1: 0, 0: 0}  # a copy of stage 1 of round 0; its own stage never counts
        sim.now = 0.0
        assert sim._fresh(p) == frozenset({1})
        sim.now = 3 * sim.cfg.round_s  # three boundaries later: stale, unless it kept listening
        assert sim._fresh(p) == expected


def test_hosted_cards_draw_their_links_from_their_own_law_and_nothing_else_changes() -> None:
    from swarmgrad.peer.sim.config import sim_manifest
    from swarmgrad.peer.sim.simulator import Simulation
    from swarmgrad.peer.placement.cost import stage_costs
    costs = stage_costs(sim_manifest())
    home, mixed = (Simulation(small(hosted_bandwidth_median_mbit=0.0), costs),
                   Simulation(small(hosted_bandwidth_median_mbit=5000.0), costs))
    a = [home._new_peer() for _ in range(400)]
    b = [mixed._new_peer() for _ in range(400)]
    assert [(p.speed, p.memory) for p in a] == [(p.speed, p.memory) for p in b]  # same devices, same draws
    changed = [(p.bandwidth, q.bandwidth) for p, q in zip(a, b) if p.bandwidth != q.bandwidth]
    assert 0.3 < len(changed) / len(a) < 0.56  # the data-centre cards: 43 % of the mix
    assert all(faster > slow for slow, faster in changed)
    assert all(p.bandwidth <= 1000e6 / 8 for p in a) and max(q for _, q in changed) > 1000e6 / 8


def test_paced_backups_push_less_and_leave_fewer_fresh_copies() -> None:
    every = simulate(small(backup_link_share=1.0))
    paced = simulate(small(backup_link_share=0.02))
    # a push that took d s lets the next go d / 0.02 s later: at these links most rounds push nothing
    assert 0 < paced.backup_bytes_per_round < every.backup_bytes_per_round / 2
    assert paced.warm_moves < every.warm_moves


class _Watched(Simulation):
    """Records who checks whether to move, and every admitted peer's first stage."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.checked: set[str] = set()
        self.first_stage: dict[str, int] = {}

    def _check(self, p) -> None:
        self.checked.add(p.id)
        super()._check(p)

    def _admit(self, p, snapshot, online) -> bool:
        admitted = super()._admit(p, snapshot, online)
        if admitted:
            self.first_stage[p.id] = p.stage
        return admitted


def _watched(cfg: SimConfig) -> tuple[_Watched, SimResult]:
    sim = _Watched(cfg, stage_costs(sim_manifest()))
    return sim, sim.run()


def test_pinned_peers_never_check_or_move_and_the_rest_still_do() -> None:
    sim, r = _watched(small(pinned_share=0.4))
    pinned = {pid for pid, p in sim.peers.items() if p.pinned}
    assert pinned and len(pinned) < len(sim.peers)
    assert not pinned & sim.checked and sim.checked  # the free peers check, the pinned never do
    assert all(sim.peers[pid].stage == sim.first_stage[pid] and sim.peers[pid].phase in ("join", "online")
               for pid in pinned)
    assert r.moves > 0 and 0 < r.pinned_bound_ratio <= 1.0 + 1e-9
    assert all(tp <= best * (1 + 1e-9) for _, tp, best in r.series)
    # the records say so: no plan picks a pinned peer
    assert all(rep.pinned == (rep.peer_id in pinned) for stage in sim.snap.stages for rep in stage)


def test_no_pinned_share_draws_nothing_and_costs_nothing() -> None:
    r = simulate(small())
    assert r.pinned_bound_ratio == 1.0
    assert simulate(small(pinned_share=0.0, pinned_stage=0)).series == r.series  # the stage alone changes nothing


def test_every_peer_pinned_on_one_stage_serves_nothing() -> None:
    """NAT clients all on stage 0 (a driver) leave every other stage empty: no throughput, and the
    bound with them kept there is 0 too."""
    r = simulate(small(pinned_share=1.0, pinned_stage=0))
    assert r.moves == 0 and r.pinned_bound_ratio == 0.0
    assert all(tp == 0.0 for _, tp, _ in r.series)
    free = simulate(small(pinned_share=1.0))  # each placed where a newcomer would go, then never moved
    assert free.moves == 0 and free.throughput_ratio > 0.5


def test_a_peer_checks_more_often_while_a_stage_is_empty() -> None:
    cfg = small()
    sim = Simulation(cfg, stage_costs(sim_manifest()))
    p = sim._new_peer()
    p.phase, p.stage = "online", 0
    sim.peers[p.id] = p
    sim.measured[p.id] = 1.0

    def next_check() -> float:
        sim.events.clear()
        sim._check(p)
        (t, _, kind, pid, _), = sim.events
        assert kind == "check" and pid == p.id
        return t - sim.now

    sim.snap = Snapshot(tuple(() for _ in sim.c), sim.c, sim.need, sim.state_bytes)  # every stage empty
    quick = [next_check() for _ in range(EMPTY_QUICK_CHECKS - 1)]
    assert max(quick) <= 1.5 * cfg.check_s / EMPTY_CHECK_SHARE
    # the checks found no move for this peer: back to the ordinary interval while nothing changes
    assert min(next_check() for _ in range(20)) >= 0.5 * cfg.check_s
    one = [(SnapshotReplica("y", ONLINE, 1.0, 1 << 40),)] + [()] * (len(sim.c) - 1)
    sim.snap = Snapshot(tuple(one), sim.c, sim.need, sim.state_bytes)  # other stages empty now: quick again
    assert next_check() <= 1.5 * cfg.check_s / EMPTY_CHECK_SHARE
    full = [tuple(SnapshotReplica(f"x{s}", ONLINE, 1.0, 1 << 40) for _ in range(2)) for s in range(len(sim.c))]
    sim.snap = Snapshot(((SnapshotReplica(p.id, ONLINE, 1.0, p.memory),) + full[0], *full[1:]),
                        sim.c, sim.need, sim.state_bytes)
    ordinary = [next_check() for _ in range(50)]
    assert min(ordinary) >= 0.5 * cfg.check_s


def test_bad_pinned_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="pinned_share"):
        small(pinned_share=1.5)
    with pytest.raises(ValueError, match="pinned_stage 99"):
        simulate(small(pinned_share=0.1, pinned_stage=99))


def test_bad_claims_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="claims must be"):
        small(claims="believe")
    with pytest.raises(ValueError, match="forged_records"):
        small(forged_records=-1)


def test_evidence_rules_mark_newcomers_unproven_until_a_round_boundary() -> None:
    """--claims record/stage: before the first boundary every record counts (nothing proven yet);
    after it, a peer proven is one that served through a boundary, and forged records never are."""
    sim = Simulation(small(claims="stage", forged_records=3, forged_stage=1), stage_costs(sim_manifest()))
    sim.run()
    snap = sim._snapshot()
    forged = [r for r in snap.stages[1] if r.peer_id.startswith("forged")]
    assert len(forged) == 3 and not any(r.proven for r in forged)
    proven = [r for reps in snap.stages for r in reps if r.proven]
    assert proven and all(sim.peers[r.peer_id].since // sim.cfg.round_s < sim.now // sim.cfg.round_s for r in proven)
    top = max(r.rate * snap.costs[s] for s, reps in enumerate(snap.stages) for r in reps if r.proven)
    assert sum(r.rate for r in forged) * snap.costs[1] <= top * (1 + 1e-9)  # together one top replica
    sim = Simulation(small(claims="stage"), stage_costs(sim_manifest()))
    assert all(r.proven for reps in sim._snapshot().stages for r in reps)  # t = 0: nothing proven yet


def test_forged_records_cost_far_less_bounded_per_stage_than_per_record() -> None:
    """The attack the per-stage bound is for (docs/trust.md, "Placement capacity"): ten fresh ids
    claiming a huge rate under one stage of a small swarm, played by the daemon's rules."""
    def ratio(claims: str, forged: int) -> float:
        return simulate(SimConfig(peers=80, hours=3.0, seed=0, claims=claims, forged_records=forged,
                                  forged_stage=2)).throughput_ratio
    per_record, per_stage = ratio("record", 10), ratio("stage", 10)
    assert per_record < 0.5 * ratio("record", 0)  # the rebalancer plans the stage's replicas away
    assert per_stage > 3 * per_record


def test_the_benchmark_pairs_variants_seed_by_seed_and_says_when_the_seeds_cannot_tell() -> None:
    from benchmarks import simulate as bench
    d, se = bench.paired([0.970, 0.965, 0.975], [0.972, 0.966, 0.978])
    assert d == pytest.approx(0.002) and se == pytest.approx(0.000577, abs=1e-6)
    assert bench.paired([0.97], [0.98]) == (pytest.approx(0.01), 0.0)
    rows = bench.paired_rows(["a", "b", "c"], [[0.970, 0.965, 0.975], [0.972, 0.966, 0.978],
                                               [0.975, 0.960, 0.976]])
    assert rows[2].startswith("| b | +0.0020 ± 0.0006 | yes |")
    assert rows[3].startswith("| c | +0.0003 ±") and rows[3].endswith("| no |")
    with pytest.raises(ValueError):
        bench.paired([0.97, 0.96], [0.97])  # not the same seeds


def test_the_benchmark_runs_end_to_end_on_a_small_swarm(capsys) -> None:
    from benchmarks import simulate as bench
    assert bench.main(["--peers", "30", "--hours", "0.2", "--seeds", "0", "1", "--jobs", "1",
                       "--only", "full", "full, no backups"]) == 0
    out = capsys.readouterr().out
    assert "| **full, mean** |" in out and "| **full, no backups, mean** |" in out
    assert "| full, no backups | " in out and "Δ ratio vs full" in out


def test_the_cli_refuses_bad_values_in_one_line(capsys) -> None:
    from swarmgrad.peer.cli.main import main
    for flags, says in ((["--pinned-share", "1.5"], "--pinned-share: must be a fraction in 0..1"),
                        (["--peers", "0"], "--peers: must be >= 1"),
                        (["--link-mbit", "-3"], "--link-mbit: must be a finite number >= 0")):
        with pytest.raises(SystemExit) as exit_:
            main(["simulate", *flags])
        assert exit_.value.code == 2 and says in capsys.readouterr().err
    for flags, says in ((["--pinned-share", "0.5", "--pinned-stage", "9"], "pinned_stage 9 is outside 0..7"),
                        (["--hours", "0"], "hours > 0"),
                        (["--forged-records", "3", "--forged-stage", "9"], "forged_stage 9 is outside 0..7")):
        assert main(["simulate", "--peers", "20", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("swarmgrad simulate: error: ") and says in err and "Traceback" not in err
