"""The simulator's outputs: a plot of throughput against the optimum over time (PNG, drawn with
matplotlib, the ``bench`` extra), the one-line summary and ``swarmgrad simulate``'s entry point."""
from __future__ import annotations

import json
import sys
from typing import Sequence

from swarmgrad.peer.sim.config import SimConfig, SimResult, sim_manifest
from swarmgrad.peer.sim.simulator import Simulation
from swarmgrad.peer.placement.cost import stage_costs


def write_png(path: str, series: Sequence[tuple[float, float, float]], width: int = 1000,
              height: int = 420) -> bool:
    """Throughput and the optimum (samples/s) against simulated time as a `width` x `height` PNG.
    Without matplotlib: one line on stderr saying so, nothing written, False (the run's figures
    are printed all the same)."""
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError:
        print("swarmgrad simulate: --plot skipped: matplotlib is not installed (pip install 'swarmgrad[bench]')",
              file=sys.stderr)
        return False
    hours = [t / 3600 for t, _, _ in series]
    with matplotlib.rc_context({"font.size": 11, "axes.titlesize": 12, "legend.fontsize": 10, "axes.grid": True,
                                "grid.alpha": 0.3}):
        fig = Figure(figsize=(width / 100, height / 100), dpi=100, layout="constrained")
        ax = fig.subplots()
        ax.plot(hours, [best for _, _, best in series], color="0.55", linewidth=1.5, label="optimum (fluid bound)")
        ax.plot(hours, [tp for _, tp, _ in series], color="tab:blue", linewidth=1.5, label="swarm throughput")
        ax.set_title("Simulated swarm: throughput against the optimum")
        ax.set_xlabel("simulated time (hours)")
        ax.set_ylabel("samples/s")
        ax.set_ylim(bottom=0)
        ax.legend(loc="lower left")
        fig.savefig(path, format="png")
    return True


def format_line(r: SimResult) -> str:
    rec = "never" if r.recovery_s is None else f"{r.recovery_s:.0f}"
    return (f"policy={r.policy} throughput_ratio={r.throughput_ratio:.4f} "
            f"moves_per_peer_hour={r.moves_per_peer_hour:.4f} recovery_s={rec} moves={r.moves} "
            f"joins={r.joins} leaves={r.leaves} refused={r.refused} "
            f"min_ratio_after_departure={r.min_ratio_after_departure:.3f} reaction_limit={r.reaction_limit:.4f} "
            f"warm_moves={r.warm_moves} pinned_bound_ratio={r.pinned_bound_ratio:.4f}")


def run_cli(peers: int, hours: float, seed: int, policy: str, as_json: bool, plot: str | None,
            link_mbit: float, hosted_link_mbit: float, pinned_share: float = 0.0,
            pinned_stage: int | None = None, claims: str = "trusted", claims_stage_share: float = 0.0,
            forged_records: int = 0, forged_stage: int = 0) -> int:
    """`swarmgrad simulate`: one run; the last line (or the JSON) carries throughput_ratio and
    moves_per_peer_hour."""
    try:  # what only the configuration can check (hours > 0, a stage that exists) is one line, not a traceback
        sim = Simulation(SimConfig(peers=peers, hours=hours, seed=seed, policy=policy, bandwidth_median_mbit=link_mbit,
                                   hosted_bandwidth_median_mbit=hosted_link_mbit, pinned_share=pinned_share,
                                   pinned_stage=pinned_stage, claims=claims, claims_stage_share=claims_stage_share,
                                   forged_records=forged_records, forged_stage=forged_stage),
                         stage_costs(sim_manifest()))
    except ValueError as e:
        print(f"swarmgrad simulate: error: {e}", file=sys.stderr)
        return 2
    result = sim.run()
    if plot:
        write_png(plot, result.series)
    if as_json:
        print(json.dumps(result.summary(), sort_keys=True))
    else:
        print(format_line(result))
    return 0
