"""The coordinator's checkpoints: every N rounds, θ_global and outer momentum of every stage,
taken from a replica whose digest the stage's majority announces, written atomically as
safetensors (peer/coordinator/store.py), the newest K kept. `swarmgrad export` turns the newest
into one file of the whole model.

The coordinator downloads a stage's state with the same request a joining replica sends
(peer/state/sync.py `fetch_state`), so the state is checked the same way: names, shapes, fp32,
and a recomputed digest that must equal the one the majority announces.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Awaitable, Callable

from swarmgrad.peer import decisions
from swarmgrad.peer.coordinator.store import StateDir
from swarmgrad.peer.events import EventLog
from swarmgrad.peer.net.rpc import FramedRPC, RPCFailed
from swarmgrad.peer.state.stage_state import snapshot_bytes
from swarmgrad.peer.state.sync import fetch_state
from swarmgrad.peer.records import ONLINE, PeerRecord
from swarmgrad.protocol.framing import ProtocolError
from swarmgrad.protocol.validation import RunIdentity

logger = logging.getLogger(__name__)


def checkpoint_plan(view: dict[int, list[PeerRecord]], n_stages: int, last_round: int | None, every: int
                    ) -> tuple[int, dict[int, tuple[str, list[str]]]] | None:
    """What to checkpoint now, or None: (round, {stage: (majority digest, donors)}) when every stage
    has online replicas agreeing on a digest and the least advanced stage's majority has applied
    at least `every` rounds more than the last checkpoint (or `every` rounds at all). Pure."""
    plan: dict[int, tuple[str, list[str]]] = {}
    applied = []
    for stage in range(n_stages):
        records = view.get(stage, [])
        digest = decisions.majority_digest(records)
        if digest is None:
            return None
        donors = sorted(r.peer_id for r in records if r.state == ONLINE and r.digest == digest)
        plan[stage] = (digest, donors)
        applied.append(min(r.applied_rounds for r in records if r.state == ONLINE and r.digest == digest))
    round_no = min(applied)
    if round_no < every or (last_round is not None and round_no < last_round + every):
        return None
    return round_no, plan


class CheckpointCollector:
    def __init__(self, *, store: StateDir, rpc_for_stage: Callable[[int], FramedRPC], identity: RunIdentity,
                 shapes: Callable[[int], dict[str, tuple[int, ...]]], n_stages: int, max_numel: int, timeout: float,
                 every: int, manifest_toml: str, manifest_hash: str, events: EventLog,
                 data_position: Callable[[], Awaitable[dict[str, Any] | None]] | None = None):
        self.store = store
        self.rpc_for_stage = rpc_for_stage
        self.identity = identity
        self.shapes = shapes
        self.n_stages = n_stages
        self.max_numel = max_numel
        self.timeout = timeout
        self.every = every
        self.manifest_toml = manifest_toml
        self.manifest_hash = manifest_hash
        self.events = events
        self.data_position = data_position
        """The swarm's data position as the drivers publish it (None: the run leases no shards)."""
        self.failures = 0

    @property
    def last_round(self) -> int | None:
        rounds = self.store.checkpoint_rounds()
        return rounds[-1] if rounds else None

    async def maybe_collect(self, view: dict[int, list[PeerRecord]]) -> int | None:
        """Take a checkpoint if one is due (checkpoint_plan). Returns its round, or None. A stage
        whose donors all fail (busy averaging, gone) postpones the whole checkpoint to a later look."""
        plan = checkpoint_plan(view, self.n_stages, self.last_round, self.every)
        if plan is None:
            return None
        round, stages = plan
        files: dict[int, tuple[bytes, dict[str, Any]]] = {}
        for stage, (digest, donors) in stages.items():
            snap = None
            for donor in donors[:3]:
                try:
                    snap = await fetch_state(self.rpc_for_stage(stage), [donor], self.identity, stage,
                                             self.shapes(stage), self.max_numel, self.timeout)
                except (RPCFailed, ProtocolError) as e:
                    logger.info("checkpoint: stage %d from %s failed: %s", stage, donor[-8:], e)
                    continue
                if snap.digest != digest:  # a round ended meanwhile: it is the next look's state
                    logger.info("checkpoint: stage %d moved on meanwhile; will try again", stage)
                    snap = None
                    continue
                break
            if snap is None:
                self.failures += 1
                return None
            info = {"round": snap.round, "applied_rounds": snap.applied_rounds,
                    "trained_samples": snap.trained_samples, "digest": snap.digest}
            files[stage] = (snapshot_bytes(snap, {"stage": str(stage), "manifest_hash": self.manifest_hash}), info)
        # read after the states, so the position is at least theirs: a resume may skip windows trained
        # after them (they are not in this θ), never train one twice
        position = await self.data_position() if self.data_position is not None else None
        folder = self.store.write_checkpoint(round, files, self.manifest_toml, self.n_stages, data_position=position)
        self.events.emit("checkpoint", round=round, stages=sorted(files), path=str(folder),
                         bytes=sum(len(d) for d, _ in files.values()))
        logger.info("checkpoint of round %d written to %s", round, folder)
        return round


def checkpoint_tensors(state_dir: Path, round_no: int | None = None
                       ) -> tuple[int, str, str, dict[int, dict[str, Any]]]:
    """(round, run id, manifest TOML, {stage: θ_global}) of the newest complete checkpoint of a
    coordinator's state dir (or of `round_no`). Raises FileNotFoundError when there is none."""
    import json

    from swarmgrad.peer.state.stage_state import load_checkpoint
    from swarmgrad.peer.coordinator.store import CoordinatorState, STATE_FILE
    try:
        state = CoordinatorState.from_json(json.loads((state_dir / STATE_FILE).read_text()))
    except FileNotFoundError:
        raise FileNotFoundError(f"{state_dir} is not a coordinator's state dir (no {STATE_FILE})") from None
    store = StateDir(state_dir, state.run_id)
    rounds = store.checkpoint_rounds()
    if not rounds:
        raise FileNotFoundError(f"{state_dir} holds no checkpoint yet")
    round_no = rounds[-1] if round_no is None else round_no
    if round_no not in rounds:
        raise FileNotFoundError(f"no checkpoint of round {round_no} (have {rounds})")
    entries = store.checkpoint(round_no)
    stages = {stage: load_checkpoint(entry.path)[0] for stage, entry in sorted(entries.items())}
    folder = entries[min(entries)].path.parent
    return round_no, state.run_id, (folder / "manifest.toml").read_text(), stages


def export_model(state_dir: Path, out: Path, round_no: int | None = None) -> tuple[int, int]:
    """Write θ_global of every stage of the newest complete checkpoint (or of `round`) into one
    safetensors file, names prefixed `stage{s}.`; metadata: run id, round, manifest. Returns
    (round, tensors written). Raises FileNotFoundError when there is no checkpoint."""
    from safetensors.torch import save_file

    round_no, run_id, manifest_toml, stages = checkpoint_tensors(state_dir, round_no)
    tensors = {f"stage{stage}.{name}": t.contiguous() for stage, params in stages.items() for name, t in params.items()}
    meta = {"run_id": run_id, "round": str(round_no), "stages": str(len(stages)), "manifest": manifest_toml}
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata=meta)
    return round_no, len(tensors)
