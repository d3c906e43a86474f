"""Mixed precision, activation checkpointing and fused AdamW (peer/compute/precision.py), and what
placement counts for them (peer/placement/cost.py). CUDA tests run where a GPU is present."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from swarmgrad.peer.clock import RoundClock
from swarmgrad.peer.compute.precision import (Precision, enable_activation_checkpointing, parameters_fp32,
                                              resolve_compute_dtype)
from swarmgrad.peer.compute.schedule import TrainingProgress
from swarmgrad.peer.compute.worker import StageWorker
from swarmgrad.peer.manifest import ManifestError
from swarmgrad.peer.model import from_manifest
from swarmgrad.peer.placement.cost import stage_costs
from swarmgrad.peer.state.stage_state import load_checkpoint
from conftest import small_manifest

from support.swarm import InProcessSwarm, step_manifest

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")


def _batch(m, n: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, m.model.vocab_size, (n, m.model.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def test_the_compute_dtype_is_the_manifests_on_cuda_and_float32_on_the_cpu_unless_asked() -> None:
    assert resolve_compute_dtype("bfloat16", "cpu") == torch.float32
    assert resolve_compute_dtype("bfloat16", "cpu", "bfloat16") == torch.bfloat16
    assert resolve_compute_dtype("float32", "cpu", "bfloat16") == torch.bfloat16
    assert resolve_compute_dtype("float32", "cpu", "auto") == torch.float32
    with pytest.raises(ValueError, match="--compute-dtype"):
        resolve_compute_dtype("float32", "cpu", "float16")
    with pytest.raises(ManifestError, match="model.dtype"):
        small_manifest(model={"dtype": "float16"})


def test_checkpointed_blocks_give_the_same_gradients_and_keep_their_names() -> None:
    m = small_manifest()
    model = from_manifest(m)
    plain, ckpt = model.build_stage(0), model.build_stage(0)
    assert enable_activation_checkpointing(ckpt) == m.layers_per_stage[0] > 0
    assert list(plain.state_dict()) == list(ckpt.state_dict())
    x, _ = _batch(m)
    for module in (plain, ckpt):
        module(x).square().mean().backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_a_copy_of_a_checkpointed_module_computes_with_its_own_weights() -> None:
    """The evaluation copy is a deepcopy (peer/compute/evaluation.py): a forward wrapped around the
    original block's bound method would silently keep evaluating the live weights."""
    m = small_manifest()
    module = from_manifest(m).build_stage(0)
    enable_activation_checkpointing(module)
    twin = copy.deepcopy(module)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    x, _ = _batch(m)
    with torch.enable_grad():
        assert not torch.equal(module(x), twin(x))
        assert torch.count_nonzero(twin(x)) == 0


def test_bfloat16_trains_fp32_master_weights_and_sends_bf16_values() -> None:
    m = small_manifest(inner={"microbatches_per_step": 1})
    model = from_manifest(m)
    precision = Precision(torch.device("cpu"), torch.bfloat16)
    clock = RoundClock(m.rounds, counts_steps=True, max_rounds=0, epoch=None)
    last = StageWorker(model.build_stage(1), m.inner, torch.device("cpu"), model.loss_fn, clock,
                       TrainingProgress(m.schedule), precision=precision)
    first = model.build_stage(0)
    before = {k: v.clone() for k, v in last.module.state_dict().items()}
    x, targets = _batch(m)
    with precision.autocast():
        h = first(x)
    assert not torch.equal(h, first(x))  # autocast took effect (the residual stream itself stays fp32)
    sent = precision.boundary(h)
    assert sent.dtype == torch.float32 and torch.equal(sent, sent.to(torch.bfloat16).float())
    loss, grad_x = last.passes.forward_loss(sent, targets, train=True)
    assert torch.isfinite(torch.tensor(loss)) and grad_x is not None and grad_x.dtype == torch.float32
    assert last.inner.step(1, x.shape[0], x.shape[0])
    assert list(parameters_fp32(last.module)) == []
    assert all(s["exp_avg"].dtype == torch.float32 for s in last.inner.optimizer.state.values())
    assert any(not torch.equal(before[k], v) for k, v in last.module.state_dict().items())


def test_float32_precision_changes_nothing() -> None:
    precision = Precision(torch.device("cpu"))
    t = torch.randn(3, 4, dtype=torch.float64)
    assert not precision.mixed and precision.boundary(t).dtype == torch.float32
    with precision.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


def test_the_memory_estimate_counts_bf16_activations_weight_casts_and_checkpointing() -> None:
    base = dict(model={"d_model": 64, "n_layers": 4, "n_heads": 4, "seq_len": 64})
    fp32 = stage_costs(small_manifest(**base))[0].memory
    bf16 = stage_costs(small_manifest(model={**base["model"], "dtype": "bfloat16"}))[0].memory
    cpu = stage_costs(small_manifest(model={**base["model"], "dtype": "bfloat16"}), compute_dtype="float32")[0].memory
    ckpt = stage_costs(small_manifest(model={**base["model"], "activation_checkpointing": True}))[0].memory
    assert cpu == fp32  # a CPU peer computes in float32: the same need as an fp32 run
    assert bf16.weights == fp32.weights and bf16.adam == fp32.adam  # master weights and moments stay fp32
    assert bf16.activations != fp32.activations
    assert ckpt.activations < fp32.activations
    assert ckpt.total < fp32.total


@CUDA
def test_cuda_bf16_autocast_and_fused_adamw() -> None:
    m = small_manifest(inner={"microbatches_per_step": 1})
    model = from_manifest(m)
    device = torch.device("cuda")
    precision = Precision(device, resolve_compute_dtype("bfloat16", device))
    clock = RoundClock(m.rounds, counts_steps=True, max_rounds=0, epoch=None)
    worker = StageWorker(model.build_stage(1), m.inner, device, model.loss_fn, clock, TrainingProgress(m.schedule),
                         precision=precision)
    assert worker.inner.optimizer.defaults.get("fused") is True
    h = torch.randn(2, m.model.seq_len, m.model.d_model)
    _, targets = _batch(m)
    loss, grad_x = worker.passes.forward_loss(h, targets, train=True)
    assert grad_x is not None and grad_x.device.type == "cpu"
    assert worker.inner.step(1, 2, 2)
    assert list(parameters_fp32(worker.module)) == []


@pytest.mark.timeout(120)
def test_a_swarm_asked_for_bf16_on_the_cpu_trains_rounds_with_fp32_state(inprocess, tmp_path: Path) -> None:
    m = step_manifest(1, model={"dtype": "bfloat16", "activation_checkpointing": True},
                      pipeline={"activation_codec": "bf16", "gradient_codec": "bf16"})

    async def scenario() -> list[Path]:
        async with InProcessSwarm(m, tmp_path=tmp_path) as swarm:
            peers = [swarm.start(s, max_rounds=2, save=True, compute_dtype="bfloat16") for s in (0, 1)]
            await swarm.wait_exit(90)
            for p in peers:
                started = p.events("started")[0]
                assert started["compute_dtype"] == "bfloat16" and started["activation_checkpointing"] is True
            return [Path(p.peer.opt.save_dir) for p in peers]  # type: ignore[union-attr,arg-type]

    saves = inprocess(scenario)
    model = from_manifest(m)
    for s, save in enumerate(saves):
        params, _, meta = load_checkpoint(sorted(save.glob(f"stage{s}-*.safetensors"))[-1])
        assert int(meta["applied_rounds"]) >= 1
        fresh = dict(model.build_stage(s).named_parameters())
        assert all(t.dtype == torch.float32 and bool(torch.isfinite(t).all()) for t in params.values())
        assert any(not torch.equal(params[n], fresh[n].detach()) for n in params)
