"""Progress for people (one log line per round) and for machines (JSON lines, --events PATH)."""
from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import IO, Any


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN; a reader sees null
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_clean(v) for v in value]
    return value


class EventLog:
    """Appends one JSON object per line, flushed at once so a reader can follow the file live.
    Every line has `event`, `time` (unix seconds) and the fixed fields given at construction."""

    def __init__(self, path: str | Path | None, **fixed: Any):
        self.fixed = dict(fixed)
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        self._owner = True
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1)

    def view(self, **fixed: Any) -> "EventLog":
        """The same file with more (or other) fixed fields, e.g. the stage of one replica while a
        peer moves between stages; closing a view does not close the file."""
        other = EventLog(None, **{**self.fixed, **fixed})
        other._file, other._lock, other._owner = self._file, self._lock, False
        return other

    def emit(self, event: str, **fields: Any) -> None:
        if self._file is None:
            return
        record = {"event": event, "time": round(time.time(), 3), **self.fixed, **fields}
        line = json.dumps(_clean(record), sort_keys=False)
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")

    def close(self) -> None:
        if self._file is not None and self._owner:
            with self._lock:
                self._file.close()
        self._file = None


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """All complete events in a JSON-lines file (a partly written last line is skipped)."""
    out = []
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
