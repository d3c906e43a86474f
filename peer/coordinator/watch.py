"""What the coordinator shows: the swarm as its records say, and the history it has seen.

`swarm_snapshot` is a pure function of the stage records (peer/net/dht_view.py) and the coordinator's
own state; `History` keeps what changed from one look to the next (a new round of a replica, a
new evaluation), bounded in length. Both produce exactly the JSON the dashboard reads
(peer/coordinator/web.py documents it).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Iterable

from swarmgrad.peer import decisions
from swarmgrad.peer.coordinator.store import CoordinatorState
from swarmgrad.peer.records import ONLINE, PeerRecord

MAX_HISTORY = 2000
KINDS = ("activations", "gradients", "averaging", "state")


def _stat(record: PeerRecord, name: str) -> Any:
    return (record.stats or {}).get(name)


def swarm_snapshot(run_id: str, view: dict[int, list[PeerRecord]], state: CoordinatorState | None,
                   checkpoints: list[dict[str, Any]] | None, coordinator: dict[str, Any] | None,
                   now: float | None = None, monitor: dict[str, Any] | None = None) -> dict[str, Any]:
    """The /api/swarm document. A monitor (no coordinator) passes `state`, `checkpoints` and
    `coordinator` as None (null in the JSON: it admits nobody and collects no checkpoint) and
    `monitor` (its own peer id and uptime)."""
    stages = []
    for stage in sorted(view):
        records = view[stage]
        majority = decisions.majority_digest(records)
        replicas = [{"peer_id": r.peer_id, "state": r.state, "rate": round(r.throughput, 3), "round": r.round,
                     "digest": r.digest, "agrees": bool(r.digest) and r.digest == majority, "moving": r.moving,
                     "pinned": r.pinned, "train_loss": _stat(r, "train_loss")}
                    for r in sorted(records, key=lambda r: r.peer_id)]
        rate = sum(r.throughput for r in records if r.state == ONLINE)
        stages.append({"stage": stage, "rate": round(rate, 3), "majority_digest": majority, "replicas": replicas})
    rates = [s["rate"] for s in stages]
    bottleneck = min(range(len(rates)), key=rates.__getitem__) if rates else None
    latest = max((r.round for records in view.values() for r in records), default=0)
    return {
        "run_id": run_id, "time": time.time() if now is None else now, "latest_round": latest,
        "n_stages": len(view), "swarm_rate": min(rates) if rates else 0.0, "bottleneck": bottleneck,
        "stages": stages,
        "peers": None if state is None else _peers(state),
        "checkpoints": checkpoints,
        "coordinator": coordinator,
        **({"monitor": monitor} if monitor is not None else {}),
    }


def _peers(state: CoordinatorState) -> dict[str, Any]:
    return {"admitted": [{"peer_id": p.peer_id, "role": p.role, "stage": p.stage, "admitted_at": p.admitted_at,
                          "expires": p.expires} for p in sorted(state.admitted.values(), key=lambda p: -p.admitted_at)],
            "revoked": [{"peer_id": k, "revoked_at": v}
                        for k, v in sorted(state.revoked.items(), key=lambda kv: -kv[1])]}


class History:
    """Rounds and losses the coordinator saw in the records, oldest first, at most MAX_HISTORY each."""

    def __init__(self, max_len: int = MAX_HISTORY):
        self.rounds: deque[dict[str, Any]] = deque(maxlen=max_len)
        self.loss: deque[dict[str, Any]] = deque(maxlen=max_len)
        self._seen_round: dict[tuple[str, int], int] = {}
        self._seen_val: dict[str, float | None] = {}

    def observe(self, view: dict[int, list[PeerRecord]], now: float | None = None) -> None:
        now = time.time() if now is None else now
        for stage, records in view.items():
            for r in records:
                key = (r.peer_id, stage)
                if r.stats is None or self._seen_round.get(key) == r.round:
                    continue
                first = key not in self._seen_round
                self._seen_round[key] = r.round
                if first:
                    continue  # its last round may be old news
                self.rounds.append({"stage": stage, "round": max(0, r.round - 1), "time": now, "peer_id": r.peer_id,
                                    "duration_s": _stat(r, "round_s"), "group_size": _num(_stat(r, "group_size")),
                                    "train_loss": _stat(r, "train_loss"), "samples_per_s": _stat(r, "samples_per_s")})
                if stage == len(view) - 1 or _stat(r, "val_loss") is not None:
                    samples = int(sum(_stat(x, "samples") or 0 for x in view.get(0, [])))
                    val = None
                    if r.driver and _stat(r, "val_loss") != self._seen_val.get(r.peer_id):
                        val = _stat(r, "val_loss")
                        self._seen_val[r.peer_id] = val
                    if stage == len(view) - 1 or val is not None:
                        self.loss.append({"time": now, "samples": samples,
                                          "train_loss": _stat(r, "train_loss") if stage == len(view) - 1 else None,
                                          "val_loss": val,
                                          "val_nats": _stat(r, "val_nats") if val is not None else None,
                                          "val_ppl": _stat(r, "val_ppl") if val is not None else None})

    def bytes_per_sample(self, view: dict[int, list[PeerRecord]]) -> dict[str, float]:
        """Bytes the swarm sent per sample trained, by kind: what every replica announces it sent,
        over the samples the drivers trained."""
        samples = sum(int(_stat(r, "samples") or 0) for r in view.get(0, []))
        out = {}
        for kind in KINDS:
            sent = sum(int(_stat(r, f"bytes_{kind}") or 0) for records in view.values() for r in records)
            out[kind] = sent / samples if samples else 0.0
        return out

    def to_json(self, view: dict[int, list[PeerRecord]]) -> dict[str, Any]:
        return {"loss": list(self.loss), "rounds": list(self.rounds)[-200:],
                "bytes_per_sample": self.bytes_per_sample(view)}


def _num(value: Any) -> int | None:
    return None if value is None else int(value)


def checkpoint_rows(rounds: Iterable[int], index: dict[int, dict]) -> list[dict[str, Any]]:
    return [{"round": r, "time": min((e.time for e in index[r].values()), default=0.0),
             "stages": sorted(index[r])} for r in sorted(rounds, reverse=True)]
