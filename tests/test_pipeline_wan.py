"""benchmarks/pipeline_wan.py's pure parts: rows as manifest overrides, the figures a run's events
give, the table's and the goals' arithmetic, the memory each peer offers. No root, no peers: seconds."""
from __future__ import annotations

import math

import pytest

from benchmarks import pipeline_wan as pw
from benchmarks.harness.overrides import OverrideError, Row, apply, parse_row, parse_rows
from benchmarks.harness.pipeline_figures import (PeerEvents, RunFigures, fp32_boundary_bytes, loss_curve, rate_bytes,
                                                 slow_share, summarise, time_to, trained, within)
from swarmgrad.peer.manifest import load
from swarmgrad.peer.placement.cost import stage_costs

PRESET = load(pw.PRESET)


# --- rows ---------------------------------------------------------------------------------------------
def test_a_row_is_a_name_and_typed_dotted_overrides() -> None:
    row = parse_row("t:pipeline.lookahead=true,inner.lr=2e-3,rounds.inner_steps=4,"
                    "inner.microbatch_sizes=[2, 8, 4],pipeline.activation_codec=fp32,seed=7")
    assert row.name == "t"
    assert dict(row.overrides) == {"pipeline.lookahead": True, "inner.lr": 2e-3, "rounds.inner_steps": 4,
                                   "inner.microbatch_sizes": [2, 8, 4], "pipeline.activation_codec": "fp32", "seed": 7}
    assert parse_row(row.spec()) == row
    assert parse_row("defaults:") == Row("defaults")


def test_a_codec_spec_keeps_its_commas_and_colons() -> None:
    row = parse_row("c:pipeline.gradient_codec=hadamard:bits=4,stochastic=true,pipeline.activation_codec=lowrank:rank=32")
    assert dict(row.overrides) == {"pipeline.gradient_codec": "hadamard:bits=4,stochastic=true",
                                   "pipeline.activation_codec": "lowrank:rank=32"}
    assert parse_row(row.spec()) == row
    m = apply(PRESET, row)
    assert (m.pipeline.gradient_codec, m.pipeline.activation_codec) == ("hadamard:bits=4,stochastic=true", "lowrank:rank=32")
    assert apply(PRESET, parse_row('q:pipeline.gradient_codec="int8"')).pipeline.gradient_codec == "int8"


def test_overrides_load_as_a_manifest_and_the_rest_is_kept() -> None:
    m = apply(PRESET, parse_row("la:pipeline.lookahead=true,inner.lr=0.002"))
    assert m.pipeline.lookahead and m.inner.lr == 0.002
    assert m.replace(pipeline={"lookahead": False}, inner={"lr": PRESET.inner.lr}) == PRESET
    assert apply(PRESET, Row("defaults")) == PRESET


@pytest.mark.parametrize("text, says", [
    ("x:pipeline.nope=1", "pipeline.nope is not a known field"),
    ("x:pipeline.lookahead=3", "pipeline.lookahead must be true or false"),
    ("x:pipelin.lookahead=true", "pipelin is not a known field or section"),
    ("x:pipeline.activation_codec=bogus", "unknown codec 'bogus'"),
    ("x:pipeline.lookahead.deeper=true", "pipeline.lookahead is a value"),
])
def test_a_bad_override_is_an_error_naming_the_row_and_key(text: str, says: str) -> None:
    with pytest.raises(OverrideError, match="row 'x'") as e:
        apply(PRESET, parse_row(text))
    assert says in str(e.value)


@pytest.mark.parametrize("text", ["x", ":a.b=1", "x:lookahead=true", "x:a.b=1,a.b=2", "bad name:a.b=1"])
def test_a_row_that_does_not_parse_is_refused(text: str) -> None:
    with pytest.raises(OverrideError):
        parse_row(text)


def test_row_names_are_unique() -> None:
    with pytest.raises(OverrideError, match="used twice"):
        parse_rows(["a:", "a:pipeline.lookahead=true"])


def test_the_command_refuses_a_bad_row_before_anything_starts(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        pw.parse_args(["--rows", "ok:", "bad:pipeline.lookahead=maybe"])
    assert e.value.code == 2
    assert "row 'bad'" in capsys.readouterr().err
    args = pw.parse_args(["--quick"])
    assert [r.name for r in args.rows] == ["defaults"] and (args.samples, args.inner_steps) == (192, 3)
    args = pw.parse_args([])
    assert [r.name for r in args.rows] == ["exact-fp32", "defaults", "lookahead"] and args.reference == "exact-fp32"
    assert args.manifests[("exact-fp32", 0)].pipeline.activation_codec == "fp32"
    assert args.links == list(pw.LINKS) and (args.samples, args.inner_steps) == (384, 4)
    args = pw.parse_args(["--rows", "a:", "b:pipeline.lookahead=true", "--reference", "b", "--seeds", "0", "1"])
    assert sorted(args.manifests) == [("a", 0), ("a", 1), ("b", 0), ("b", 1)] and args.reference == "b"


# --- the swarm's manifest and memory -------------------------------------------------------------------
def test_every_row_trains_the_same_samples_with_the_schedule_over_them() -> None:
    m = pw.base_manifest(pw.PRESET, seed=3, samples=384, inner_steps=4)
    assert (m.seed, m.rounds.inner_steps, m.rounds.round_seconds, m.data.eval_every) == (3, 4, 0.0, 0)
    assert (m.schedule.kind, m.schedule.warmup_samples, m.schedule.total_samples) == ("cosine", 38, 384)
    assert pw.rounds_for(m, 384) == 3  # 2 drivers x 4 steps x 2 microbatches of 8 = 128 a round
    assert pw.rounds_for(m, 10) == 2  # the first round is not counted: two at least
    tapered = apply(m, parse_row("t:inner.microbatch_sizes=[4, 8, 4],inner.microbatches_per_step=3"))
    assert pw.rounds_for(tapered, 384) == 3  # 2 x 4 x 16


def test_each_peer_offers_one_stage_and_not_the_model() -> None:
    for m in (PRESET, apply(PRESET, parse_row("la:pipeline.lookahead=true"))):
        offer = pw.memory_offer(m)
        stages = stage_costs(m, None, compute_dtype="float32")
        whole = stage_costs(m.replace(stages={"count": 1, "layers": []}), None, compute_dtype="float32")[0]
        assert all(c.memory_bytes <= offer for c in stages) and offer < whole.memory_bytes


# --- figures from events -------------------------------------------------------------------------------
def _driver(start: float, losses: list[float], val: float, stage: int = 0) -> PeerEvents:
    """Rounds of 64 samples every 10 s from `start` + 10; pipeline events with 100 kB/s up, 50 kB/s down."""
    events = [{"event": "driving", "time": start}]
    for k, loss in enumerate(losses):
        t = start + 10 * (k + 1)
        events += [{"event": "round", "time": t, "round": k, "stage": stage, "samples": 64, "train_loss": loss,
                    "utilisation": 0.5 + 0.1 * k, "rate": 20.0},
                   {"event": "pipeline", "time": t, "up_bytes_per_s": 100e3, "down_bytes_per_s": 50e3,
                    "link_util": 0.4, "compute_util": 0.6, "bottleneck": "compute" if k else "link"}]
    events.append({"event": "eval", "time": start + 99, "final": True, "val_loss": val})
    return PeerEvents(0, rate_bytes("20mbit"), events)


def _server(start: float, n: int, stage: int = 1, rate: float = 4.0) -> PeerEvents:
    return PeerEvents(1, rate_bytes("5mbit"), [{"event": "round", "time": start + 10 * (k + 1), "round": k, "stage": stage,
                                               "samples": 64, "utilisation": 0.8, "rate": rate} for k in range(n)])


def test_figures_of_a_run_from_its_events() -> None:
    peers = [_driver(100.0, [5.0, 4.0, 3.0], 2.0), _server(100.0, 3), _driver(102.0, [5.2, 4.2, 3.2], 2.2), _server(100.0, 3)]
    sent_per_s = [1e6, 0.25e6, 2e6, 0.5e6]
    f = summarise(peers, lambda i, t0, t1: sent_per_s[i] * (t1 - t0))
    assert f.samples == 6 * 64
    assert f.samples_per_s == pytest.approx(2 * (2 * 64) / 20)  # each driver: rounds 2-3 over 20 s
    assert f.link_util == pytest.approx({0: (1e6 + 2e6) / 2 / (20e6 / 8), 1: (0.25e6 + 0.5e6) / 2 / (5e6 / 8)})
    assert f.up_mbps[1] == pytest.approx((0.25e6 + 0.5e6) / 2 * 8 / 1e6)
    assert f.compute_util == pytest.approx({0: 0.65, 1: 0.8})  # counted rounds only
    # the k-th pipeline event covers the time since the (k-1)-th: 10 s of 150 kB/s per 64 samples
    assert f.up_bytes_per_sample == pytest.approx(10 * 100e3 / 64)
    assert f.boundary_bytes_per_sample == pytest.approx(10 * 150e3 / 64)
    assert (f.bottleneck, f.driver_link_util, f.driver_compute_util) == ("compute", 0.4, 0.6)
    assert f.val_loss == pytest.approx(2.1) and f.one_stage_each and not f.notes
    assert f.compute_rate == [20.0, 4.0, 20.0, 4.0]
    # the loss curve: per round, the later driver's time since the first driving event, the mean loss
    assert [t for t, _ in f.losses] == [12.0, 22.0, 32.0]
    assert [x for _, x in f.losses] == pytest.approx([5.1, 4.1, 3.1])
    assert time_to(f.losses, 4.11) == 22.0 and math.isnan(time_to(f.losses, 1.0))


def test_incomplete_rounds_and_lost_microbatches_are_counted() -> None:
    d = _driver(100.0, [5.0, 4.0], 2.0)
    d.events[1]["complete"] = False
    d.events[-1].update(lost=2, retries=5)
    f = summarise([d, _server(100.0, 2)], lambda *_: math.nan)
    assert (f.incomplete_rounds, f.lost, f.retries) == (1, 2, 5)
    assert f.notes == ["1 incomplete round(s)", "2 microbatch(es) given up", "5 microbatch retries"]


def test_boundary_bytes_pair_pipeline_events_with_the_rounds_between_them() -> None:
    d = _driver(100.0, [5.0, 4.0, 3.0, 2.5], 2.0)
    del d.events[4]  # round 1's pipeline event is missing (a resync): its bytes land in round 2's window
    d.events[-2]["time"] += 0.01  # and a pipeline event a little after its round
    f = summarise([d, _server(100.0, 4)], lambda *_: math.nan)
    # windows (110, 130] and (130, 140.01]: 20 s then 10 s at 100 kB/s up, over rounds 1-3 (3 x 64)
    assert f.up_bytes_per_sample == pytest.approx((20 * 100e3 + 10.01 * 100e3) / (3 * 64))


def test_an_incomplete_rounds_samples_carried_into_the_next_are_counted_once() -> None:
    rounds = [{"time": 10.0, "samples": 48, "complete": False}, {"time": 20.0, "samples": 96, "complete": True},
              {"time": 30.0, "samples": 48, "complete": False}, {"time": 40.0, "samples": 48, "complete": True}]
    trained(rounds, resyncs=[29.0])  # the second incomplete round's work was dropped by a re-sync at its end
    assert [e["trained"] for e in rounds] == [48, 48, 48, 48]
    d = _driver(100.0, [5.0, 4.0, 3.0], 2.0)
    d.events[1]["complete"] = False
    d.events[3]["samples"] = 128  # round 1 carries round 0's 64
    f = summarise([d, _server(100.0, 3)], lambda *_: math.nan)
    assert f.samples == 3 * 64 and f.samples_per_s == pytest.approx(2 * 64 / 20)


def test_a_peer_that_served_another_stage_is_flagged() -> None:
    moved = _server(100.0, 3)
    moved.events[-1]["stage"] = 0
    f = summarise([_driver(100.0, [5.0, 4.0], 2.0), moved], lambda *_: math.nan)
    assert not f.one_stage_each and "served another stage" in f.notes[0]


def test_a_driver_without_rounds_or_final_eval_leaves_no_rate_and_says_so() -> None:
    lone = PeerEvents(0, None, [{"event": "round", "time": 1.0, "round": 0, "stage": 0, "samples": 8}])
    f = summarise([_driver(0.0, [5.0, 4.0], 2.0), lone], lambda *_: math.nan)
    assert math.isnan(f.samples_per_s) and len(f.notes) == 2 and math.isnan(f.link_util[0])
    assert loss_curve([]) == []


def test_fp32_boundary_and_the_loss_goal() -> None:
    assert fp32_boundary_bytes(128, 256) == 262144
    assert within(1.01, 1.0) and not within(1.0101, 1.0) and within(math.nan, 1.0) is None


def test_the_slow_replica_goal_counts_its_share_and_no_more_than_four_fast_peers() -> None:
    s = slow_share(others=10.0, slow_rate=5e6 / 8, bytes_per_sample=125e3, compute=8.0)
    assert (s.link_limited, s.compute, s.share, s.ideal) == (5.0, 8.0, 5.0, 15.0)
    assert s.ratio(13.5) == pytest.approx(0.9)
    assert slow_share(10.0, 5e6 / 8, 125e3, 2.0).share == 2.0  # compute-limited
    assert slow_share(10.0, 5e6 / 8, 125e3, 8.0, all_fast=12.0).ideal == 12.0
    assert slow_share(10.0, 5e6 / 8, 0.0, math.nan).share == math.inf  # nothing measured: no bound


def _run(row: str, link: str, sps: float, val: float, bps: float = 131072.0, variant: str = "full",
         losses: list[tuple[float, float]] | None = None, rates: list[float] | None = None) -> pw.Run:
    f = RunFigures(samples=384, samples_per_s=sps, val_loss=val, up_bytes_per_sample=bps / 2,
                   down_bytes_per_sample=bps / 2, losses=losses or [(10.0, 4.0), (20.0, 3.0)],
                   compute_rate=rates or [10.0, 9.0, 10.0, 3.0])
    return pw.Run(row, link, 0, variant, figures=f)


def test_the_table_and_the_goals_from_runs() -> None:
    fp32 = fp32_boundary_bytes(128, 256)
    runs = [_run("ref", "unshaped", 10.0, 2.0, fp32), _run("new", "unshaped", 12.0, 2.0),
            _run("ref", "20mbit", 9.0, 2.0, fp32), _run("new", "20mbit", 11.7, 2.01, 8192.0),
            _run("new", "slow-replica", 9.0, 2.0), _run("new", "slow-replica", 7.0, 2.0, variant="without-slow")]
    table = pw.main_table(runs, "ref", fp32, None)
    lines = table.splitlines()
    assert len(lines) == 2 + 5  # the baseline run has no row of its own
    new20 = next(line for line in lines if "| new " in line and "20mbit" in line)
    assert "| 0.97 " in new20 and "(+0.50 %)" in new20 and "(32.0x)" in new20
    assert "20 (≤ 3.060)" in new20  # the reference's final training loss x 1.02, reached in round 2
    slow = pw.slow_rows(runs, slow_stage=1)
    assert len(slow) == 1
    _, share = slow[0]
    # link-limited: 5 Mbit / 65536 answer bytes per sample; compute: the slow peer's (index 3) 3.0; capped by 11.7
    assert share.link_limited == pytest.approx(5e6 / 8 / 65536) and share.compute == 3.0
    assert share.ideal == pytest.approx(min(7.0 + 3.0, 11.7))
    goals = "\n".join(pw.goal_lines(runs, "ref", fp32, slow))
    assert "new (seed 0) at 20 Mbit: 0.97 of unshaped, loss +0.50 % vs ref: met" in goals
    assert "ref (seed 0) at 20 Mbit: 0.90 of unshaped, loss +0.00 % vs ref: not met" in goals
    assert "new (seed 0) boundary bytes: 32.0x below fp32 (goal ≥ 32x at ≤ 1 %): met" in goals
    assert "0.90 of the others + its share: met" in goals
    assert "| 0.90 met" in pw.slow_table(slow)
