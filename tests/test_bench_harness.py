"""The benchmarks' shared harness (benchmarks/harness/): every benchmark takes the common flags, the
single-process training loop steps as a replica's worker does, and the report writer writes what
it printed, its figures and its plots. No swarm, no network: seconds."""
from __future__ import annotations

import importlib
import json
import pkgutil
import sys
from pathlib import Path

import pytest
import torch

import benchmarks
from benchmarks.harness.report import Report, add_common_args
from benchmarks.harness.training import Trainer, reference
from swarmgrad.peer.compute.schedule import lr_multiplier
from swarmgrad.peer.data import MicrobatchStream, load_corpora
from swarmgrad.peer.manifest import from_dict

BENCHMARKS = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__) if not m.ispkg)
WORKERS = {"wan_baselines"}  # a process benchmarks.wan starts, not a benchmark of its own


def test_every_benchmark_is_listed_and_takes_quick_out_and_seed(monkeypatch, capsys) -> None:
    assert set(BENCHMARKS) - WORKERS <= set(benchmarks.__doc__.split())  # the package docstring lists them all
    for name in sorted(set(BENCHMARKS) - WORKERS):
        module = importlib.import_module(f"benchmarks.{name}")
        monkeypatch.setattr(sys, "argv", [f"benchmarks.{name}", "--help"])
        with pytest.raises(SystemExit) as exit_:
            module.main()
        assert exit_.value.code == 0, name
        text = capsys.readouterr().out
        for flag in ("--quick", "--out", "--seed"):
            assert flag in text, f"{name} lacks {flag}"
        assert f"python -m benchmarks.{name}" in (module.__doc__ or ""), f"{name}'s docstring names its command"


def tiny(**schedule: object) -> object:
    return from_dict({"run_id": "t", "seed": 3, "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32},
                      "stages": {"count": 2}, "inner": {"microbatch_size": 4, "microbatches_per_step": 2},
                      "schedule": {"kind": "cosine", "warmup_samples": 16, "total_samples": 64, **schedule}})


def test_the_loop_steps_as_the_worker_does_at_the_schedules_lr() -> None:
    m = tiny()
    a, b = Trainer(m), Trainer(m)
    for sa, sb in zip(a.stages, b.stages):  # one manifest, one start
        for pa, pb in zip(sa.parameters(), sb.parameters()):
            assert torch.equal(pa, pb)
    train, _ = load_corpora("stdlib", max_bytes=100_000)
    stream = MicrobatchStream(train, 32, 4, seed=0)
    batch = [next(stream) for _ in range(2)]
    before = float(a.loss(*batch[0]).detach())
    for step in range(6):
        losses = a.step(batch)
        assert len(losses) == 2
        for opt in a.opts:  # every stage at the lr of the samples before this step
            assert opt.lr == pytest.approx(m.inner.lr * lr_multiplier(m.schedule, 8 * step))
    assert a.samples == 48
    assert float(a.loss(*batch[0]).detach()) < before  # it learns the batch it saw
    # what a step accumulates does not depend on how its samples are split into microbatches
    b.accumulate(torch.cat([x for x, _ in batch]), torch.cat([y for _, y in batch]))
    c = Trainer(m)
    for x, y in batch:
        c.accumulate(x, y)
    for pb, pc in zip(b.params(), c.params()):
        assert torch.allclose(pb.grad, pc.grad, rtol=1e-4, atol=1e-7)


def test_the_reference_schedule_spans_the_benchmarks_steps() -> None:
    m = reference(stages=2, steps=300, microbatch=32, warmup_steps=30)
    assert (m.stages.count, m.model.d_model, m.inner.microbatch_size, m.inner.microbatches_per_step) == (2, 128, 32, 1)
    assert (m.schedule.kind, m.schedule.warmup_samples, m.schedule.total_samples) == ("cosine", 960, 9600)
    flat = reference(steps=300, microbatch=32, constant_lr=True)
    assert lr_multiplier(flat.schedule, 0) == lr_multiplier(flat.schedule, 9600) == 1.0


def test_the_report_writes_what_it_printed_its_figures_and_its_plot(tmp_path: Path, capsys) -> None:
    image = pytest.importorskip("matplotlib.image")
    import argparse
    parser = argparse.ArgumentParser()
    add_common_args(parser, quick="q", seed="s")
    args = parser.parse_args(["--quick", "--out", str(tmp_path / "out"), "--seed", "7"])
    assert args.quick and args.seed == 7 and args.out == tmp_path / "out"
    report = Report("A title", args.out)
    report.print("a line")
    report.table(["a", "b"], [[1, "x"]])
    report.results = {"path": tmp_path, "values": [1.5]}

    def draw(fig) -> None:  # type: ignore[no-untyped-def]
        ax = fig.subplots()
        ax.plot([0, 1], [1, 0], label="line")
        ax.set_title("plot")
        ax.legend()
    report.figure("plot.png", draw, size=(4.0, 3.0))
    assert [p.name for p in report.write()] == ["report.md", "results.json", "plot.png"]
    assert (args.out / "report.md").read_text() == "# A title\n\na line\n| a | b |\n|---|---|\n| 1 | x |\n"
    assert json.loads((args.out / "results.json").read_text()) == {"path": str(tmp_path), "values": [1.5]}
    assert image.imread(args.out / "plot.png").shape[:2] == (300, 400)
    assert "a line" in capsys.readouterr().out
    assert Report("nothing written", None).write() == []
