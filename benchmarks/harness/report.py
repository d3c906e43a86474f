"""How a benchmark takes its common flags and hands back its result.

Every benchmark takes ``--quick`` (its smoke run), ``--out DIR`` and ``--seed N`` (`add_common_args`)
and collects its result in a `Report`: the markdown it prints (tables and notes, kept for
``report.md``), the figures it computed (``results.json``) and its plots (PNG, drawn with
matplotlib). Without ``--out`` nothing is written; without matplotlib (the ``bench`` extra) each
plot is skipped with one line saying so and everything else is written.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any, Callable, Sequence

STYLE = {
    "font.size": 11, "axes.titlesize": 12, "axes.labelsize": 11, "xtick.labelsize": 10, "ytick.labelsize": 10,
    "legend.fontsize": 9, "axes.grid": True, "grid.alpha": 0.3, "lines.linewidth": 1.8,
}
"""Fonts and lines of every plot: readable at the PNG's own size."""


def add_common_args(parser: argparse.ArgumentParser, *, quick: str, seed: str) -> None:
    """``--quick`` (help: what the smoke run does), ``--out DIR``, ``--seed N`` (help: what it seeds;
    its default is None: the benchmark's own, see `seed_or`)."""
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--out", type=Path, default=None,
                        help="write report.md (the printed tables), results.json and the plots (PNG) here")
    parser.add_argument("--seed", type=int, default=None, help=seed)


def seed_or(args: argparse.Namespace, default: int) -> int:
    """--seed if given, else the benchmark's default (a manifest's seed, or 0)."""
    return default if args.seed is None else args.seed


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells[1:])])


def fmt(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:,.{digits}f}"


Draw = Callable[[Any], None]
"""Draws on a matplotlib `Figure` (its only argument): adds axes, curves, titles, legends."""


def save_png(path: Path, draw: Draw, size: tuple[float, float] = (10.0, 4.5), dpi: int = 100) -> bool:
    """Draw a figure of `size` inches at `dpi` with `draw` and save it as PNG at `path`. Without
    matplotlib: one line saying so, nothing written, False. No pyplot: no global backend, no
    window, safe in any process."""
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError:
        print(f"plot {path.name} skipped: matplotlib is not installed (pip install 'swarmgrad[bench]')", flush=True)
        return False
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=size, dpi=dpi, layout="constrained")
        draw(fig)
        fig.savefig(path, format="png")
    return True


class Report:
    """A benchmark's result. `print` and `table` print at once and keep the text for report.md;
    `results` is what results.json holds (anything JSON can write; Paths and the like as str);
    `figure` registers a plot, drawn only by `write`. `write` may run more than once (a long
    benchmark writes after every run, so that a stopped run keeps what it measured)."""

    def __init__(self, title: str, out: Path | None):
        self.title = title
        self.out = out
        self.lines: list[str] = []
        self.results: Any = {}
        self.figures: dict[str, tuple[Draw, tuple[float, float]]] = {}

    def print(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)

    def table(self, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self.print(markdown_table(header, rows))

    def figure(self, filename: str, draw: Draw, size: tuple[float, float] = (10.0, 4.5)) -> None:
        self.figures[filename] = (draw, size)

    def write(self) -> list[Path]:
        """report.md, results.json and every figure into --out (created); the paths written."""
        if self.out is None:
            return []
        self.out.mkdir(parents=True, exist_ok=True)
        written = [self.out / "report.md", self.out / "results.json"]
        written[0].write_text(f"# {self.title}\n\n" + "\n".join(self.lines).strip("\n") + "\n")
        written[1].write_text(json.dumps(self.results, indent=1, default=str) + "\n")
        for filename, (draw, size) in self.figures.items():
            if save_png(self.out / filename, draw, size):
                written.append(self.out / filename)
        return written

    def finish(self) -> None:
        """`write`, then one line naming what was written (nothing without --out)."""
        written = self.write()
        if written:
            print(f"\nwrote {', '.join(str(p) for p in written)}", flush=True)
