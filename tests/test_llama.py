"""The llama kind: staged = unstaged for every split, the manifest's checks, the placement estimate."""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from swarmgrad.peer.manifest import ManifestError, load, loads
from swarmgrad.peer.model import from_manifest
from swarmgrad.peer.model.llama import LlamaConfig, build_llama_stage, hf_name, swarm_name
from swarmgrad.peer.placement.cost import stage_costs

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CFG = LlamaConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, seq_len=12, ffn_hidden=48)


def _compositions(n: int):
    """Every split of n layers into contiguous stages of >= 1 layer."""
    for cuts in range(n):
        for where in itertools.combinations(range(1, n), cuts):
            bounds = (0, *where, n)
            yield [b - a for a, b in zip(bounds, bounds[1:])]


def _run(stages, tokens, targets):
    x = tokens
    for s in stages:
        x = s(x)
    loss = torch.nn.functional.cross_entropy(x.reshape(-1, x.shape[-1]), targets.reshape(-1))
    loss.backward()
    grads = {n: p.grad for s in stages for n, p in s.named_parameters()}
    return x.detach(), grads


def _close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    return float((a - b).abs().max()) <= rel * max(float(b.abs().max()), 1e-12)


def test_every_split_equals_the_whole_model_forward_and_backward():
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CFG.vocab_size, (3, CFG.seq_len), generator=gen)
    targets = torch.randint(0, CFG.vocab_size, (3, CFG.seq_len), generator=gen)
    whole = [build_llama_stage(CFG, [CFG.n_layers], 0, seed=7)]
    ref_logits, ref_grads = _run(whole, tokens, targets)
    splits = list(_compositions(CFG.n_layers))
    assert len(splits) == 8
    for split in splits:
        stages = [build_llama_stage(CFG, split, s, seed=7) for s in range(len(split))]
        logits, grads = _run(stages, tokens, targets)
        assert _close(logits, ref_logits, 1e-5), split
        assert set(grads) == set(ref_grads), split
        for name, g in grads.items():
            assert _close(g, ref_grads[name], 1e-5), (split, name)


def test_names_are_hugging_faces_with_global_layer_indices():
    stage = build_llama_stage(CFG, [2, 2], 1, seed=0)
    names = [n for n, _ in stage.named_parameters()]
    assert "layers.2.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    assert hf_name("layers.3.mlp.down_proj.weight") == "model.layers.3.mlp.down_proj.weight"
    assert hf_name("lm_head.weight") == "lm_head.weight"
    assert all(swarm_name(hf_name(n)) == n for n in names)
    first = build_llama_stage(CFG, [2, 2], 0, seed=0)
    assert {n.split(".")[0] for n, _ in first.named_parameters()} == {"embed_tokens", "layers"}


def test_initialisation_is_deterministic_and_independent_of_the_split():
    a = dict(build_llama_stage(CFG, [1, 3], 1, seed=3).named_parameters())
    b = dict(build_llama_stage(CFG, [3, 1], 0, seed=3).named_parameters())
    for name in ("layers.1.self_attn.k_proj.weight", "layers.2.mlp.gate_proj.weight"):
        assert torch.equal(a[name], b[name])
    other = dict(build_llama_stage(CFG, [1, 3], 1, seed=4).named_parameters())
    assert not torch.equal(a["layers.1.self_attn.k_proj.weight"], other["layers.1.self_attn.k_proj.weight"])


def test_tied_embeddings_one_stage():
    cfg = LlamaConfig(**{**CFG.__dict__, "tie_embeddings": True})
    stage = build_llama_stage(cfg, [4], 0, seed=0)
    assert "lm_head.weight" not in dict(stage.named_parameters())
    logits = stage(torch.zeros(1, 4, dtype=torch.int64))
    assert logits.shape == (1, 4, cfg.vocab_size)
    with pytest.raises(ValueError, match="tie_embeddings"):
        build_llama_stage(cfg, [2, 2], 0, seed=0)


LLAMA = """
run_id = "t"
[model]
kind = "llama"
vocab_size = 256
d_model = 32
n_layers = 4
n_heads = 4
n_kv_heads = 2
seq_len = 16
{extra}
[stages]
count = {count}
"""


def _manifest(extra: str = "", count: int = 2):
    text = LLAMA.format(extra="", count=count)
    for line in filter(None, extra.splitlines()):
        key = line.split("=")[0].strip()
        kept = [x for x in text.splitlines() if x.split("=")[0].strip() != key]
        text = "\n".join(kept).replace("[stages]", line + "\n[stages]")
    return loads(text)


def test_manifest_loads_and_builds():
    m = _manifest("ffn_hidden = 48\nrope_theta = 500000.0\nnorm_eps = 1e-6")
    assert (m.model.kind, m.model.n_kv_heads, m.model.ffn_hidden, m.model.rope_theta) == ("llama", 2, 48, 500000.0)
    model = from_manifest(m)
    assert model.n_stages == 2
    assert model.output_spec(1, 3) == ((3, 16, 256), torch.float32)
    assert model.input_spec(1, 3) == ((3, 16, 32), torch.float32)


@pytest.mark.parametrize("extra,count,field", [
    ("tie_embeddings = true", 2, "model.tie_embeddings"),
    ("n_kv_heads = 3", 2, "model.n_kv_heads"),
    ("n_kv_heads = -1", 2, "model.n_kv_heads"),
    ("ffn_hidden = -5", 2, "model.ffn_hidden"),
    ("rope_theta = 0.0", 2, "model.rope_theta"),
    ("norm_eps = 0.0", 2, "model.norm_eps"),
    ("entry_point = \"a.b:c\"", 2, "model.entry_point"),
    ("", 5, "stages.count"),
])
def test_manifest_refuses(extra, count, field):
    with pytest.raises(ManifestError, match=field.replace(".", r"\.")):
        _manifest(extra, count)


def test_manifest_refuses_odd_head_dim_small_vocab_and_llama_fields_elsewhere():
    with pytest.raises(ManifestError, match=r"model\.n_heads.*even"):
        loads(LLAMA.format(extra="", count=1).replace("n_heads = 4", "n_heads = 32").replace("n_kv_heads = 2", ""))
    with pytest.raises(ManifestError, match=r"model\.vocab_size"):
        loads(LLAMA.format(extra="", count=1).replace("vocab_size = 256", "vocab_size = 100"))
    with pytest.raises(ManifestError, match=r"model\.n_kv_heads.*only used with model\.kind = \"llama\""):
        loads('run_id = "t"\n[model]\nkind = "gpt"\nn_kv_heads = 2\n')


def test_tied_refusal_says_why():
    with pytest.raises(ManifestError) as e:
        _manifest("tie_embeddings = true", 2)
    assert "drift apart" in str(e.value) and "stages.count = 1" in str(e.value)
    assert _manifest("tie_embeddings = true", 1).model.tie_embeddings


@pytest.mark.parametrize("name", ["llama-cpu", "llama-125m", "llama-350m", "llama-1b"])
def test_presets_load_and_the_estimate_counts_their_parameters(name):
    m = load(EXAMPLES / f"{name}.toml")
    costs = stage_costs(m)
    total = sum(c.params for c in costs)
    expected = {"llama-cpu": 4.9e6, "llama-125m": 124.7e6, "llama-350m": 349e6, "llama-1b": 1.10e9}[name]
    assert abs(total - expected) / expected < 0.01, total
    for c in costs:
        assert c.method == "flops" and c.memory_bytes > 8 * 4 * c.params  # at least the fp32 copies


def test_estimate_matches_the_built_stages():
    m = _manifest("ffn_hidden = 48", count=2)
    model = from_manifest(m)
    for c in stage_costs(m):
        assert c.params == sum(p.numel() for p in model.build_stage(c.stage).parameters())
    m = _manifest("tie_embeddings = true", count=1)
    assert stage_costs(m)[0].params == sum(p.numel() for p in from_manifest(m).build_stage(0).parameters())


def test_generate_without_transformers_names_the_extra(monkeypatch, capsys, tmp_path):
    import sys

    from swarmgrad.peer.cli.main import main
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails as if not installed
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x"]) == 2
    assert "pip install 'swarmgrad[hf]'" in capsys.readouterr().err


def test_activation_checkpointing_finds_the_llama_layers_and_keeps_gradients():
    from swarmgrad.peer.compute.precision import enable_activation_checkpointing
    plain, ckpt = (build_llama_stage(CFG, [3, 1], 0, seed=2) for _ in range(2))
    assert enable_activation_checkpointing(ckpt) == 3
    assert list(plain.state_dict()) == list(ckpt.state_dict())
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=torch.Generator().manual_seed(3))
    for module in (plain, ckpt):
        module(x).square().mean().backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_bfloat16_autocast_runs_a_llama_stage():
    stage = build_llama_stage(CFG, [4], 0, seed=0)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = stage(x)
    out.float().mean().backward()
    assert all(p.dtype == torch.float32 and p.grad is not None for p in stage.parameters())
    with torch.no_grad():
        assert float((out.float() - stage(x)).abs().max()) < 0.1 * float(stage(x).abs().max()) + 0.1
