"""What a volunteer sees (peer/cli/status_line.py): the live line's rendering, its figures from the
peer's events, and the logging handler that keeps log lines above it, on a fake terminal."""
from __future__ import annotations

import io
import logging

from swarmgrad.peer.cli.status_line import (CLEAR, Figures, StatusLine, StatusLineHandler, install, render,
                                            uninstall, wants_status_line)

PEER = "12D3KooWabcdefghijklmnopqrstuvwxyz0123456789ABCDEFGH"


class FakeTTY(io.StringIO):
    def __init__(self, tty: bool = True):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        if self.closed:
            raise ValueError("I/O operation on closed file")
        return self.tty


def round_event(round_no: int, complete: bool = True, group: int = 2, **extra) -> dict:
    return {"event": "round", "peer": PEER, "stage": 1, "round": round_no, "samples": 64, "samples_per_s": 12.5,
            "train_loss": 2.25, "bytes_sent": 1_500_000, "bytes_recv": 500_000, "complete": complete,
            "group": [f"p{i}" for i in range(group)], **extra}


def test_render_shows_every_figure_and_fits_the_width() -> None:
    f = Figures(peer_id=PEER, stage=1, round=7, samples_per_s=12.5, train_loss=2.25, bytes_sent=3_000_000,
                bytes_recv=1_000_000, credited_samples=1280, rounds_complete=5, rounds=6, tokens_per_sample=128)
    line = render(f, 200)
    assert line == (f"peer …{PEER[-8:]} | stage 1 | round 7 | 12.5 samples/s | loss 2.250 | "
                    "↑3.0 MB ↓1.0 MB | credited 1.3k samples (163.8k tokens), 5/6 rounds")
    narrow = render(f, 80)
    assert len(narrow) <= 79  # the peer id, the bytes and the loss go first; stage, round, credit stay
    assert narrow == "stage 1 | round 7 | credited 1.3k samples (163.8k tokens), 5/6 rounds"
    assert render(f, 100) == "stage 1 | round 7 | 12.5 samples/s | loss 2.250 | credited 1.3k samples (163.8k tokens), 5/6 rounds"
    assert render(f, 30).startswith("stage 1 | round 7")
    assert len(render(f, 5)) <= 4


def test_render_before_any_round() -> None:
    assert render(Figures(), 120) == ("stage - | round - | - samples/s | loss - | ↑0 B ↓0 B | "
                                      "credited 0 samples, 0/0 rounds")


def test_figures_from_events_credit_only_completed_rounds_of_two_or_more() -> None:
    line = StatusLine(tokens_per_sample=None)
    line.observe({"event": "started", "peer": PEER, "stage": 0})
    line.observe(round_event(1))
    line.observe(round_event(2, complete=False))
    line.observe(round_event(3, group=1))  # alone: nobody validated it
    line.observe(round_event(4, train_loss=float("nan")))  # a round without a loss keeps the last one
    line.observe({"event": "moved", "stage": 0, "from_stage": 1, "to_stage": 0})
    f = line.figures
    assert (f.peer_id, f.stage, f.round, f.rounds, f.rounds_complete) == (PEER, 0, 4, 4, 2)
    assert f.credited_samples == 128 and f.train_loss == 2.25
    assert (f.bytes_sent, f.bytes_recv) == (4 * 1_500_000, 4 * 500_000)


def test_handler_keeps_log_lines_above_the_line() -> None:
    tty = FakeTTY()
    line = StatusLine()
    handler = StatusLineHandler(tty, line, width=lambda: 120)
    handler.setFormatter(logging.Formatter("> %(message)s"))
    log = logging.getLogger("test_status_line.above")
    log.propagate, log.level = False, logging.INFO
    log.addHandler(handler)
    try:
        log.info("joined stage %d", 1)
        line.observe(round_event(1))  # an event redraws the line in place
        log.warning("stage 1 round 2 incomplete")
    finally:
        log.removeHandler(handler)
        handler.close()
    out = tty.getvalue()
    blank = render(Figures(), 120)
    first = render(Figures(stage=1, round=1, samples_per_s=12.5, train_loss=2.25, bytes_sent=1_500_000,
                           bytes_recv=500_000, credited_samples=64, rounds_complete=1, rounds=1, peer_id=PEER), 120)
    assert out == (CLEAR + "> joined stage 1\n" + blank + CLEAR + first
                   + CLEAR + "> stage 1 round 2 incomplete\n" + first + CLEAR)
    # what a terminal shows: every log line whole, the status line last, cleared at close
    screen = [chunk.split(CLEAR)[-1] for chunk in out.split("\n")]
    assert screen[:2] == ["> joined stage 1", "> stage 1 round 2 incomplete"]
    assert line.redraw is None  # closed: events no longer draw


def test_install_replaces_the_root_handlers_and_uninstall_puts_them_back() -> None:
    root = logging.getLogger()
    before = list(root.handlers)
    tty = FakeTTY()
    handler = install(tty, StatusLine())
    try:
        assert root.handlers == [handler] and handler.replaced == before
    finally:
        uninstall(handler)
    assert root.handlers == before


def test_a_status_line_only_on_a_terminal() -> None:
    assert wants_status_line(FakeTTY(True), disabled=False)
    assert not wants_status_line(FakeTTY(True), disabled=True)  # --no-status-line
    assert not wants_status_line(FakeTTY(False), disabled=False)  # a pipe or a file: plain lines
    closed = FakeTTY()
    closed.close()
    assert not wants_status_line(closed, disabled=False)
