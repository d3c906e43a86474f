"""The data position on disk: a driver's --save-dir holds `data-position-{peer}.json`, written after
every round and on leave; a driver started with that folder resumes from the union of the files
there (the position of several drivers sharing a folder merges like their DHT records)."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from swarmgrad.peer.shards.leases import DataPosition, DriverRecord, merge_position

logger = logging.getLogger(__name__)

PREFIX = "data-position-"


def save_position(folder: str | Path, peer_id: str, position: DataPosition) -> Path:
    """Write `position` atomically (a crash leaves the old file or the new one, never half)."""
    path = Path(folder) / f"{PREFIX}{peer_id[-8:]}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(position.to_json(), sort_keys=True))
    os.replace(tmp, path)
    return path


def load_position(folder: str | Path | None, n_shards: int) -> DataPosition | None:
    """The merged position of the files in `folder`, or None when there is none. A file that does
    not parse, or is about another number of shards, is skipped with a warning."""
    if folder is None or not Path(folder).is_dir():
        return None
    found = []
    for path in sorted(Path(folder).glob(f"{PREFIX}*.json")):
        try:
            found.append(DataPosition.from_json(json.loads(path.read_text()), n_shards))
        except (OSError, ValueError) as e:
            logger.warning("data: ignored %s: %s", path, e)
    if not found:
        return None
    return merge_position(found[0], (DriverRecord("", p, None) for p in found[1:]))
