"""What the simulator (``simulator.py``) plays: the devices peers draw, the run's configuration
(churn, links, rounds, backups) and the figures it reports. Pure data; the GPU figures are cited
below, the churn and link laws are assumptions stated on each field."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from swarmgrad.peer.manifest import Manifest, from_dict


@dataclass(frozen=True)
class Device:
    name: str
    tflops: float
    """Peak dense FP16 tensor-core TFLOPS (FP32 accumulate on GeForce cards)."""
    memory_gb: float
    share: float
    """Fraction of the simulated swarm (an assumed mix of volunteer and rented GPUs)."""
    hosted: bool = False
    """A data-centre card (rented by the hour): its link is drawn from
    ``SimConfig.hosted_bandwidth_median_mbit`` when that is set."""


# Figures from NVIDIA's datasheets and architecture whitepapers: Ampere GA10x whitepaper
# (RTX 3060, 3090: FP16 tensor with FP32 accumulate), Ada whitepaper (RTX 4090), T4, V100 SXM2,
# A10, A100 SXM and H100 SXM datasheets. Peak ratios overstate the gaps real training shows
# (memory bandwidth, kernels); the per-peer efficiency draw below blurs them a little.
DEVICES = (
    Device("RTX 3060", 25.6, 12, 0.22),
    Device("RTX 3090", 71.0, 24, 0.20),
    Device("RTX 4090", 165.2, 24, 0.15),
    Device("T4", 65.0, 16, 0.10, hosted=True),
    Device("V100", 125.0, 16, 0.08, hosted=True),
    Device("A10", 125.0, 24, 0.10, hosted=True),
    Device("A100", 312.0, 80, 0.10, hosted=True),
    Device("H100", 989.0, 80, 0.05, hosted=True),
)


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    peers: int = 1000
    """Mean swarm size (the arrival rate is peers / mean online time)."""
    hours: float = 3.0
    seed: int = 0
    policy: str = "full"
    """"full" (the daemon's ``placement.SWARM_POLICY``: q = 0.8 in a handful of peers, no margin in a
    large swarm; the 1000-peer figures do not depend on the small-swarm margin) or "no-margin"
    (``NO_MARGIN``)."""
    q: float | None = None
    """Override the full policy's margin, small and large swarms alike (None: ``SWARM_POLICY``)."""
    check_s: float = 15.0
    """Mean seconds between a peer's placement checks (jittered by ``check_interval``): the
    daemon's ``timeouts.rebalance_check``."""
    confirm_s: float = 30.0
    """Mean seconds to the confirming check after a first decision (two snapshot refreshes)."""
    snapshot_s: float = 15.0
    """How often the DHT view peers decide on is refreshed."""
    sample_s: float = 30.0
    tenure_median_h: float = 3.0
    tenure_sigma: float = 1.2
    """Log-normal online time: median 3 h, mean ~6 h, a tail of day-long peers (an assumption
    for rented and volunteer GPUs; Petals and BOINC report hours-to-days sessions)."""
    min_tenure_s: float = 300.0
    mass_fraction: float = 0.3
    """Peers that leave at once at mid-run (0: none)."""
    bandwidth_median_mbit: float = 100.0
    """Median of a peer's link (log-normal, clamped to 10–1000 Mbit/s): home broadband."""
    bandwidth_sigma: float = 0.8
    hosted_bandwidth_median_mbit: float = 1000.0
    """Median link of the data-centre cards (``Device.hosted``: T4, V100, A10, A100, H100; 43 % of
    the swarm), clamped to 10–10,000 Mbit/s; 0: the home law for every peer. Cloud instances
    with these GPUs have 1–100+ Gbit/s NICs; a 1 Gbit/s median is a conservative setting for
    that, and a rented card is not behind a home uplink."""
    warmup_s: float = 30.0
    mfu: float = 0.35
    efficiency_sigma: float = 0.15
    noise: float = 0.03
    """Relative noise of a measured rate, redrawn per snapshot."""
    memory_usable: float = 0.9
    """Share of a card's memory a stage may use (CUDA context, fragmentation)."""
    recover_ratio: float = 0.95
    round_s: float = 600.0
    """Seconds per averaging round (wall-clock rounds, aligned across stages). A 1.3B model's
    DiLoCo round is minutes of inner steps (H ≈ 500); only the backups' freshness depends on it."""
    backup_every: int = 1
    """``averaging.backup_every``: a stage pushes its committed state every this many rounds."""
    backup_link_share: float = 0.2
    """``averaging.backup_link_share``: after a push that took d seconds the stage's next waits
    d / this (``decisions.next_push_at``); 1: no pacing."""
    parallel_push: bool = False
    """Copy i is pushed by the stage's member i (by peer id), all at once; False: the first member
    pushes every copy in turn, so copy K lands K transfers late."""
    confirm_warm: bool = True
    """``PlacementPolicy.confirm_warm``."""
    fresh_check_s: float = 15.0
    """Mean seconds between checks of a peer holding a fresh backup (0: like every peer): it is
    the swarm's fastest repair, so it looks at every snapshot refresh."""
    backup_copies: int = 2
    """Holders per stage (``backup.BACKUP_COPIES``); 0: no backups, every mover downloads."""
    pinned_share: float = 0.0
    """Share of peers that are pinned (``--stage N`` with rebalancing off, or behind NAT in client
    mode): they never move, and their records say so, so no plan picks them (``Replica.pinned``).
    0 draws nothing from the random stream: a seed plays the same swarm as it would without
    this option."""
    pinned_stage: int | None = None
    """The stage pinned peers serve: None, the stage a newcomer would choose on arrival (an operator
    who picked well once); N, every one on stage N (0: NAT clients, which drive). A peer whose
    memory does not hold stage N is refused."""
    holders_listen: bool = False
    """What-if, not in the daemon: a holder, once it has a copy, stays fresh at every boundary, as
    if it applied each round's averaged update as a listening member of the stage's group
    (docs/placement.md, "not built"). Measures what such holders would be worth."""

    claims: str = "trusted"
    """How placement counts the records it reads (docs/trust.md, "Placement capacity"): "trusted",
    every record as it comes (placement before evidence); "record", the daemon's rule: a replica is
    proven once it served through a round boundary in a stage of two or more (its first completed
    round), and an unproven record's rate counts at most as the top proven one (``bound_claims``);
    "stage", that and the unproven records of a stage together at most ``claims_stage_share``
    × its proven capacity or one top replica, whichever is larger. Before the first boundary every
    record counts (nothing has been proven yet, as ``WorkSeen.seen_any``)."""
    claims_stage_share: float = 0.0
    forged_records: int = 0
    """Forged ONLINE records (fresh ids serving nothing) under ``forged_stage``, in every view."""
    forged_stage: int = 0
    forged_claim: float = 100.0
    """What each forged record claims: this many times the fastest device's rate on that stage."""

    def link_law(self, device: Device) -> tuple[float, float]:
        """(median, cap) in Mbit/s of the links `device`'s peers draw (log-normal, ``bandwidth_sigma``)."""
        if device.hosted and self.hosted_bandwidth_median_mbit:
            return self.hosted_bandwidth_median_mbit, 10_000.0
        return self.bandwidth_median_mbit, 1000.0

    def __post_init__(self) -> None:
        if self.policy not in ("full", "no-margin"):
            raise ValueError(f"SimConfig.policy must be 'full' or 'no-margin' (got {self.policy!r})")
        if self.peers < 1 or not self.hours > 0:
            raise ValueError("SimConfig.peers must be >= 1 and hours > 0")
        if self.hosted_bandwidth_median_mbit < 0 or not self.bandwidth_median_mbit > 0:
            raise ValueError("SimConfig.bandwidth_median_mbit must be > 0 and hosted_bandwidth_median_mbit >= 0")
        if not self.round_s > 0 or self.backup_every < 0 or self.backup_copies < 0:
            raise ValueError("SimConfig.round_s must be > 0, backup_every and backup_copies >= 0")
        if not 0 < self.backup_link_share <= 1:
            raise ValueError("SimConfig.backup_link_share must be in (0, 1]")
        if not 0 <= self.pinned_share <= 1:
            raise ValueError("SimConfig.pinned_share must be in [0, 1]")
        if self.claims not in ("trusted", "record", "stage"):
            raise ValueError(f"SimConfig.claims must be 'trusted', 'record' or 'stage' (got {self.claims!r})")
        if self.forged_records < 0 or self.claims_stage_share < 0:
            raise ValueError("SimConfig.forged_records and claims_stage_share must be >= 0")


@dataclass
class SimResult:
    throughput_ratio: float
    moves_per_peer_hour: float
    recovery_s: float | None
    """Seconds from the mass departure until the ratio is back at recover_ratio (None: never)."""
    moves: int
    joins: int
    leaves: int
    refused: int
    """Arrivals whose memory fits no stage."""
    peer_hours: float
    min_ratio_after_departure: float
    policy: str
    reaction_limit: float = 1.0
    """The ratio if each departure were repaired exactly reaction_s after it (see the module doc)."""
    reaction_s: float = 0.0
    reaction_limit_warm: float = 1.0
    """The same with every repair after the warm-up alone (a fresh backup for every departure)."""
    warm_moves: int = 0
    """Moves that joined from a fresh local backup (no download)."""
    backup_bytes_per_round: float = 0.0
    """Mean bytes of backups pushed per round, all stages together."""
    averaging_bytes_per_round: float = 0.0
    """For scale: bytes one round of averaging sends, all stages (every serving replica sends
    about 2 × its stage's parameters in int8: reduce-scatter plus all-gather)."""
    paper_ratio: float = 1.0
    """The assignment on paper against the bound, time-averaged: every peer counted on the stage it
    serves or is joining (newcomers and movers at their target, at true rates), over the fluid
    bound of all peers. What a repair counts as done before it serves."""
    pinned_bound_ratio: float = 1.0
    """What pinning alone costs, time-averaged: the fluid bound with the pinned peers kept on their
    stages over the bound with every peer free (1: no pinned peer, or they sit where the bound
    would use them). ``throughput_ratio`` is over the free bound, so it includes this."""
    optimum_method: str = "bound"
    series: list[tuple[float, float, float]] = field(default_factory=list)
    """(seconds, throughput, optimum) samples, in samples/s."""

    def summary(self) -> dict:
        out = asdict(self)
        out.pop("series")
        return out


def sim_manifest() -> Manifest:
    """A larger GPT than the demo's, in 8 stages, so that placement matters."""
    return from_dict({
        "run_id": "sim-gpt-1b", "model": {"d_model": 2048, "n_layers": 20, "n_heads": 16, "seq_len": 1024},
        "stages": {"count": 8}, "inner": {"microbatch_size": 6}, "pipeline": {"max_in_flight": 4},
    })
