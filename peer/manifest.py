"""The run manifest: a TOML run spec loaded into frozen dataclasses, validated, hashed.

Every peer of a run loads the same manifest; its hash travels with every DHT record and
every RPC, and a peer refuses work for another hash. Errors name the field and the fix, so
a user editing TOML sees ``manifest: inner.lr must be > 0 (got -1)`` rather than a traceback
from deep inside the optimiser.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class ManifestError(ValueError):
    """A manifest that cannot be used; the message names the offending field."""


def _fail(field_name: str, problem: str) -> ManifestError:
    return ManifestError(f"manifest: {field_name} {problem}")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    kind: str = "gpt"
    """`gpt` (the built-in byte-level decoder), `llama` (peer/model/llama.py) or `entry_point` (a user function)."""
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    seq_len: int = 128
    n_kv_heads: int = 0
    """llama: key/value heads (grouped-query attention), dividing n_heads; 0 means n_heads."""
    ffn_hidden: int = 0
    """llama: SwiGLU width; 0 means Llama's: 8/3·d_model rounded up to a multiple of 256."""
    rope_theta: float = 10000.0
    """llama: base of the rotary position embedding's frequencies."""
    norm_eps: float = 1e-5
    """llama: RMSNorm epsilon."""
    tie_embeddings: bool = False
    """llama: the head reuses the embedding matrix; needs both on one stage (stages.count = 1)."""
    init_from: str = ""
    """llama: a Hugging Face checkpoint folder (config.json + safetensors) to start from instead of
    the seeded initialisation; relative to the manifest's folder. Each peer reads only its stage's tensors."""
    boundary_subspace: int = 0
    """llama: k > 0 constrains every residual write before the last stage boundary to a seeded
    k-dimensional subspace, so k values per token cross a boundary instead of d_model, exactly
    (docs/models.md); 0: off."""
    entry_point: str = ""
    """`package.module:function` returning a StagedModel; only with kind = "entry_point"."""
    params: Mapping[str, Any] = field(default_factory=dict)
    """Free-form keyword parameters handed to the entry point."""
    dtype: str = "float32"
    """What the forward's matmuls compute in on CUDA: `float32` or `bfloat16` (autocast; parameters,
    gradients and optimiser state stay fp32). CPU peers compute in float32 unless a peer is started
    with `--compute-dtype bfloat16` (peer/compute/precision.py)."""
    activation_checkpointing: bool = False
    """Keep only each block's input for backward and recompute the rest then: about a block's
    activations instead of every block's, for one more forward per backward."""


@dataclass(frozen=True, kw_only=True)
class StagesConfig:
    count: int = 2
    layers: tuple[int, ...] = ()
    """Blocks per stage (GPT only); empty means an even split of model.n_layers."""


@dataclass(frozen=True, kw_only=True)
class InnerOptConfig:
    """AdamW, stepped locally by every replica on its own accumulated gradients."""
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    """Max L2 norm of a stage's gradient (per stage, not whole-model); 0 disables clipping."""
    microbatch_size: int = 8
    """The most samples in one microbatch: what the wire accepts, and the activations' memory bound."""
    microbatches_per_step: int = 4
    microbatch_sizes: tuple[int, ...] = ()
    """One inner step's microbatches in order, when they differ (tapered): microbatches_per_step
    entries, each at most microbatch_size, e.g. [2, 8, 8, 8, 8, 8, 8, 8, 4, 2]. Every microbatch's
    gradient is weighted by its samples, so a step is the whole step's mean gradient whatever the
    sizes. Small first and last microbatches shorten an exact step's fill and drain, but a step
    whose resources (uplink, compute, downlink) are balanced loses its largest microbatch's time
    wherever it sits, so there uniform small microbatches are faster (docs/measurements.md,
    "Tapered steps do not shorten it"). Where one resource dominates a taper beats the full
    microbatches it was cut from, but on CPU cores not uniform small ones; it can pay where small
    microbatches are expensive per sample. Empty: every microbatch has microbatch_size samples."""
    swarm_second_moment: bool = False
    """Estimate AdamW's second moment for the batch of all the stage's replicas together, not this
    replica's alone (peer/compute/swarm_adamw.py): subtracts the share of the gradient noise that averaging
    removes, measured from the spread between a step's microbatches (needs microbatches_per_step ≥ 2).
    Closes most of the per-sample gap between averaged replicas and data-parallel training."""

    @property
    def step_sizes(self) -> tuple[int, ...]:
        """The samples of each of one inner step's microbatches, in order."""
        return self.microbatch_sizes or (self.microbatch_size,) * self.microbatches_per_step

    @property
    def step_samples(self) -> int:
        """The samples of one whole inner step."""
        return sum(self.step_sizes)


@dataclass(frozen=True, kw_only=True)
class OuterOptConfig:
    """Nesterov SGD on the averaged pseudo-gradient, applied to θ_global (DiLoCo)."""
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """Learning-rate schedule over the samples the whole swarm has trained (not local steps)."""
    kind: str = "constant"
    """`constant`, `cosine` or `linear` (both decay from the peak inner.lr to min_lr_ratio of it)."""
    warmup_samples: int = 0
    """Linear warmup from 0 to the peak over this many samples (0: none)."""
    total_samples: int = 0
    """Where the decay reaches its floor (and stays); required for cosine and linear."""
    min_lr_ratio: float = 0.1
    """The floor as a fraction of the peak lr."""
    outer: bool = False
    """Also scale outer.lr by the same curve (evaluated at each round boundary)."""


@dataclass(frozen=True, kw_only=True)
class RoundsConfig:
    inner_steps: int = 0
    """H: end a round after this many inner steps of a replica (0: not used)."""
    round_seconds: float = 30.0
    """End rounds on a shared wall clock, every this many seconds (0: not used)."""
    max_rounds: int = 0
    """Stop after this many rounds (0: run until stopped)."""
    overlap: bool = False
    """Average in the background while the next round trains (peer/rounds/overlap.py): the outer step
    lands one round late, θ_local keeps the progress made meanwhile. Off: the worker waits for
    each round's averaging (the exact DiLoCo round)."""
    overlap_steps: int = 0
    """With overlap: the most inner steps a replica trains from its own point before the last
    round's mean must have landed; after that many it waits for the mean (Streaming DiLoCo's τ).
    What an overlapped round costs per sample grows with the steps taken before its mean lands
    (docs/measurements.md, "Overlapped averaging"): a bound of 1 keeps it within ~1 % of plain
    rounds while the exchange still hides behind a step. 0: no bound (the next boundary waits)."""


@dataclass(frozen=True, kw_only=True)
class AveragingConfig:
    codec: str = "int8"
    """Codec spec for pseudo-gradients, e.g. "fp16", "int8", "int4", "topk:fraction=0.01,values=fp16"."""
    error_feedback: bool = True
    """Keep what the codec dropped and add it to the next round's pseudo-gradient (needed by the
    biased codecs: int4, topk, powersgd; harmless with int8)."""
    small_tensor_threshold: int = 4096
    """Tensors with fewer elements travel as fp32 (they are cheap, and biases matter)."""
    reducer_feedback: bool = False
    """A reducer encodes the mean with `codec` itself and keeps error feedback of its own (what its
    encode dropped joins its next mean), instead of `compression.reduce_codec` (for a sparse codec,
    every non-zero of the mean at >= 8 bits). With a 1-2 bit codec this makes the mean as small as
    a contribution; docs/averaging-codecs.md has the measurements."""
    feedback_decay: float = 1.0
    """β in (0, 1]: the members' error-feedback residual is scaled by it before it joins the next
    round's pseudo-gradient. SparseLoCo's recipe is β = 0.95 with outer.lr = 1 and
    outer.momentum = 0 (the decayed accumulator replaces outer momentum); 1 is plain error
    feedback. docs/averaging-codecs.md has the measurements."""
    gather_up_to: int = 0
    """Groups of at most this many members exchange the members' encoded parts instead of a
    reducer's encoded mean (an all-gather through the reducers): every member decodes every part
    and aggregates them itself, in sorted member order, so no second lossy encode is made and
    replicas stay bit-identical. With 2 members it sends the same bytes as a mean in the
    members' codec (reducer_feedback) and loses less; each member sends (n - 1) x its
    contribution, so it pays from 3 members on. 0: never. docs/averaging-codecs.md has the
    measurements."""
    robust_min_members: int = 3
    """From this many members on, reducers aggregate by centered clipping around the median
    (one bad member moves the mean by a bounded amount; peer/averaging/aggregate.py); 0 disables it."""
    max_weight_ratio: float = 8.0
    """With the robust aggregate, a member's weight (samples) is capped at this × the median."""
    verify: bool = False
    """Every member signs each part it sends and checks every part it applies: the reducer forwards
    the members' signed parts with its answer, and each member recomputes the aggregate from them
    and refuses a mean that differs (and blames its reducer). What keeps one member of a group from
    choosing the mean of the part it reduces; costs about a gather exchange's bytes on top of the
    mean in groups that reduce-scatter, 64 bytes per part in those that gather. Needs a
    deterministic reduce codec (no reducer_feedback, no stochastic rounding). docs/trust.md, "Reducers"."""
    backup_every: int = 1
    """Every this many complete rounds a stage's state is copied to peers of other stages, so the
    stage survives the death of its last replica (peer/state/backup.py); 0 disables backups."""
    backup_link_share: float = 0.2
    """The most of the time a stage's backup pushes may keep its link busy: after a push that took
    d seconds the next waits at least d / this (rounds in between push nothing). A push is the whole
    state in one message and a pipeline's microbatches queue behind it; over a fast link it still
    goes every `backup_every` rounds. 1: no pacing. Lower trades fresh copies (warm standbys) for
    link time: docs/placement.md, "Pacing backups"."""


PIPELINE_ROUTINGS = ("measured", "announced")
"""pipeline.routing's values."""
STALE_CORRECTIONS = ("none", "nesterov", "predict", "delay_comp")
"""pipeline.stale_correction's values (peer/compute/staleness.py)."""


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    activation_codec: str = "fp16"
    gradient_codec: str = "fp16"
    max_in_flight: int = 4
    """The most microbatches a driver keeps in flight: the cap of its adaptive window
    (peer/pipeline/window.py), which keeps as many as its measured link and compute need. Placement
    reserves memory for this many microbatches' activations."""
    lookahead: bool = False
    """Replicas take the next inner step's microbatches while this step drains, against a stash of
    their weights (PipeDream-2BW): the link stays busier across steps, and those microbatches'
    gradients are one step stale (peer/compute/lookahead.py). Off: every gradient is exact. Experimental:
    on the reference task the staleness costs far more per sample than the speed gains (docs/measurements.md)."""
    stale_correction: str = "none"
    """With lookahead, how the one-step-stale gradients are corrected (peer/compute/staleness.py,
    one of STALE_CORRECTIONS): "none", "nesterov" (the stash extrapolated along Adam's momentum,
    Nesterov's look-ahead), "predict" (the stash moved to the weights predicted for the step the
    gradient lands in) or "delay_comp" (DC-ASGD's g + λ·g⊙g⊙(w_now − w_stale))."""
    stale_correction_scale: float = 1.0
    """σ of the correction: the predicted updates the stash moves ("nesterov", "predict"; 1 = the
    one step of delay) or λ ("delay_comp")."""
    max_retries: int = 5
    """Attempts per microbatch before the driver gives it up (and logs it)."""
    routing: str = "announced"
    """Which replica of the next stage gets a microbatch (peer/pipeline/routing.py): "announced"
    (SWARM's wiring) by its announced compute over 1 + the sender's queue to it, so a fast replica
    behind a slow link gets its full share; "measured" by the rate it can take as the sender
    measures it, the slower of its announced compute and the link to it, an inner step's last
    microbatches only where they come back first. The default changes once the four-peer benchmark
    (benchmarks/pipeline_wan.py) shows the win (docs/measurements.md)."""
    forward_first: bool = False
    """A replica's compute thread runs a training forward before the backwards waiting for it, so
    the next request goes on the link while the backward runs (peer/compute/thread.py). Off: calls
    run in the order they came. Measured: docs/measurements.md, "What waits on the compute thread"."""
    max_message_mb: float = 256.0
    """Incoming messages larger than this are refused before they are parsed."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    source: str = "stdlib"
    """`stdlib` (the running interpreter's own .py files), `files` (data.paths, one document per file),
    `jsonl`, `parquet` or `hf-disk` (a folder `datasets`' save_to_disk wrote): docs/data.md."""
    paths: tuple[str, ...] = ()
    """Files, folders or globs, relative to the manifest's folder (data.base_dir)."""
    text_field: str = "text"
    """The JSON key or column holding a document's text (jsonl, parquet, hf-disk)."""
    tokenizer: str = field(default="", compare=False)
    """A tokenizer JSON file (`swarmgrad tokenizer train`); empty: bytes. Written relative to the
    manifest's folder; after loading, the absolute path (not part of the run's hash nor of equality:
    the file's content is, through tokenizer_sha256)."""
    tokenizer_sha256: str = ""
    """The tokenizer file's sha256: a peer whose file differs refuses to start."""
    shard_mb: float = 64.0
    """Target size on disk of one shard of the corpus (the streaming path: peer/text/sources.py)."""
    base_dir: str = field(default="", compare=False)
    """What relative data.paths and data.tokenizer are resolved against: the manifest's folder
    unless set (relative to it); not part of the run's hash nor of equality, so peers may keep the
    data elsewhere."""
    val_fraction: float = 0.05
    max_bytes: int = 0
    """Cap on bytes read per split (0: no cap)."""
    eval_every: int = 2
    """Drivers evaluate validation loss every this many rounds (0: only at start and end)."""
    eval_batches: int = 8
    evaluators: int = 1
    """Drivers that evaluate at each `eval_every` round (0: every driver). The replicas hold the same
    θ_global bit for bit, so N drivers scoring it would give N equal figures for N times the
    forwards on every stage; the evaluators are chosen from the round's averaging group by
    rendezvous hash of the round (decisions.evaluates), so the cost rotates among the drivers. Start
    and final evaluations run on every driver."""
    shards: int = 0
    """Cut the training corpus into this many shards that drivers lease through the DHT, so that in
    an epoch no window is trained twice while drivers come and go (peer/shards/, docs/data.md). 0:
    no leases, each driver samples random windows from its own seed (--data-seed)."""
    lease_seconds: float = 30.0
    """A driver's shard lease expires this long after its last renewal (renewed every third of it):
    how long a crashed driver's shard waits before another takes it over."""
    lease_settle: float = 1.0
    """After taking a free shard, a driver waits this long before reading the leases back to see
    whether another took the same shard at once (the DHT is not read-after-write across nodes)."""


@dataclass(frozen=True, kw_only=True)
class TimeoutsConfig:
    """Every network wait has a deadline, and each one is named here (seconds)."""
    dht: float = 10.0
    microbatch: float = 30.0
    """Upper bound for one microbatch's trip through the pipeline; the driver's actual deadline
    is derived from observed round trips and never exceeds this."""
    min_microbatch: float = 5.0
    matchmaking: float = 5.0
    allreduce: float = 20.0
    state_download: float = 60.0
    join_hold: float = 30.0
    """How long a replica whose state a peer downloaded holds its next round boundary (worker
    paused, state served, nothing averaged) for that peer to land the download and come ONLINE,
    counted from its first request. Over a link slower than a round, a download that a round
    supersedes is never current (decisions.join_hold). 0: never hold. Not with wall-clock rounds."""
    announce_ttl: float = 15.0
    """DHT records live this long unless refreshed; a silent peer disappears after it."""
    heartbeat: float = 3.0
    ban_base: float = 5.0
    """First ban of a failed peer; doubles per consecutive failure up to ban_max."""
    ban_max: float = 60.0
    shutdown: float = 10.0
    rebalance_check: float = 15.0
    """Mean interval between a replica's rebalancing checks (jittered ±50 %). A check reads the
    stage records (one DHT get per stage); a departure costs throughput until it is repaired, and
    the simulator's 1000-peer swarm served 0.973 of the optimum with 15 s against 0.970 with 30 s."""
    move: float = 300.0
    """How long a moving peer waits for its old stage's last round before it leaves anyway."""
    commit: float = 5.0
    """How long a stage replica holds a microbatch's gradients after answering, for the driver's
    commit; uncommitted (the answer was lost, the driver re-sent it elsewhere) they are dropped."""
    between_rounds: float = 5.0
    """How long a stage ≥ 1 replica that is ending its round holds a microbatch of the next round
    (at most half of the microbatch's deadline), serving it once the round is over, instead of
    refusing it NOT_READY and having the driver send the activations again. 0: refuse at once. A
    late microbatch of the round being ended is refused at once."""
    tokenizer: float = 30.0
    """A chunk of a public run's tokenizer file (peer/public/tokenizer_share.py): how long a serving
    peer waits for the request, and a joiner for each chunk's answer."""


@dataclass(frozen=True, kw_only=True)
class Manifest:
    run_id: str
    seed: int = 0
    model: ModelConfig = ModelConfig()
    stages: StagesConfig = StagesConfig()
    inner: InnerOptConfig = InnerOptConfig()
    outer: OuterOptConfig = OuterOptConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    rounds: RoundsConfig = RoundsConfig()
    averaging: AveragingConfig = AveragingConfig()
    pipeline: PipelineConfig = PipelineConfig()
    data: DataConfig = DataConfig()
    timeouts: TimeoutsConfig = TimeoutsConfig()

    @property
    def hash(self) -> str:
        """Stable identity of the run: sha256 of the canonical JSON of every field."""
        data = to_dict(self)
        for local in _LOCAL_DATA_FIELDS:  # where this machine keeps the files, not what they are
            del data["data"][local]
        canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:32]

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        if self.stages.layers:
            return self.stages.layers
        base, extra = divmod(self.model.n_layers, self.stages.count)
        return tuple(base + (1 if i < extra else 0) for i in range(self.stages.count))

    def replace(self, **sections: Any) -> "Manifest":
        """A copy with some fields replaced, e.g. ``m.replace(rounds={"max_rounds": 3})``; validated."""
        data = to_dict(self)
        for key, value in sections.items():
            if isinstance(value, Mapping):
                data[key] = {**data[key], **value}
            else:
                data[key] = value
        return from_dict(data)


_LOCAL_DATA_FIELDS = ("tokenizer", "base_dir")
"""Fields of [data] that are left out of the run's hash: paths on this machine (the tokenizer's
content is hashed through data.tokenizer_sha256)."""


def _resolve_data_paths(data: DataConfig, folder: Path | None) -> DataConfig:
    """data.base_dir made absolute (default: the manifest's folder, else the working directory) and
    data.tokenizer resolved against it."""
    base = Path(folder if folder is not None else Path.cwd()).absolute()
    if data.base_dir:
        base = base / Path(data.base_dir).expanduser()
    tokenizer = str((base / Path(data.tokenizer).expanduser()).absolute()) if data.tokenizer else ""
    return dataclasses.replace(data, base_dir=str(base), tokenizer=tokenizer)


_SECTIONS = {
    "model": ModelConfig, "stages": StagesConfig, "inner": InnerOptConfig, "outer": OuterOptConfig,
    "schedule": ScheduleConfig, "rounds": RoundsConfig, "averaging": AveragingConfig, "pipeline": PipelineConfig,
    "data": DataConfig, "timeouts": TimeoutsConfig,
}


def to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (tuple, list)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Mapping):
        return {str(k): to_dict(v) for k, v in obj.items()}
    return obj


def _coerce(section: str, f: dataclasses.Field, value: Any) -> Any:
    name = f"{section}.{f.name}" if section else f.name
    default = f.default if f.default is not dataclasses.MISSING else (
        f.default_factory() if f.default_factory is not dataclasses.MISSING else None)  # type: ignore[misc]
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise _fail(name, f"must be true or false (got {value!r})")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(name, f"must be an integer (got {value!r})")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(name, f"must be a number (got {value!r})")
        if not math.isfinite(float(value)):
            raise _fail(name, f"must be a finite number (got {value!r})")
        return float(value)
    if isinstance(default, str):
        if not isinstance(value, str):
            raise _fail(name, f"must be a string (got {value!r})")
        return value
    if isinstance(default, tuple):
        if not isinstance(value, (list, tuple)):
            raise _fail(name, f"must be a list (got {value!r})")
        return tuple(value)
    if isinstance(default, Mapping):
        if not isinstance(value, Mapping):
            raise _fail(name, f"must be a table (got {value!r})")
        _check_plain(name, value)
        return dict(value)
    return value


def _check_plain(name: str, value: Any) -> None:
    """Free-form values (model.params) must be what JSON and TOML both hold: the manifest's hash
    is computed over its JSON form, and a TOML date or an infinite float has none."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            _check_plain(f"{name}.{k}", v)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(f"{name}[{i}]", v)
    elif isinstance(value, float) and not math.isfinite(value):
        raise _fail(name, f"must be a finite number (got {value!r})")
    elif not isinstance(value, (str, int, float, bool)):
        raise _fail(name, f"must be a string, number, boolean, list or table (got {type(value).__name__} {value!r})")


def _build(cls: type, section: str, raw: Mapping[str, Any]) -> Any:
    if not isinstance(raw, Mapping):
        raise _fail(section, f"must be a table (got {raw!r})")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        where = f"{section}." if section else ""
        raise _fail(f"{where}{unknown[0]}", f"is not a known field (known: {', '.join(sorted(fields))})")
    kwargs = {k: _coerce(section, fields[k], v) for k, v in raw.items()}
    return cls(**kwargs)


def from_dict(raw: Mapping[str, Any], folder: str | Path | None = None) -> Manifest:
    """Build and validate a Manifest from parsed TOML (or an equivalent dict); `folder`: the
    manifest file's, which relative data paths are resolved against (default: the working directory)."""
    if "run_id" not in raw:
        raise _fail("run_id", "is required (a short name for the run, e.g. \"tiny-gpt\")")
    top = {k: v for k, v in raw.items() if k not in _SECTIONS}
    unknown = sorted(set(top) - {"run_id", "seed"})
    if unknown:
        raise _fail(unknown[0], f"is not a known field or section (sections: {', '.join(_SECTIONS)})")
    run_id, seed = raw["run_id"], raw.get("seed", 0)
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
        raise _fail("run_id", f"must be 1-64 characters of letters, digits, '_', '.', '-' (got {run_id!r})")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise _fail("seed", f"must be an integer (got {seed!r})")
    sections = {name: _build(cls, name, raw.get(name, {})) for name, cls in _SECTIONS.items()}
    sections["data"] = _resolve_data_paths(sections["data"], Path(folder) if folder is not None else None)
    manifest = Manifest(run_id=run_id, seed=seed, **sections)
    validate(manifest)
    return manifest


def validate(m: Manifest) -> None:
    """Cross-field checks (peer/manifest_checks.py); raises ManifestError naming the field and the fix."""
    # Imported here: the checks name this module's types, so a top-level import would be circular.
    from swarmgrad.peer.manifest_checks import check
    check(m)


def load(path: str | Path) -> Manifest:
    """Read a TOML manifest; ManifestError names the field of any problem."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ManifestError(f"manifest: file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ManifestError(f"manifest: {path} is not valid TOML: {e}") from None
    return from_dict(raw, path.parent)


def loads(text: str) -> Manifest:
    try:
        return from_dict(tomllib.loads(text))
    except tomllib.TOMLDecodeError as e:
        raise ManifestError(f"manifest: not valid TOML: {e}") from None


def dumps(manifest: Manifest) -> str:
    """The manifest as TOML (loads(dumps(m)) == m), e.g. to hand a modified run to other processes."""
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, Mapping):
            return "{" + ", ".join(f"{json.dumps(str(k))} = {value(x)}" for k, x in v.items()) + "}"
        raise TypeError(f"cannot write {v!r} as TOML")

    data = to_dict(manifest)
    lines = [f"run_id = {value(data.pop('run_id'))}", f"seed = {value(data.pop('seed'))}"]
    for section, fields in data.items():
        lines.append(f"\n[{section}]")
        lines.extend(f"{k} = {value(v)}" for k, v in fields.items())
    return "\n".join(lines) + "\n"
