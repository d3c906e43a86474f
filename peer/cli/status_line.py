"""What a volunteer sees: on a terminal, `swarmgrad peer` keeps one live status line at the bottom
(stage, samples/s, round, last loss, bytes up/down, contribution) and prints its log lines above it.

`StatusLine` turns the peer's events (peer/events.py: `started`, `round`, `moved`) into the line's
figures; `render` is the line, a pure function of them and the terminal's width; and
`StatusLineHandler` is the logging handler that owns the terminal: for each log record it clears
the line, writes the record, and draws the line again. No curses, no dependency: a carriage
return and "erase to end of line" (ANSI EL, which every terminal emulator since the VT100 reads).

Not on a terminal (stdout not a tty, or `--no-status-line`) none of this is installed: the log is
plain lines, as before.
"""
from __future__ import annotations

import logging
import math
import shutil
import threading
from dataclasses import dataclass
from typing import IO, Any, Callable

CLEAR = "\r\x1b[K"
"""Back to the start of the line and erase it."""


@dataclass
class Figures:
    """What the line shows, as the peer's events last said it."""
    peer_id: str = ""
    stage: int | None = None
    round: int | None = None
    samples_per_s: float | None = None
    train_loss: float | None = None
    bytes_sent: int = 0
    bytes_recv: int = 0
    credited_samples: float = 0.0
    """Samples this peer trained in rounds that completed (every member voted one digest)."""
    rounds_complete: int = 0
    rounds: int = 0
    tokens_per_sample: int | None = None


def _bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _count(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def render(f: Figures, width: int) -> str:
    """The status line: at most `width` − 1 characters (the last column would wrap on some
    terminals), the least important parts dropped first (the peer id, bytes, loss, rate)."""
    stage = "stage -" if f.stage is None else f"stage {f.stage}"
    # (priority, text) in display order; a narrow terminal drops the lowest priority first, so the
    # stage, the round and the contribution stay longest
    parts = [
        (1, f"peer …{f.peer_id[-8:]}" if f.peer_id else ""),
        (9, stage),
        (8, f"round {'-' if f.round is None else f.round}"),
        (5, "- samples/s" if f.samples_per_s is None or not math.isfinite(f.samples_per_s)
         else f"{f.samples_per_s:.1f} samples/s"),
        (4, "loss -" if f.train_loss is None or not math.isfinite(f.train_loss) else f"loss {f.train_loss:.3f}"),
        (3, f"↑{_bytes(f.bytes_sent)} ↓{_bytes(f.bytes_recv)}"),
        (7, f"credited {_count(f.credited_samples)} samples"
         + (f" ({_count(f.credited_samples * f.tokens_per_sample)} tokens)" if f.tokens_per_sample else "")
         + f", {f.rounds_complete}/{f.rounds} rounds"),
    ]
    parts = [p for p in parts if p[1]]
    limit = max(0, width - 1)
    line = " | ".join(text for _, text in parts)
    while len(line) > limit and len(parts) > 1:
        parts.remove(min(parts, key=lambda p: p[0]))
        line = " | ".join(text for _, text in parts)
    return line[:limit]


class StatusLine:
    """The figures, updated from the peer's events (an EventLog sink, called in any thread), and a
    `redraw` callback (the handler's) run after each update."""

    def __init__(self, peer_id: str = "", tokens_per_sample: int | None = None):
        self.figures = Figures(peer_id=peer_id, tokens_per_sample=tokens_per_sample)
        self.redraw: Callable[[], None] | None = None
        self._lock = threading.Lock()

    def observe(self, event: dict[str, Any]) -> None:
        """An EventSink: take what the line shows from `started`, `moved` and `round` events."""
        kind = event.get("event")
        with self._lock:
            f = self.figures
            if isinstance(event.get("peer"), str) and not f.peer_id:
                f.peer_id = event["peer"]
            if kind in ("started", "moved", "round") and isinstance(event.get("stage"), int):
                f.stage = event["stage"]
            if kind == "moved" and isinstance(event.get("to_stage"), int):
                f.stage = event["to_stage"]
            if kind == "round":
                f.rounds += 1
                f.round = _int(event.get("round"), f.round)
                f.samples_per_s = _float(event.get("samples_per_s"), f.samples_per_s)
                f.train_loss = _float(event.get("train_loss"), f.train_loss)
                f.bytes_sent += _int(event.get("bytes_sent"), 0) or 0
                f.bytes_recv += _int(event.get("bytes_recv"), 0) or 0
                if event.get("complete") and len(event.get("group") or ()) >= 2:
                    # the same rule as the swarm's ledger (peer/averaging/credit.py): a round of
                    # one member was validated by nobody
                    f.rounds_complete += 1
                    f.credited_samples += _float(event.get("samples"), 0.0) or 0.0
        if self.redraw is not None:
            self.redraw()

    def text(self, width: int) -> str:
        with self._lock:
            return render(self.figures, width)


def _int(value: Any, default: int | None) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        else default


def _float(value: Any, default: float | None) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) else default


class StatusLineHandler(logging.Handler):
    """Writes log records to `stream` (a terminal) above the status line: each record clears the
    line, is written whole, and the line is drawn again under it. One lock orders the records and
    the redraws of any thread. `close` clears the line and ends it, so the shell's prompt starts
    on a clean line."""

    def __init__(self, stream: IO[str], line: StatusLine, width: Callable[[], int] | None = None):
        super().__init__()
        self.stream = stream
        self.line = line
        self.width = width or (lambda: shutil.get_terminal_size((100, 24)).columns)
        self._drawn = False
        self.replaced: list[logging.Handler] = []
        """The root logger's handlers that `install` took this one's place of."""
        line.redraw = self.redraw

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)
            with self._write_lock():
                self.stream.write(CLEAR + message + "\n" + self.line.text(self.width()))
                self._drawn = True
                self.stream.flush()
        except Exception:
            self.handleError(record)

    def redraw(self) -> None:
        with self._write_lock():
            self.stream.write(CLEAR + self.line.text(self.width()))
            self._drawn = True
            self.stream.flush()

    def close(self) -> None:
        with self._write_lock():
            if self._drawn:
                self.stream.write(CLEAR)
                self.stream.flush()
                self._drawn = False
        self.line.redraw = None
        super().close()

    def _write_lock(self) -> threading.RLock:
        assert self.lock is not None  # made by logging.Handler.__init__
        return self.lock  # type: ignore[return-value]


def wants_status_line(stream: IO[str], disabled: bool) -> bool:
    """A live line only on a terminal, and only unless `--no-status-line`."""
    try:
        return not disabled and stream.isatty()
    except (AttributeError, ValueError):  # a closed or odd stream: plain lines
        return False


def install(stream: IO[str], line: StatusLine) -> StatusLineHandler:
    """Put a StatusLineHandler on `stream` in place of the root logger's handlers, formatting as the
    first of them did (the entry point's choice; `uninstall` puts them back when the peer ends)."""
    root = logging.getLogger()
    handler = StatusLineHandler(stream, line)
    handler.replaced = list(root.handlers)
    if handler.replaced and handler.replaced[0].formatter is not None:
        handler.setFormatter(handler.replaced[0].formatter)
    for old in handler.replaced:
        root.removeHandler(old)
    root.addHandler(handler)
    return handler


def uninstall(handler: StatusLineHandler) -> None:
    """Clear the line and give the root logger its handlers back."""
    root = logging.getLogger()
    root.removeHandler(handler)
    handler.close()
    for old in handler.replaced:
        root.addHandler(old)
