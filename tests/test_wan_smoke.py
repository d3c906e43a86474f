"""`python -m benchmarks.wan --quick` end to end: real processes in network namespaces, one table row per
system. Timing is not asserted (the machine is shared); only that every system ran and was scored.
Skipped where namespaces cannot be made (not root, no iproute2), as the script itself skips there,
and out of `make test` (~30-90 s of namespaces and peers): `make test-slow` runs it."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import wan
from benchmarks.harness import netns
from support.imports import hide_package

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(280)

WHY = netns.why_unavailable()


def test_skips_with_exit_0_where_namespaces_are_unavailable() -> None:
    """CI without root must not fail: as root, drop to `nobody` (setpriv) to reach the skip path."""
    cmd = [sys.executable, "-m", "benchmarks.wan", "--quick"]
    if WHY is None:
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv: cannot reach the skip path")
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.startswith("SKIP:"), proc.stdout + proc.stderr


@pytest.mark.skipif(WHY is not None, reason=f"no network namespaces: {WHY}")
@pytest.mark.skipif(not os.environ.get("SWARMGRAD_SLOW_TESTS"),
                    reason="namespaces and peers (~30-90 s): set SWARMGRAD_SLOW_TESTS=1 or run `make test-slow`")
def test_quick_run_prints_one_row_per_system(spawned_peers: Path) -> None:
    tmp_path = spawned_peers
    systems = ["swarmgrad", "ddp"]
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.wan", "--quick", "--systems",
                             ",".join(systems), "--out", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    try:
        stdout, stderr = proc.communicate(timeout=250)
    finally:
        if proc.poll() is None:  # SIGINT: wan.py's finally blocks stop its peers and delete its namespaces
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(25)
            except subprocess.TimeoutExpired:
                proc.kill()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    rows = [line for line in stdout.splitlines() if line.startswith("| ") and "unshaped" in line.split("|")[2]]
    assert [r.split("|")[1].strip() for r in rows] == systems, stdout
    assert not any("FAILED" in r for r in rows), stdout
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    for r in results:
        assert r["points"][0][1] == 0 and r["points"][-1][1] >= r["samples"]  # init and final weights scored
        assert 0 < r["points"][-1][2] < r["points"][0][2]  # training lowered the loss
        assert r["bytes_sent"] > 0
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [n for n in _namespaces() if n.startswith(f"{netns.PREFIX}{proc.pid}-")]  # the run removed its own


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(netns.PREFIX)]


# --- the benchmark's pure pieces: no namespaces, no processes -------------------------------------
def test_time_to_target_interpolates_between_scored_points() -> None:
    r = wan.Result("x", "unshaped", samples=300, points=[(0.0, 0, 8.0), (10.0, 100, 4.0), (20.0, 200, 2.0), (30.0, 300, 1.5)])
    assert r.time_to(3.0) == pytest.approx(15.0)  # 4.0 at 10 s, 2.0 at 20 s
    assert r.time_to(1.0) != r.time_to(1.0)  # never reached: nan
    assert r.final() == 1.5 and r.trained == 300
    short = wan.Result("x", "unshaped", samples=400, points=r.points)
    assert short.final() != short.final()  # budget not reached: no final figure


def test_throughput_and_start_leave_out_the_initial_weights() -> None:
    # trained from 4 s on at 10 samples/s: 100 samples at 14 s, 300 at 34 s
    r = wan.Result("x", "unshaped", samples=300, points=[(0.0, 0, 8.0), (14.0, 100, 4.0), (24.0, 200, 3.0),
                                                         (34.0, 300, 2.5)])
    assert r.samples_per_s() == pytest.approx(10.0) and r.start_s() == pytest.approx(4.0)
    one = wan.Result("x", "unshaped", samples=100, points=r.points[:2])
    assert one.samples_per_s() != one.samples_per_s() and one.start_s() != one.start_s()  # nan: one point
    assert "samples/s" in wan.table([r]) and "| 10.0 " in wan.table([r])


def test_png_writer_makes_a_decodable_rgb_image(tmp_path: Path) -> None:
    image = pytest.importorskip("matplotlib.image")
    path = tmp_path / "c.png"
    assert wan.plot([("ddp unshaped", [(0.0, 0, 8.0), (5.0, 640, 3.0)]),
                     ("swarmgrad 20mbit", [(0.0, 0, 8.0), (9.0, 640, 2.6)])], path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = image.imread(path)  # decodes the whole file: rows of RGB(A) pixels
    h, w, channels = pixels.shape
    assert (w, h) == (1300, 550) and channels in (3, 4)
    assert len({tuple(p) for p in pixels.reshape(-1, channels)[::7]}) > 3  # not blank: lines and text were drawn


def test_a_missing_matplotlib_skips_the_plot_in_one_line_and_nothing_else(tmp_path: Path, monkeypatch, capsys) -> None:
    hide_package(monkeypatch, "matplotlib")
    r = wan.Result("ddp", "unshaped", samples=640, points=[(0.0, 0, 8.0), (5.0, 640, 3.0)])
    written = wan.report([r], wan.QUICK, tmp_path, echo=False).write()
    assert [p.name for p in written] == ["report.md", "results.json"]
    assert "| ddp " in (tmp_path / "report.md").read_text()
    assert json.loads((tmp_path / "results.json").read_text())["results"][0]["points"][-1] == [5.0, 640, 3.0]
    assert not (tmp_path / "curves.png").exists()
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["plot curves.png skipped: matplotlib is not installed (pip install 'swarmgrad[bench]')"]


def test_scored_rounds_are_thinned_evenly_and_keep_the_last() -> None:
    thinned = wan.thinned
    assert thinned([1, 2, 3], most=5) == [1, 2, 3]
    picked = thinned(list(range(1, 252)), most=64)
    assert len(picked) == 64 and picked[-1] == 251 and picked == sorted(set(picked))
    gaps = {b - a for a, b in zip(picked, picked[1:])}
    assert gaps <= {3, 4, 5}, gaps
    assert thinned(list(range(1, 10)), most=4) == [2, 4, 7, 9]


def test_runs_parse_in_order_and_refuse_what_is_unknown() -> None:
    assert wan.parse_runs("swarmgrad@20mbit,ddp@unshaped", None, None, False) == [("swarmgrad", "20mbit"), ("ddp", "unshaped")]
    assert wan.parse_runs(None, "swarmgrad,ddp", "unshaped,20mbit", False) == [
        ("swarmgrad", "unshaped"), ("ddp", "unshaped"), ("swarmgrad", "20mbit"), ("ddp", "20mbit")]
    assert wan.parse_runs(None, None, None, True) == [("swarmgrad", "unshaped"), ("ddp", "unshaped")]
    for runs, systems, match in (("swarmgrad", None, "SYSTEM@LINK"), ("swarmgrad@10mbit", None, "10mbit"),
                                 ("dp@unshaped", None, "dp"), ("ddp@unshaped", "ddp", "one or the other")):
        with pytest.raises(ValueError, match=match):
            wan.parse_runs(runs, systems, None, False)


def test_ratios_compare_each_run_with_unshaped_ddp_of_its_own_pass() -> None:
    def run(system: str, link: str, repeat: int, t27: float) -> "wan.Result":
        # crosses 2.7 at t27: 3.0 at 0.5 t27, 2.4 at 1.5 t27
        return wan.Result(system, link, samples=100, repeat=repeat,
                          points=[(0.0, 0, 8.0), (t27 / 2, 50, 3.0), (1.5 * t27, 100, 2.4)])

    results = [run("swarmgrad", "20mbit", 0, 110.0), run("ddp", "unshaped", 0, 100.0),
               run("swarmgrad", "20mbit", 1, 156.0), run("ddp", "unshaped", 1, 120.0),
               run("swarmgrad", "20mbit", 2, 130.0)]  # the last pass has no DDP run: no ratio
    ratios = wan.ratios_to_ddp(results)
    assert ratios[:4] == pytest.approx([1.1, 1.0, 1.3, 1.0]) and ratios[4] != ratios[4]
    summary = wan.ratio_summary(results)
    assert summary == ["swarmgrad over 20mbit: time to 2.7 / unshaped DDP's of the same pass, median 1.20 "
                       "(range 1.10-1.30; within 1.2x in 1 of 2)"]
    text = wan.table(results)
    cells = [[c.strip() for c in line.split("|")[1:4]] for line in text.splitlines() if line.startswith("| ")]
    assert cells[0] == ["pass", "system", "link"] and ["2", "swarmgrad", "20mbit"] in cells
    assert "1.30" in [c.strip() for c in text.splitlines()[4].split("|")]  # pass 2's swarmgrad row
    assert "within 1.2x in 1 of 2" in text


@pytest.mark.parametrize("k", [None, 2, 16])
def test_pipelines_split_each_step_of_the_global_batch_into_the_chosen_microbatches(tmp_path: Path, k: int | None) -> None:
    import types

    budget = wan.Budget() if k is None else wan.Budget(pipe_microbatches=k)
    task = types.SimpleNamespace(train_dir=tmp_path)
    for system in wan.PIPELINES:
        m = wan.manifest_for(system, budget, task)
        want = k or 8  # the default: 8 x 8 filled the link or the compute best (README)
        assert m.stages.count == 2
        assert (m.inner.microbatches_per_step, m.inner.microbatch_size) == (want, budget.global_batch // want)
        assert m.pipeline.max_in_flight == max(4, want)
        assert m.pipeline.lookahead == (system == "swarmgrad-pipe-la")
