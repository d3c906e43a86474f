"""Progress for people (one log line per round) and for machines (JSON lines, --events PATH)."""
from __future__ import annotations

import json
import logging
import math
import threading
import time
from pathlib import Path
from typing import IO, Any, Callable

logger = logging.getLogger(__name__)

EventSink = Callable[[dict[str, Any]], None]
"""Called with every event's record (`event`, `time`, the fixed fields, the event's fields) as it
is emitted, in the emitting thread, before it is written; e.g. PeerMetrics.observe."""


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
    Every line has `event`, `time` (unix seconds) and the fixed fields given at construction.

    `sink`, if given, sees every event too, with or without a file; an exception in it is logged
    and does not reach the emitter (metrics must not stop a round)."""

    def __init__(self, path: str | Path | None, *, sink: EventSink | None = None, **fixed: Any):
        self.fixed = dict(fixed)
        self.sink = sink
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        self._owner = True
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1)

    def view(self, **fixed: Any) -> "EventLog":
        """The same file with more (or other) fixed fields, e.g. the stage of one replica while a
        peer moves between stages; closing a view does not close the file."""
        other = EventLog(None, sink=self.sink, **{**self.fixed, **fixed})
        other._file, other._lock, other._owner = self._file, self._lock, False
        return other

    def emit(self, event: str, **fields: Any) -> None:
        if self._file is None and self.sink is None:
            return
        record = {"event": event, "time": round(time.time(), 3), **self.fixed, **fields}
        if self.sink is not None:  # before the file: whoever reads the line finds the metrics updated
            try:
                self.sink(record)
            except Exception:
                logger.exception("event sink failed on a %r event", event)
        if self._file is None:
            return
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
