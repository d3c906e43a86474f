"""The stage benchmark's cache, and a pinned peer's one-stage benchmark (its announced rate before
its first round; 0 there draws other peers to its stage)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from swarmgrad.peer.placement import bench as stage_bench
from swarmgrad.peer.cli.launcher import small_manifest
from swarmgrad.peer.model import from_manifest


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SWARMGRAD_CACHE", str(tmp_path))
    return tmp_path / "stage-rates.json"


def _count_benches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    benched: list[int] = []
    real = stage_bench.bench_stage

    def counting(model, stage, *args):
        benched.append(stage)
        return real(model, stage, *args)
    monkeypatch.setattr(stage_bench, "bench_stage", counting)
    return benched


def test_a_pinned_peer_benchmarks_its_own_stage_once(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = small_manifest()
    model = from_manifest(manifest)
    benched = _count_benches(monkeypatch)
    rate = stage_bench.stage_rate(manifest, model, "cpu", 1)
    assert rate > 0 and benched == [1]
    assert stage_bench.stage_rate(manifest, model, "cpu", 1, slowdown=4.0) == pytest.approx(rate / 4)
    assert benched == [1], "the second call should read the cache"
    (key,) = json.loads(cache.read_text())
    assert key.endswith("|stage 1")
    # the every-stage benchmark does not take a one-stage entry for its own
    rates = stage_bench.stage_rates(manifest, model, "cpu")
    assert len(rates) == 2 and benched == [1, 0, 1]


def test_a_pinned_peer_reads_the_every_stage_entry(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = small_manifest()
    model = from_manifest(manifest)
    rates = stage_bench.stage_rates(manifest, model, "cpu")
    benched = _count_benches(monkeypatch)
    assert stage_bench.stage_rate(manifest, model, "cpu", 0, slowdown=2.0) == rates[0] / 2
    assert benched == []


def test_a_corrupt_cache_is_measured_again_and_rewritten(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = small_manifest()
    model = from_manifest(manifest)
    cache.write_text("[not a dict")
    benched = _count_benches(monkeypatch)
    assert stage_bench.stage_rate(manifest, model, "cpu", 0) > 0 and benched == [0]
    assert len(json.loads(cache.read_text())) == 1
    cache.write_text("[1, 2]")  # valid JSON, not a dict
    assert len(stage_bench.stage_rates(manifest, model, "cpu")) == 2 and benched == [0, 0, 1]
