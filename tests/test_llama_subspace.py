"""boundary_subspace: the stage boundary is exact (split = the multiplied-out whole model, forward
and backward), the specs and the manifest's checks, the HF export."""
from __future__ import annotations

import json

import pytest
import torch

from swarmgrad.peer.manifest import ManifestError, loads
from swarmgrad.peer.model import from_manifest
from swarmgrad.peer.model.entry import decoder_staged_model
from swarmgrad.peer.model.llama import LlamaConfig, build_llama_stage, llama_staged_model, rotary_tables
from swarmgrad.peer.model.subspace import TokenCarry, dense_tensors, frozen_embedding, subspace_basis

K = 6
CFG = LlamaConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, seq_len=12, ffn_hidden=48,
                  boundary_subspace=K)
DENSE = LlamaConfig(**{**CFG.__dict__, "boundary_subspace": 0})
SEED = 7


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> bool:
    return float((a - b).abs().max()) <= rel * max(float(b.abs().max()), 1e-12)


def _batch(batch: int = 3):
    gen = torch.Generator().manual_seed(1)
    window = torch.randint(0, CFG.vocab_size, (batch, CFG.seq_len + 1), generator=gen)
    return window[:, :-1], window[:, 1:]


def _pipeline(split, tokens, targets):
    """The stages as the swarm runs them: z crosses each boundary with the carried targets,
    each receiver's input is a leaf, the gradient sent back is TokenCarry.input_grad of its grad."""
    model = llama_staged_model(CFG, split, SEED)
    carry = model.token_carry
    stages = [model.build_stage(s) for s in range(len(split))]
    sent = carry.wire_targets(tokens, targets)
    outs, ins = [], []
    x = tokens
    for s, stage in enumerate(stages):
        if s > 0:
            x = carry.stage_input(outs[-1].detach(), sent).requires_grad_(True)
            ins.append(x)
        outs.append(stage(x))
    loss = model.loss_fn(outs[-1], sent)
    loss.backward()
    for s in range(len(stages) - 2, -1, -1):
        outs[s].backward(carry.input_grad(ins[s].grad))
    grads = {n: p.grad for st in stages for n, p in st.named_parameters()}
    params = {n: p.detach() for st in stages for n, p in st.named_parameters()}
    return outs, params, grads


def _dense(params):
    whole = build_llama_stage(DENSE, [DENSE.n_layers], 0, seed=0)
    whole.load_state_dict(dense_tensors(params, SEED, CFG.vocab_size, CFG.d_model, K))
    return whole


@pytest.mark.parametrize("split", [[2, 2], [1, 3], [1, 1, 2], [1, 1, 1, 1]])
def test_the_split_subspace_model_equals_its_whole_model_forward_and_backward(split):
    tokens, targets = _batch()
    outs, params, grads = _pipeline(split, tokens, targets)
    for s, out in enumerate(outs[:-1]):
        assert out.shape == (3, CFG.seq_len, K), "only k values per token cross a boundary"
    whole = _dense(params)
    logits = whole(tokens)
    torch.nn.functional.cross_entropy(logits.reshape(-1, CFG.vocab_size), targets.reshape(-1)).backward()
    assert _close(outs[-1].detach(), logits.detach())
    u = subspace_basis(SEED, CFG.d_model, K)
    dense_grads = dict(whole.named_parameters())
    for name, g in grads.items():
        if name == "embed_subspace.weight":
            assert _close(g, dense_grads["embed_tokens.weight"].grad @ u), name
        elif g.shape != dense_grads[name].shape:  # a constrained residual write: U·W multiplied out
            assert _close(g, u.T @ dense_grads[name].grad), name
        else:
            assert _close(g, dense_grads[name].grad), name


def test_the_residual_rebuilt_at_stage_1_is_the_one_stage_0_computed():
    tokens, targets = _batch()
    model = llama_staged_model(CFG, [2, 2], SEED)
    s0, s1 = model.build_stage(0), model.build_stage(1)
    z = s0(tokens)
    x1 = model.token_carry.stage_input(z, model.token_carry.wire_targets(tokens, targets))
    assert torch.equal(x1[..., K].long(), tokens), "the ids arrive exactly"
    rebuilt = torch.nn.functional.embedding(tokens, s1.frozen_embed) + x1[..., :K] @ s1.basis.T
    # stage 0's residual after its layers, in the unconstrained (multiplied-out) model
    params = {n: p.detach() for st in (s0, s1) for n, p in st.named_parameters()}
    whole = _dense(params)
    h = whole.embed_tokens(tokens)
    cos, sin = rotary_tables(DENSE, CFG.seq_len, h.device)
    for key in ("0", "1"):
        h = whole.layers[key](h, cos, sin)
    assert _close(rebuilt.detach(), h.detach())
    # and the parts every stage regenerates from the seed are the same on both
    assert torch.equal(s0.basis, s1.basis) and torch.equal(s0.frozen_embed, s1.frozen_embed)
    assert torch.allclose(s0.basis.T @ s0.basis, torch.eye(K), atol=1e-6)


def test_seeded_parts_are_buffers_not_parameters_and_depend_on_the_seed():
    stage = build_llama_stage(CFG, [2, 2], 0, seed=SEED)
    names = dict(stage.named_parameters())
    assert "embed_subspace.weight" in names and "embed_tokens.weight" not in names
    assert names["layers.0.self_attn.o_proj.weight"].shape == (K, CFG.d_model)
    assert names["layers.1.mlp.down_proj.weight"].shape == (K, CFG.ffn)
    assert not any(n in stage.state_dict() for n in ("basis", "frozen_embed")), "never saved or averaged"
    last = dict(build_llama_stage(CFG, [2, 2], 1, seed=SEED).named_parameters())
    assert last["layers.3.self_attn.o_proj.weight"].shape == (CFG.d_model, CFG.d_model), "the last stage is free"
    assert not torch.equal(subspace_basis(1, 32, K), subspace_basis(2, 32, K))
    assert torch.equal(frozen_embedding(3, 64, 32), frozen_embedding(3, 64, 32))


def test_specs_carry_z_and_the_first_id():
    model = llama_staged_model(CFG, [2, 1, 1], SEED)
    assert model.output_spec(0, 5) == ((5, CFG.seq_len, K), torch.float32)
    assert model.input_spec(1, 5) == ((5, CFG.seq_len, K), torch.float32)
    assert model.output_spec(1, 5) == ((5, CFG.seq_len, K), torch.float32)
    assert model.output_spec(2, 5) == ((5, CFG.seq_len, CFG.vocab_size), torch.float32)
    assert model.targets_spec(5) == ((5, CFG.seq_len + 1), torch.int64)
    assert isinstance(model.token_carry, TokenCarry)
    plain = decoder_staged_model(2, 8, 16, 32, lambda s: None)
    assert plain.token_carry is None and plain.targets_spec(2) == ((2, 8), torch.int64)


BASE = """
run_id = "sub"
[model]
kind = "llama"
d_model = 64
n_layers = 2
n_heads = 4
{extra}
[stages]
count = {count}
"""


def test_manifest_builds_a_subspace_model():
    m = loads(BASE.format(extra="boundary_subspace = 8", count=2))
    assert m.model.boundary_subspace == 8
    model = from_manifest(m)
    assert model.input_spec(1, 2) == ((2, 128, 8), torch.float32)


@pytest.mark.parametrize("extra,count,says", [
    ("boundary_subspace = 64", 2, "below model.d_model"),
    ("boundary_subspace = -1", 2, "must be 0 (off)"),
    ("boundary_subspace = 8", 1, "stages.count >= 2"),
    ("boundary_subspace = 8\ntie_embeddings = true", 1, "stages.count >= 2"),
    ("boundary_subspace = 8\ninit_from = \"ckpt\"", 2, "init_from"),
])
def test_manifest_refuses(extra, count, says):
    with pytest.raises(ManifestError, match="model.boundary_subspace") as e:
        loads(BASE.format(extra=extra, count=count))
    assert says in str(e.value)


def test_boundary_subspace_is_llama_only():
    with pytest.raises(ManifestError, match="model.boundary_subspace is only used with model.kind"):
        loads('run_id = "g"\n[model]\nboundary_subspace = 8\n[stages]\ncount = 2\n')


def _carried_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """The swarm's stages chained as the pipeline runs them (TokenCarry at each boundary)."""
    targets = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)  # the next ids (the last one made up)
    sent = model.token_carry.wire_targets(tokens, targets)
    with torch.no_grad():
        x = model.build_stage(0)(tokens)
        for s in range(1, model.n_stages):
            x = model.build_stage(s)(model.token_carry.stage_input(x, sent))
    return x


def test_hf_export_multiplies_the_subspace_out_and_loads_with_equal_logits(tmp_path, capsys):
    transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
    from swarmgrad.peer.cli.main import main
    from swarmgrad.peer.manifest import dumps
    from swarmgrad.peer.state.stage_state import StageState
    m = loads(BASE.format(extra="boundary_subspace = 8\nn_kv_heads = 2\nseq_len = 16\nffn_hidden = 40", count=2)
              .replace('run_id = "sub"', 'run_id = "sub"\nseed = 3'))
    (tmp_path / "run.toml").write_text(dumps(m))
    model = from_manifest(m)
    for s in range(2):
        state = StageState(model.build_stage(s), m.outer)
        state.commit(1)
        state.save(tmp_path / "save" / f"stage{s}-peer{s}.safetensors", {"stage": str(s), "peer": f"peer{s}"})
    out = tmp_path / "hf"
    assert main(["export", "--format", "hf", "--manifest", str(tmp_path / "run.toml"), "--save-dir",
                 str(tmp_path / "save"), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_size"] == 64 and config["architectures"] == ["LlamaForCausalLM"]
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager")(
            tokens).logits
    assert _close(_carried_logits(model, tokens), theirs, 1e-4)


def test_hf_export_of_a_subspace_model_needs_the_seed(tmp_path):
    from swarmgrad.peer.model.hf import write_hf_folder
    stages = [build_llama_stage(CFG, [2, 2], s, seed=SEED) for s in range(2)]
    tensors = {n: p.detach() for st in stages for n, p in st.named_parameters()}
    with pytest.raises(ValueError, match="needs the run's seed"):
        write_hf_folder(tmp_path / "hf", CFG, tensors)


@pytest.mark.timeout(120)
def test_a_round_of_two_peers_with_a_subspace_boundary_equals_one_whole_model_step(inprocess, tmp_path) -> None:
    """Through the real pipeline (driver, stage server, message validation of the [B, T, k] activations
    and the [B, T+1] carried targets, z's gradient back): one round with H = 1, outer lr 1 and no
    momentum equals one AdamW step of the stages chained in this process."""
    from swarmgrad.peer.data import MicrobatchStream, load_corpora

    from support.swarm import exact_round_manifest, one_saved_round, saved_round

    m = exact_round_manifest(tmp_path, model={"kind": "llama", "d_model": 32, "n_layers": 2, "n_heads": 4,
                                              "n_kv_heads": 2, "seq_len": 32, "boundary_subspace": 4})
    saves = inprocess(lambda: one_saved_round(m, tmp_path, 99))

    model = from_manifest(m)
    carry = model.token_carry
    stages = [model.build_stage(s) for s in range(model.n_stages)]
    train, _ = load_corpora(m.data.source, m.data.paths, m.data.val_fraction, None)
    stream = MicrobatchStream(train, m.model.seq_len, m.inner.microbatch_size, 99)
    batches = [stream.draw(n) for n in m.inner.step_sizes]
    opt = torch.optim.AdamW([p for s in stages for p in s.parameters()], lr=m.inner.lr, betas=m.inner.betas,
                            weight_decay=m.inner.weight_decay)
    loss = 0.0
    for x, y in batches:
        sent = carry.wire_targets(x, y)
        loss = loss + model.loss_fn(stages[1](carry.stage_input(stages[0](x), sent)), sent)
    (loss / len(batches)).backward()
    opt.step()
    for s, stage in enumerate(stages):
        params = saved_round(saves[s], s)
        assert not any(n in params for n in ("basis", "frozen_embed")), "the seeded parts are not saved"
        fresh = dict(model.build_stage(s).named_parameters())
        assert any(not torch.equal(params[n], fresh[n].detach()) for n in params)
        for name, p in stage.named_parameters():
            torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda msg: f"stage {s} {name}: {msg}")


def test_the_placement_bench_builds_a_receiving_stages_input():
    from swarmgrad.peer.placement.bench import bench_stage
    model = llama_staged_model(CFG, [2, 1, 1], SEED)
    for stage in range(3):
        assert bench_stage(model, stage, 2, torch.device("cpu"), CFG.vocab_size) > 0


def test_activation_checkpointing_covers_the_constrained_layers_and_keeps_gradients():
    from swarmgrad.peer.compute.precision import enable_activation_checkpointing
    tokens, targets = _batch()
    plain = build_llama_stage(CFG, [2, 2], 0, seed=SEED)
    ckpt = build_llama_stage(CFG, [2, 2], 0, seed=SEED)
    assert enable_activation_checkpointing(ckpt) == 2
    for stage in (plain, ckpt):
        stage(tokens).square().mean().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_the_placement_estimate_counts_the_constrained_stages_parameters():
    from swarmgrad.peer.manifest import load
    from swarmgrad.peer.placement.cost import stage_costs
    from pathlib import Path
    m = load(Path(__file__).resolve().parent.parent / "examples" / "llama-cpu.toml").replace(
        model={"boundary_subspace": 16})
    model = from_manifest(m)
    built = [sum(p.numel() for p in model.build_stage(s).parameters()) for s in range(2)]
    assert [c.params for c in stage_costs(m)] == built
