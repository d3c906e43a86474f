"""The simulator's outputs: a PNG of throughput against the optimum over time (stdlib only), the
one-line summary and ``swarmgrad simulate``'s entry point."""
from __future__ import annotations

import json
import sys
from typing import Sequence

from swarmgrad.peer.sim.png import Canvas
from swarmgrad.peer.sim.config import SimConfig, SimResult, sim_manifest
from swarmgrad.peer.sim.simulator import Simulation
from swarmgrad.peer.placement.cost import stage_costs


def write_png(path: str, series: Sequence[tuple[float, float, float]], width: int = 900, height: int = 320) -> None:
    """Throughput (blue) and optimum (grey) over time as a PNG; stdlib only, no axes text."""
    pad = 10
    cv = Canvas(width, height)
    t_end = max((t for t, _, _ in series), default=1.0) or 1.0
    top = max((max(a, b) for _, a, b in series), default=1.0) * 1.05 or 1.0

    def xy(t: float, v: float) -> tuple[int, int]:
        return (pad + round((width - 2 * pad) * t / t_end), height - pad - round((height - 2 * pad) * v / top))

    cv.line(pad, height - pad, width - pad, height - pad, (0, 0, 0))
    cv.line(pad, pad, pad, height - pad, (0, 0, 0))
    for frac in (0.25, 0.5, 0.75, 1.0):  # light grid at quarters of the top value
        _, y = xy(0, top / 1.05 * frac)
        cv.line(pad + 1, y, width - pad, y, (225, 225, 225))
    for col, rgb in ((2, (150, 150, 150)), (1, (30, 90, 200))):
        pts = [xy(s[0], s[col]) for s in series]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            cv.line(x0, y0, x1, y1, rgb)
    with open(path, "wb") as f:
        f.write(cv.png())


def format_line(r: SimResult) -> str:
    rec = "never" if r.recovery_s is None else f"{r.recovery_s:.0f}"
    return (f"policy={r.policy} throughput_ratio={r.throughput_ratio:.4f} "
            f"moves_per_peer_hour={r.moves_per_peer_hour:.4f} recovery_s={rec} moves={r.moves} "
            f"joins={r.joins} leaves={r.leaves} refused={r.refused} "
            f"min_ratio_after_departure={r.min_ratio_after_departure:.3f} reaction_limit={r.reaction_limit:.4f} "
            f"warm_moves={r.warm_moves} pinned_bound_ratio={r.pinned_bound_ratio:.4f}")


def run_cli(peers: int, hours: float, seed: int, policy: str, as_json: bool, plot: str | None,
            link_mbit: float, hosted_link_mbit: float, pinned_share: float = 0.0,
            pinned_stage: int | None = None) -> int:
    """`swarmgrad simulate`: one run; the last line (or the JSON) carries throughput_ratio and
    moves_per_peer_hour."""
    try:  # what only the configuration can check (hours > 0, a stage that exists) is one line, not a traceback
        sim = Simulation(SimConfig(peers=peers, hours=hours, seed=seed, policy=policy, bandwidth_median_mbit=link_mbit,
                                   hosted_bandwidth_median_mbit=hosted_link_mbit, pinned_share=pinned_share,
                                   pinned_stage=pinned_stage), stage_costs(sim_manifest()))
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
