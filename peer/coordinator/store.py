"""The coordinator's memory across restarts: admitted peers, revocations, spent invitations and the
checkpoint index, in `--state-dir`.

`state.json` is rewritten whole (temp file, fsync, rename) after every change, so a coordinator
killed at any moment restarts with either the old or the new state, never half of one.
Checkpoints are safetensors files under `checkpoints/round-NNNNNNNN/`, written the same way; a
round's folder counts only once its `index.json` (written last) lists every stage.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STATE_FILE = "state.json"
DATA_POSITION = "data_position.json"
"""In a checkpoint's folder: the swarm's data position at the checkpoint (peer/shards/leases.py)."""
CHECKPOINTS = "checkpoints"


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that a crash leaves the old file or the new one, whole."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@dataclass
class AdmittedPeer:
    peer_id: str
    role: str
    stage: int | None
    admitted_at: float
    expires: float
    serial: int


@dataclass
class CoordinatorState:
    run_id: str
    admitted: dict[str, AdmittedPeer] = field(default_factory=dict)
    revoked: dict[str, float] = field(default_factory=dict)
    """peer id -> when it was revoked."""
    revocations_version: int = 0
    spent_invitations: dict[str, float] = field(default_factory=dict)
    """sha256 of an invitation's secret -> when it was used (the secret itself is not kept)."""
    next_serial: int = 1

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["admitted"] = {k: asdict(v) for k, v in self.admitted.items()}
        return out

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> "CoordinatorState":
        state = cls(run_id=str(value["run_id"]))
        state.admitted = {k: AdmittedPeer(**v) for k, v in value.get("admitted", {}).items()}
        state.revoked = {str(k): float(v) for k, v in value.get("revoked", {}).items()}
        state.revocations_version = int(value.get("revocations_version", 0))
        state.spent_invitations = {str(k): float(v) for k, v in value.get("spent_invitations", {}).items()}
        state.next_serial = int(value.get("next_serial", 1))
        return state


def secret_id(secret: bytes) -> str:
    return hashlib.sha256(secret).hexdigest()


@dataclass(frozen=True)
class CheckpointEntry:
    """One stage's checkpoint of one round, as the index lists it."""
    stage: int
    round: int
    applied_rounds: int
    trained_samples: int
    digest: str
    file_sha256: str
    time: float
    path: Path


class StateDir:
    """The coordinator's folder. Not thread-safe: the coordinator's event loop is its one user."""

    def __init__(self, root: Path, run_id: str, keep_checkpoints: int = 3):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / CHECKPOINTS).mkdir(exist_ok=True)
        self.keep = keep_checkpoints
        self._indexes: dict[int, dict[int, CheckpointEntry]] | None = None
        """Checkpoint indexes by round, read from disk once and then kept in step by
        write_checkpoint (the dashboard and admission read them every heartbeat)."""
        path = self.root / STATE_FILE
        if path.exists():
            state = CoordinatorState.from_json(json.loads(path.read_text()))
            if state.run_id != run_id:
                raise ValueError(f"{self.root} holds the state of run {state.run_id!r}, not {run_id!r}: "
                                 "give another --state-dir")
            self.state = state
        else:
            self.state = CoordinatorState(run_id=run_id)
            self.save()

    def save(self) -> None:
        atomic_write(self.root / STATE_FILE, json.dumps(self.state.to_json(), indent=1, sort_keys=True).encode())

    # checkpoints ---------------------------------------------------------------------------------
    def _round_dir(self, round_no: int) -> Path:
        return self.root / CHECKPOINTS / f"round-{round_no:08d}"

    def write_checkpoint(self, round_no: int, stages: dict[int, tuple[bytes, dict[str, Any]]], manifest_toml: str,
                         n_stages: int, data_position: dict[str, Any] | None = None) -> Path:
        """Write the safetensors files of every stage of `round` (bytes and their info: stage round,
        applied_rounds, trained_samples, digest), the swarm's data position (`data_position.json`,
        when the drivers lease shards: peer/shards/), then the index; keep the newest `keep` rounds."""
        folder = self._round_dir(round_no)
        folder.mkdir(parents=True, exist_ok=True)
        if data_position is not None:
            atomic_write(folder / DATA_POSITION, json.dumps(data_position, sort_keys=True).encode())
        index: dict[str, Any] = {"round": round_no, "time": time.time(), "n_stages": n_stages, "stages": {}}
        for stage, (data, info) in sorted(stages.items()):
            atomic_write(folder / f"stage-{stage}.safetensors", data)
            index["stages"][str(stage)] = {**info, "file_sha256": hashlib.sha256(data).hexdigest()}
        atomic_write(folder / "manifest.toml", manifest_toml.encode())
        atomic_write(folder / "index.json", json.dumps(index, indent=1, sort_keys=True).encode())
        indexes = self._load_indexes()
        indexes[round_no] = self._read_index(round_no)
        for old in self.checkpoint_rounds()[:-self.keep] if self.keep > 0 else []:
            indexes.pop(old, None)
            shutil.rmtree(self._round_dir(old), ignore_errors=True)
        return folder

    def checkpoint_rounds(self) -> list[int]:
        """Rounds with a complete checkpoint (an index), oldest first."""
        return sorted(self._load_indexes())

    def checkpoint(self, round_no: int) -> dict[int, CheckpointEntry]:
        return dict(self._load_indexes()[round_no])

    def _load_indexes(self) -> dict[int, dict[int, CheckpointEntry]]:
        if self._indexes is None:
            self._indexes = {}
            for folder in (self.root / CHECKPOINTS).glob("round-*"):
                try:
                    round_no = int(folder.name.removeprefix("round-"))
                except ValueError:
                    continue
                if (folder / "index.json").exists():
                    self._indexes[round_no] = self._read_index(round_no)
        return self._indexes

    def _read_index(self, round_no: int) -> dict[int, CheckpointEntry]:
        folder = self._round_dir(round_no)
        index = json.loads((folder / "index.json").read_text())
        return {int(s): CheckpointEntry(stage=int(s), round=int(v["round"]), applied_rounds=int(v["applied_rounds"]),
                                        trained_samples=int(v["trained_samples"]), digest=str(v["digest"]),
                                        file_sha256=str(v["file_sha256"]), time=float(index["time"]),
                                        path=folder / f"stage-{s}.safetensors")
                for s, v in index["stages"].items()}

    def data_position(self) -> tuple[int, dict[str, Any]] | None:
        """(round, data position) of the newest checkpoint that holds one, or None."""
        for round_no in reversed(self.checkpoint_rounds()):
            path = self._round_dir(round_no) / DATA_POSITION
            if path.exists():
                return round_no, json.loads(path.read_text())
        return None

    def newest(self, stage: int) -> CheckpointEntry | None:
        """The newest checkpoint that holds `stage`."""
        for round_no in reversed(self.checkpoint_rounds()):
            entry = self.checkpoint(round_no).get(stage)
            if entry is not None:
                return entry
        return None
