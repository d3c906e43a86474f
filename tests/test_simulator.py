"""The placement simulator: deterministic for a seed, sane figures, a valid PNG, the CLI line."""
from __future__ import annotations

import json
import struct
import zlib

from swarmgrad.peer.sim_config import SimConfig
from swarmgrad.peer.sim_report import write_png
from swarmgrad.peer.simulator import simulate


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
    path = tmp_path / "plot.png"
    write_png(str(path), [(0.0, 1.0, 2.0), (10.0, 1.5, 2.0), (20.0, 2.0, 2.0)], width=64, height=32)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, tag = struct.unpack(">I4s", data[8:16])
    assert tag == b"IHDR" and struct.unpack(">II", data[16:24]) == (64, 32)
    idat_at = data.index(b"IDAT")
    (n,) = struct.unpack(">I", data[idat_at - 4:idat_at])
    raw = zlib.decompress(data[idat_at + 4:idat_at + 4 + n])
    assert len(raw) == 32 * (1 + 64 * 3)
    assert set(raw) - {0, 255}  # something was drawn


def test_cli_prints_the_figures(capsys, tmp_path) -> None:
    from swarmgrad.peer.cli import main
    assert main(["simulate", "--peers", "40", "--hours", "0.3", "--seed", "1", "--json",
                 "--plot", str(tmp_path / "p.png")]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"throughput_ratio", "moves_per_peer_hour", "recovery_s"} <= set(out)
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
    slow = simulate(small(round_s=300, bandwidth_median_mbit=10, bandwidth_sigma=0.0))
    assert slow.backup_bytes_per_round > 0 and slow.warm_moves == 0
    assert warm.reaction_limit_warm > warm.reaction_limit  # a warm-up is shorter than download + warm-up


def test_listening_holders_stay_fresh_after_the_round_their_copy_is_of() -> None:
    from swarmgrad.peer.sim_config import sim_manifest
    from swarmgrad.peer.simulator import Simulation, _Peer
    from swarmgrad.peer.stage_cost import stage_costs
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
    from swarmgrad.peer.sim_config import sim_manifest
    from swarmgrad.peer.simulator import Simulation
    from swarmgrad.peer.stage_cost import stage_costs
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
