"""The GPT cut into stages computes exactly what the whole model computes, pipeline-style."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

from swarmgrad.peer.model import (
    GPTConfig,
    StagedModel,
    build_gpt_stage,
    build_gpt_stages,
    gpt_from_params,
    gpt_loss,
    gpt_staged_model,
    load_entry_point,
    split_layers,
)
from swarmgrad.peer.model.gpt import GPTStage

CFG = GPTConfig(d_model=32, n_layers=4, n_heads=4, seq_len=16)
SEED = 1234


def _batch(cfg: GPTConfig, batch: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _global_params(stages: list[nn.Module]) -> dict[str, torch.nn.Parameter]:
    """Parameters keyed by split-independent names (blocks renumbered to global layer index)."""
    out = {}
    for stage in stages:
        for name, p in stage.named_parameters():
            if name.startswith("blocks."):
                _, j, rest = name.split(".", 2)
                name = f"blocks.{stage.first_layer + int(j)}.{rest}"
            out[name] = p
    return out


def _pipeline_step(
    stages: list[nn.Module], inputs: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward stage by stage with detached boundaries, then backward hop by hop, as peers do."""
    boundary_inputs, outputs = [], []
    x = inputs
    for i, stage in enumerate(stages):
        if i > 0:  # what a peer receives off the wire: a leaf tensor that wants a gradient
            x = x.detach().requires_grad_()
        boundary_inputs.append(x)
        x = stage(x)
        outputs.append(x)
    loss = gpt_loss(outputs[-1], targets)
    loss.backward()
    for i in range(len(stages) - 2, -1, -1):
        outputs[i].backward(boundary_inputs[i + 1].grad)
    return outputs[-1].detach(), loss.detach()


@pytest.mark.parametrize("layers", [[4], [2, 2], [1, 2, 1]])
def test_pipeline_equals_whole_model(layers: list[int]) -> None:
    inputs, targets = _batch(CFG)
    whole = nn.Sequential(*build_gpt_stages(CFG, layers, SEED))
    ref_logits = whole(inputs)
    ref_loss = gpt_loss(ref_logits, targets)
    ref_loss.backward()

    stages = build_gpt_stages(CFG, layers, SEED)
    logits, loss = _pipeline_step(stages, inputs, targets)

    torch.testing.assert_close(logits, ref_logits.detach())
    torch.testing.assert_close(loss, ref_loss.detach())
    ref_params = _global_params(list(whole))
    params = _global_params(stages)
    assert params.keys() == ref_params.keys()
    for name, p in params.items():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, ref_params[name].grad, msg=lambda m: f"{name}: {m}")


def test_split_model_equals_single_stage_model() -> None:
    """Init does not depend on the split, so any split computes the same function."""
    inputs, _ = _batch(CFG)
    single = build_gpt_stage(CFG, [4], 0, SEED)
    split = nn.Sequential(*build_gpt_stages(CFG, [1, 2, 1], SEED))
    with torch.no_grad():
        torch.testing.assert_close(split(inputs), single(inputs))


def test_init_independent_of_split() -> None:
    a = _global_params(build_gpt_stages(CFG, [2, 2], SEED))
    b = _global_params(build_gpt_stages(CFG, [4], SEED))
    c = _global_params(build_gpt_stages(CFG, [1, 1, 1, 1], SEED))
    assert a.keys() == b.keys() == c.keys()
    for name in a:
        assert torch.equal(a[name], b[name]) and torch.equal(a[name], c[name]), name


def test_init_deterministic_and_seeded() -> None:
    state = torch.get_rng_state()
    a = build_gpt_stage(CFG, [2, 2], 1, SEED).state_dict()
    b = build_gpt_stage(CFG, [2, 2], 1, SEED).state_dict()
    c = build_gpt_stage(CFG, [2, 2], 1, SEED + 1).state_dict()
    assert torch.equal(torch.get_rng_state(), state), "building a stage must not touch the global RNG"
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert not torch.equal(a["blocks.0.attn.qkv.weight"], c["blocks.0.attn.qkv.weight"])
    # different layers get different weights
    assert not torch.equal(a["blocks.0.attn.qkv.weight"], a["blocks.1.attn.qkv.weight"])


def test_gpt2_style_init_scales() -> None:
    (stage,) = build_gpt_stages(GPTConfig(d_model=64, n_layers=8, n_heads=4, seq_len=16), [8], SEED)
    assert stage.blocks[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert stage.blocks[0].mlp.proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert torch.all(stage.blocks[0].ln1.weight == 1) and torch.all(stage.blocks[0].attn.qkv.bias == 0)


def test_stage_contents() -> None:
    first, middle, last = build_gpt_stages(CFG, [1, 2, 1], SEED)
    assert (first.stage_index, middle.stage_index, last.stage_index) == (0, 1, 2)
    assert first.n_stages == middle.n_stages == last.n_stages == 3
    assert hasattr(first, "tok_emb") and not hasattr(first, "head")
    assert not hasattr(middle, "tok_emb") and not hasattr(middle, "head") and len(middle.blocks) == 2
    assert hasattr(last, "head") and not hasattr(last, "tok_emb")


@pytest.mark.parametrize("layers", [[4], [2, 2], [1, 2, 1]])
def test_specs_match_actual_tensors(layers: list[int]) -> None:
    batch = 2
    inputs, targets = _batch(CFG, batch)
    model = gpt_staged_model(CFG, layers, SEED)
    assert model.n_stages == len(layers)
    assert model.targets_spec(batch) == (tuple(targets.shape), targets.dtype)
    x = inputs
    for s in range(model.n_stages):
        stage = model.build_stage(s)
        assert isinstance(stage, GPTStage)
        assert model.input_spec(s, batch) == stage.input_spec(batch) == (tuple(x.shape), x.dtype)
        with torch.no_grad():
            x = stage(x)
        assert model.output_spec(s, batch) == stage.output_spec(batch) == (tuple(x.shape), x.dtype)
    assert float(model.loss_fn(x, targets)) > 0


def test_shorter_sequences_and_too_long() -> None:
    (stage,) = build_gpt_stages(CFG, [4], SEED)
    assert stage(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, 256)
    with pytest.raises(ValueError, match="seq_len"):
        stage(torch.zeros(2, CFG.seq_len + 1, dtype=torch.long))


def test_split_layers() -> None:
    assert split_layers(4, 1) == [4]
    assert split_layers(4, 2) == [2, 2]
    assert split_layers(5, 3) == [2, 2, 1]
    assert split_layers(4, 4) == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="at most 4 stages"):
        split_layers(4, 5)
    with pytest.raises(ValueError):
        split_layers(4, 0)


def test_bad_configs() -> None:
    with pytest.raises(ValueError, match="n_heads"):
        GPTConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="n_layers"):
        build_gpt_stage(CFG, [2, 1], 0, SEED)
    with pytest.raises(ValueError, match="at least one block"):
        gpt_staged_model(CFG, [4, 0], SEED)
    with pytest.raises(ValueError, match="out of range"):
        build_gpt_stage(CFG, [2, 2], 2, SEED)


def test_gpt_from_params() -> None:
    model = gpt_from_params({"d_model": 32, "n_layers": 3, "n_heads": 2, "seq_len": 16}, n_stages=2, seed=0)
    assert model.n_stages == 2
    assert len(model.build_stage(0).blocks) == 2 and len(model.build_stage(1).blocks) == 1
    with pytest.raises(ValueError, match="unknown"):
        gpt_from_params({"width": 3}, n_stages=1, seed=0)


def test_entry_point_loads_example_end_to_end() -> None:
    spec, params = "swarmgrad.peer.model.examples:tiny_mlp", {"d_model": 16, "seq_len": 8}
    model = load_entry_point(spec, params, n_stages=2, seed=3)
    assert isinstance(model, StagedModel) and model.n_stages == 2
    inputs = torch.randint(0, 256, (2, 8))
    targets = torch.randint(0, 256, (2, 8))
    stages = [model.build_stage(s) for s in range(2)]
    x = inputs
    for s, stage in enumerate(stages):
        assert model.input_spec(s, 2) == (tuple(x.shape), x.dtype)
        x = stage(x)
        assert model.output_spec(s, 2) == (tuple(x.shape), x.dtype)
    model.loss_fn(x, targets).backward()
    assert all(p.grad is not None for stage in stages for p in stage.parameters())
    again = load_entry_point(spec, params, 2, 3)
    for a, b in zip(stages[0].parameters(), again.build_stage(0).parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "spec",
    [
        "swarmgrad.peer.model.examples",  # no function
        "swarmgrad.peer.model.examples:",  # empty function
        ":tiny_mlp",  # empty module
        "swarmgrad peer:tiny_mlp",  # not identifiers
        "swarmgrad.no_such_module:f",  # import fails
        "swarmgrad.peer.model.examples:no_such_function",  # missing attribute
        "swarmgrad.peer.model.gpt:math",  # not callable
        "builtins:dict",  # callable with (params, n_stages, seed) but returns a dict
    ],
)
def test_entry_point_bad_specs(spec: str) -> None:
    with pytest.raises(ValueError, match="model.entry_point"):
        load_entry_point(spec, {}, n_stages=1, seed=0)


def test_entry_point_stage_count_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("fake_user_model")
    fake.three_stages = lambda params, n_stages, seed: gpt_from_params({"n_layers": 3}, n_stages=3, seed=seed)
    monkeypatch.setitem(sys.modules, "fake_user_model", fake)
    assert load_entry_point("fake_user_model:three_stages", {}, n_stages=3, seed=0).n_stages == 3
    with pytest.raises(ValueError, match="model.entry_point.*3 stages"):
        load_entry_point("fake_user_model:three_stages", {}, n_stages=2, seed=0)


def test_few_steps_of_training_reduce_loss() -> None:
    """A real check that the model learns: 30 AdamW steps on repetitive text."""
    cfg = GPTConfig(d_model=32, n_layers=1, n_heads=2, seq_len=32)
    text = b"def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n\n" * 40
    data = torch.tensor(list(text), dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    (model,) = build_gpt_stages(cfg, [1], seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        starts = torch.randint(0, len(data) - cfg.seq_len - 1, (8, 1), generator=gen)
        chunk = data[starts + torch.arange(cfg.seq_len + 1)]
        loss = gpt_loss(model(chunk[:, :-1]), chunk[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(5.55, abs=0.3)  # ~ln(256): uniform at init
    assert sum(losses[-5:]) / 5 < losses[0] - 2.0, losses
