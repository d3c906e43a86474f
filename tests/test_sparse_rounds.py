"""benchmarks/sparse_rounds.py, the one-process harness the pseudo-gradient and overlap figures
come from, on a tiny model: every kind of variant runs (it had stopped running when the inner
optimiser's signature changed, and nothing noticed), overlapped rounds change the result only
from their second round on, and the eager start differs from the delayed one."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from benchmarks.sparse_rounds import VARIANTS, eager_start, run_ddp, run_variant
from swarmgrad.peer.data import load_corpora, validation_batches
from swarmgrad.peer.manifest import OuterOptConfig, from_dict
from swarmgrad.peer.state.stage_state import StageState

# No timeout of its own (pyproject's 300 s catches a hang): this is compute only, and its time is the
# machine's load (with two torch threads it hit a 120 s timeout at load 20; tests/conftest.py now
# runs one, and it takes ~3 s).

MANIFEST = from_dict({
    "run_id": "t", "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32}, "stages": {"count": 1},
    "inner": {"microbatch_size": 4, "microbatches_per_step": 2},
    "rounds": {"inner_steps": 2, "round_seconds": 0.0, "max_rounds": 3},
    "data": {"eval_batches": 2},
})


@pytest.fixture(scope="module")
def data():
    train, val = load_corpora("stdlib", max_bytes=200_000)
    return train, validation_batches(val, MANIFEST.model.seq_len, MANIFEST.inner.microbatch_size, 2)


def run(name: str, rounds: int, data, **change) -> dict:
    return run_variant(MANIFEST, dataclasses.replace(VARIANTS[name], **change), rounds, 2, *data)


def test_every_kind_of_variant_runs(data) -> None:
    # two rounds: an overlapped variant's mean lands in the second (shift, rebase), which is also the last
    for name in ("fp32", "int8+ef/sgd1/overlap", "int8+ef/sgd1/eager", "int4+ef/gather/sgd1/swarm-moment/eager",
                 "ctk64b2+ef/reduce-ef"):
        res = run(name, 2, data)
        assert math.isfinite(res["val"]) and res["bytes_per_sample"] > 0, name
        assert res["samples"] == 2 * 2 * 2 * 8
    assert math.isfinite(run_ddp(MANIFEST, 4, 2, *data)["val"])


def test_overlap_changes_nothing_in_a_run_of_one_round_and_eager_differs_from_delayed(data) -> None:
    # the swarm's last round is a plain one, so one round overlaps nothing
    assert run("int8+ef/sgd1/overlap", 1, data)["val"] == run("int8+ef/sgd1", 1, data)["val"]
    plain, delayed, eager = (run(n, 3, data)["val"] for n in ("int8+ef/sgd1", "int8+ef/sgd1/overlap",
                                                               "int8+ef/sgd1/eager"))
    assert delayed != plain and eager != delayed
    # a later landing changes the delayed run (more steps from the un-averaged point)
    assert run("int8+ef/sgd1/overlap", 3, data, lands_after=2)["val"] != delayed


def test_the_eager_start_is_the_outer_step_its_estimate_would_take_and_takes_none() -> None:
    torch.manual_seed(0)
    outer = OuterOptConfig(lr=0.7, momentum=0.9, nesterov=True)
    state = StageState(nn.Linear(3, 2), outer)
    last = {n: torch.randn_like(p) for n, p in state.params.items()}
    for _ in range(3):  # without a momentum buffer yet, then with one
        own = {n: torch.randn_like(p) for n, p in state.params.items()}
        state.commit(0)
        digest = state.digest
        start = eager_start(state, own, last, 0.25, 0.5).params
        state.commit(0)
        assert state.digest == digest, "θ_global and the outer momentum are untouched"
        state.apply_outer({n: 0.25 * own[n] + 0.75 * last[n] for n in own}, lr_multiplier=0.5)
        for n, p in state.params.items():
            assert torch.equal(start[n].detach(), p.detach())
    alone = eager_start(state, own, None, 0.25, 1.0).params
    state.apply_outer(own)
    for n, p in state.params.items():  # no last mean: our own Δ stands for the mean
        assert torch.equal(alone[n].detach(), p.detach())
