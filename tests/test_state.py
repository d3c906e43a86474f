"""Stage state: digests, pseudo-gradients, the outer step, bit-identical replicas, load and checkpoints."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from swarmgrad.peer.manifest import OuterOptConfig
from swarmgrad.peer.state.stage_state import StageState, load_checkpoint, state_digest

NESTEROV = OuterOptConfig(lr=0.7, momentum=0.9, nesterov=True)
PLAIN = OuterOptConfig(lr=1.0, momentum=0.0, nesterov=False)


def make_module(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    g = torch.Generator().manual_seed(seed)
    module = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3)).to(dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=dtype))
    return module


def deltas(state: StageState, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    return {n: torch.randn(state.shapes[n], generator=g) * 0.01 for n in state.names}


def inner_training(module: nn.Module, seed: int) -> None:
    """Stand-in for local AdamW steps: move θ_local a little."""
    g = torch.Generator().manual_seed(500 + seed)
    with torch.no_grad():
        for p in module.parameters():
            p.sub_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def assert_states_identical(a: StageState, b: StageState) -> None:
    assert a.names == b.names
    for n in a.names:
        assert torch.equal(a.params[n], b.params[n]), n
    ma, mb = a.momentum(), b.momentum()
    assert ma.keys() == mb.keys()
    for n in ma:
        assert torch.equal(ma[n], mb[n]), n


# --------------------------------------------------------------------------- construction, digest


def test_state_copies_module_as_fp32_cpu() -> None:
    module = make_module(dtype=torch.float64)
    state = StageState(module, NESTEROV)
    assert state.names == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert state.shapes == {"0.weight": (5, 4), "0.bias": (5,), "1.weight": (3, 5), "1.bias": (3,)}
    for n, p in module.named_parameters():
        assert state.params[n].dtype == torch.float32 and state.params[n].device.type == "cpu"
        assert torch.equal(state.params[n], p.detach().float())
        assert state.params[n].data_ptr() != p.data_ptr()
    assert state.snapshot.round == 0 and state.applied_rounds == 0 and state.trained_samples == 0
    assert state.momentum() == {}
    assert re.fullmatch(r"[0-9a-f]{24}", state.digest)
    assert state.snapshot is not None and state.snapshot.digest == state.digest


def test_digest_equal_for_equal_states_and_differs_for_other_init() -> None:
    a, b = StageState(make_module(0), NESTEROV), StageState(make_module(0), NESTEROV)
    assert a.digest == b.digest
    assert StageState(make_module(1), NESTEROV).digest != a.digest
    # the digest is of the state, not of the optimiser settings
    assert StageState(make_module(0), PLAIN).digest == a.digest


def test_digest_changes_with_one_param_value() -> None:
    state = StageState(make_module(), NESTEROV)
    before = state.digest
    original = state.params["1.bias"].detach().clone()
    with torch.no_grad():
        state.params["1.bias"][2] += 1e-6
    assert state.digest == before  # not recomputed until commit
    state.commit(0)
    assert state.digest != before
    with torch.no_grad():
        state.params["1.bias"].copy_(original)
    state.commit(0)
    assert state.digest == before  # same bits, same digest


def test_digest_covers_momentum() -> None:
    state = StageState(make_module(), NESTEROV)
    without = state.digest
    state.apply_outer(deltas(state, 0))
    state.commit(0)
    params = {n: p.detach().clone() for n, p in state.params.items()}
    momentum = {n: m.clone() for n, m in state.momentum().items()}
    assert momentum.keys() == set(state.names)
    assert state.digest == state_digest(params, momentum)
    assert state.digest != state_digest(params, {})  # same θ, no momentum: another state
    bumped = {**momentum, "0.bias": momentum["0.bias"].clone()}
    bumped["0.bias"][0] += 1e-7
    assert state_digest(params, bumped) != state.digest
    assert without != state.digest


def test_state_digest_is_sensitive_to_names_shapes_and_section() -> None:
    t = torch.arange(6, dtype=torch.float32)
    base = state_digest({"a": t}, {})
    assert state_digest({"a": t.clone()}, {}) == base
    assert state_digest({"b": t}, {}) != base
    assert state_digest({"a": t.reshape(2, 3)}, {}) != base
    assert state_digest({}, {"a": t}) != base
    assert state_digest({"a": t[:3], "b": t[3:]}, {}) == state_digest({"b": t[3:], "a": t[:3]}, {})
    assert state_digest({"a": t[:3], "b": t[3:]}, {}) != state_digest({"a": t[:2], "b": t[2:]}, {})


# --------------------------------------------------------------------------- pseudo-gradient, outer step


def test_pseudo_gradient_is_global_minus_local() -> None:
    module = make_module()
    state = StageState(module, NESTEROV)
    inner_training(module, 0)
    delta = state.pseudo_gradient(module)
    assert delta.keys() == set(state.names)
    for n, p in module.named_parameters():
        assert delta[n].dtype == torch.float32 and not delta[n].requires_grad
        assert torch.equal(delta[n], state.params[n].detach() - p.detach())
        assert float(delta[n].abs().max()) > 0


def test_pseudo_gradient_of_untrained_module_is_zero() -> None:
    module = make_module()
    state = StageState(module, NESTEROV)
    for n, d in state.pseudo_gradient(module).items():
        assert torch.equal(d, torch.zeros(state.shapes[n])), n


def test_outer_step_with_lr_1_and_no_momentum_adopts_local() -> None:
    module = make_module()
    state = StageState(module, PLAIN)
    initial = {n: p.detach().clone() for n, p in state.params.items()}
    inner_training(module, 0)
    state.apply_outer(state.pseudo_gradient(module))
    assert state.applied_rounds == 1
    assert state.momentum() == {}
    for n, p in module.named_parameters():
        assert torch.allclose(state.params[n], p.detach(), rtol=0, atol=1e-6), n
        assert not torch.equal(state.params[n], initial[n])
        assert state.params[n].grad is None


def test_nesterov_step_matches_reference() -> None:
    state = StageState(make_module(), NESTEROV)
    theta = {n: p.detach().double().clone() for n, p in state.params.items()}
    velocity: dict[str, torch.Tensor] = {}
    lr, mu = NESTEROV.lr, NESTEROV.momentum
    for step in range(4):
        d = deltas(state, step)
        state.apply_outer(d)
        for n in state.names:
            g = d[n].double()
            velocity[n] = g.clone() if n not in velocity else mu * velocity[n] + g
            theta[n] -= lr * (g + mu * velocity[n])
    assert state.applied_rounds == 4
    for n in state.names:
        assert torch.allclose(state.params[n].double(), theta[n], rtol=0, atol=1e-6), n
        assert torch.allclose(state.momentum()[n].double(), velocity[n], rtol=0, atol=1e-6), n


def test_replicas_fed_identical_inputs_stay_bit_identical() -> None:
    a, b = StageState(make_module(), NESTEROV), StageState(make_module(), NESTEROV)
    digests = {a.digest}
    for step in range(6):
        d = deltas(a, step)
        a.apply_outer(d)
        b.apply_outer({n: t.clone() for n, t in d.items()})
        a.commit(step + 1)
        b.commit(step + 1)
        assert_states_identical(a, b)
        assert a.digest == b.digest
        digests.add(a.digest)
    assert len(digests) == 7  # every round produced a new state
    assert a.applied_rounds == b.applied_rounds == 6


def test_snapshot_is_frozen_until_commit() -> None:
    state = StageState(make_module(), NESTEROV)
    state.apply_outer(deltas(state, 0))
    state.commit(1)
    snap = state.snapshot
    assert snap is not None and (snap.round, snap.applied_rounds) == (1, 1)
    frozen = {n: t.clone() for n, t in snap.params.items()}
    state.apply_outer(deltas(state, 1))
    for n in state.names:
        assert torch.equal(snap.params[n], frozen[n])
        assert snap.params[n].data_ptr() != state.params[n].data_ptr()
    assert state_digest(snap.params, snap.momentum) == snap.digest
    assert state.snapshot is snap  # apply_outer does not commit
    state.commit(1)
    assert state.snapshot is not snap and state.snapshot.digest != snap.digest


def test_copy_to_writes_global_into_module() -> None:
    module = make_module()
    state = StageState(module, NESTEROV)
    state.apply_outer(deltas(state, 0))
    other = make_module(seed=5, dtype=torch.float64)
    state.copy_to(other)
    for n, p in other.named_parameters():
        assert p.dtype == torch.float64
        assert torch.equal(p.detach(), state.params[n].detach().double())


# --------------------------------------------------------------------------- load


def trained(seed: int = 0, steps: int = 3) -> StageState:
    state = StageState(make_module(seed), NESTEROV)
    for step in range(steps):
        state.apply_outer(deltas(state, step))
    state.commit(steps + 2)
    return state


def test_load_reproduces_digest_and_continues_identically() -> None:
    donor = trained()
    joiner = StageState(make_module(seed=9), NESTEROV)
    assert joiner.digest != donor.digest
    snap = donor.snapshot
    assert snap is not None
    joiner.load(snap.params, snap.momentum, snap.round, snap.applied_rounds)
    assert joiner.digest == donor.digest
    assert (joiner.snapshot.round, joiner.applied_rounds) == (5, 3)
    assert_states_identical(joiner, donor)
    for step in range(3, 6):
        d = deltas(donor, step)
        donor.apply_outer(d)
        joiner.apply_outer(d)
        donor.commit(step + 1)
        joiner.commit(step + 1)
        assert_states_identical(joiner, donor)
        assert joiner.digest == donor.digest


def test_load_copies_rather_than_aliases() -> None:
    donor = trained()
    joiner = StageState(make_module(seed=9), NESTEROV)
    snap = donor.snapshot
    assert snap is not None
    joiner.load(snap.params, snap.momentum, snap.round, snap.applied_rounds)
    joiner.apply_outer(deltas(joiner, 7))
    assert state_digest(snap.params, snap.momentum) == snap.digest  # the donor's snapshot is untouched
    for n in joiner.names:
        assert joiner.momentum()[n].data_ptr() != snap.momentum[n].data_ptr()


def test_load_without_momentum_drops_local_momentum() -> None:
    donor = StageState(make_module(seed=3), NESTEROV)
    joiner = trained()
    joiner.load(donor.snapshot.params, donor.snapshot.momentum, 0, 0)
    assert joiner.momentum() == {}
    assert joiner.digest == donor.digest
    d = deltas(donor, 0)
    donor.apply_outer(d)
    joiner.apply_outer(d)
    assert_states_identical(joiner, donor)


# --------------------------------------------------------------------------- checkpoints


def test_save_and_load_checkpoint_round_trip(tmp_path: Path) -> None:
    state = trained()
    path = tmp_path / "nested" / "dir" / "stage1.safetensors"
    state.save(path, extra={"peer": "QmX", "stage": "1"})
    assert path.exists()
    params, momentum, meta = load_checkpoint(path)
    assert meta == {"round": "5", "applied_rounds": "3", "digest": state.digest, "peer": "QmX", "stage": "1",
                    "trained_samples": "0"}
    assert params.keys() == momentum.keys() == set(state.names)
    for n in state.names:
        assert torch.equal(params[n], state.params[n].detach())
        assert torch.equal(momentum[n], state.momentum()[n])
    assert state_digest(params, momentum) == meta["digest"]
    restored = StageState(make_module(seed=4), NESTEROV)
    restored.load(params, momentum, int(meta["round"]), int(meta["applied_rounds"]))
    assert restored.digest == state.digest
    d = deltas(state, 10)
    state.apply_outer(d)
    restored.apply_outer(d)
    assert_states_identical(restored, state)


def test_checkpoint_is_the_committed_snapshot(tmp_path: Path) -> None:
    state = StageState(make_module(), NESTEROV)
    committed = state.digest
    state.apply_outer(deltas(state, 0))  # not committed
    path = tmp_path / "s.safetensors"
    state.save(path)
    params, momentum, meta = load_checkpoint(path)
    assert momentum == {}
    assert meta == {"round": "0", "applied_rounds": "0", "digest": committed, "trained_samples": "0"}
    assert state_digest(params, momentum) == committed


def test_load_checkpoint_missing_file(tmp_path: Path) -> None:
    with pytest.raises((FileNotFoundError, OSError)):
        load_checkpoint(tmp_path / "absent.safetensors")


def test_trained_samples_are_agreed_state() -> None:
    """The schedule's position is part of what replicas agree on: it enters the digest, travels
    with a snapshot and survives a load, so a joiner resumes the lr curve where the swarm is."""
    a, b = StageState(make_module(), NESTEROV), StageState(make_module(), NESTEROV)
    d = deltas(a, 0)
    a.apply_outer(d, total_weight=64.0)
    b.apply_outer({n: t.clone() for n, t in d.items()}, total_weight=32.0)
    a.commit(1)
    b.commit(1)
    assert a.trained_samples == 64 and b.trained_samples == 32
    assert a.digest != b.digest  # same θ, different positions: not the same state
    joiner = StageState(make_module(seed=9), NESTEROV)
    snap = a.snapshot
    joiner.load(snap.params, snap.momentum, snap.round, snap.applied_rounds, snap.trained_samples)
    assert joiner.trained_samples == 64 and joiner.digest == a.digest


def test_outer_lr_multiplier_scales_the_outer_step() -> None:
    plain = StageState(make_module(), PLAIN)
    half = StageState(make_module(), PLAIN)
    d = deltas(plain, 0)
    plain.apply_outer(d)
    half.apply_outer({n: t.clone() for n, t in d.items()}, lr_multiplier=0.5)
    start = StageState(make_module(), PLAIN)
    for n in plain.names:
        moved_plain = plain.params[n].detach() - start.params[n].detach()
        moved_half = half.params[n].detach() - start.params[n].detach()
        assert torch.allclose(moved_half, moved_plain * 0.5, atol=1e-7)
