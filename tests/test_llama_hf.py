"""The llama kind against Hugging Face: equal logits with transformers' LlamaForCausalLM, export
(`swarmgrad export --format hf`, from a coordinator's state dir and from peers' save dirs) loaded
by from_pretrained with equal logits, `model.init_from` with equal logits, `swarmgrad generate`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from swarmgrad.peer.cli.main import main
from swarmgrad.peer.manifest import ManifestError, dumps, loads
from swarmgrad.peer.model import from_manifest
from swarmgrad.peer.model.hf import HFCheckpointError, byte_tokenizer_json, hf_config, write_hf_folder
from swarmgrad.peer.model.llama import LlamaConfig, build_llama_stage, hf_name

transformers = pytest.importorskip("transformers", reason="the hf extra (pip install 'swarmgrad[hf]') is not installed")

MANIFEST = """
run_id = "hf-test"
seed = 5
[model]
kind = "llama"
vocab_size = 300
d_model = 32
n_layers = 3
n_heads = 4
n_kv_heads = 2
seq_len = 16
ffn_hidden = 40
rope_theta = 5000.0
norm_eps = 1e-6
{extra}
[stages]
count = {count}
[outer]
lr = 0.7
"""


def _manifest(count: int = 2, extra: str = ""):
    return loads(MANIFEST.format(count=count, extra=extra))


def _tokens(m, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 256, (batch, m.model.seq_len), generator=torch.Generator().manual_seed(0))


def _swarm_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    x = tokens
    with torch.no_grad():
        for s in range(model.n_stages):
            x = model.build_stage(s)(x)
    return x


def _hf_model(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager").eval()


def _close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    return float((a - b).abs().max()) <= rel * float(b.abs().max())


@pytest.mark.parametrize("tied", [False, True])
def test_logits_equal_transformers_llama_with_the_same_weights(tied):
    cfg = LlamaConfig(vocab_size=70, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2, seq_len=10,
                      rope_theta=500000.0, norm_eps=1e-6, tie_embeddings=tied)
    stage = build_llama_stage(cfg, [2], 0, seed=1)
    config = transformers.LlamaConfig(**{k: v for k, v in hf_config(cfg).items() if k not in ("architectures",)})
    hf = transformers.LlamaForCausalLM(config).eval()
    state = {hf_name(n): p for n, p in stage.named_parameters()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if tied else set())
    tokens = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours, theirs = stage(tokens), hf(tokens).logits
    assert _close(ours, theirs, 1e-5)


def _save_dirs(tmp: Path, m, round_no: int = 3) -> list[Path]:
    """Peers' --save-dir files of every stage (two replicas of stage 0, one of them a round behind)."""
    from swarmgrad.peer.state.stage_state import StageState
    model = from_manifest(m)
    dirs = []
    for s in range(m.stages.count):
        d = tmp / f"peer{s}"
        state = StageState(model.build_stage(s), m.outer)
        state.commit(round_no)
        state.save(d / f"stage{s}-abcdefg{s}.safetensors", {"stage": str(s), "peer": f"peer{s}"})
        if s == 0:
            state.commit(round_no - 1)
            state.save(d / "stage0-zzzzzzzz.safetensors", {"stage": "0", "peer": "late"})
        dirs.append(d)
    return dirs


def test_export_from_save_dirs_loads_in_transformers_with_equal_logits(tmp_path, capsys):
    m = _manifest(count=2)
    (tmp_path / "run.toml").write_text(dumps(m))
    dirs = _save_dirs(tmp_path, m)
    out = tmp_path / "hf"
    assert main(["export", "--format", "hf", "--manifest", str(tmp_path / "run.toml"), "--save-dir",
                 *map(str, dirs), "--out", str(out)]) == 0
    assert "round 3" in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    tokens = _tokens(m)
    with torch.no_grad():
        theirs = _hf_model(out)(tokens).logits
    assert _close(_swarm_logits(from_manifest(m), tokens), theirs, 1e-4)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "héllo, swarm"
    assert tok(text).input_ids == list(text.encode())
    assert tok.decode(list(text.encode())) == text


def test_export_from_a_coordinators_state_dir(tmp_path, capsys):
    from swarmgrad.peer.coordinator.store import StateDir
    from swarmgrad.peer.state.stage_state import StageState, snapshot_bytes
    m = _manifest(count=3)
    model = from_manifest(m)
    store = StateDir(tmp_path / "state", m.run_id)
    files = {}
    for s in range(3):
        state = StageState(model.build_stage(s), m.outer)
        state.commit(4)
        files[s] = (snapshot_bytes(state.snapshot, {"stage": str(s)}), {"round": 4, "applied_rounds": 0,
                                                                          "trained_samples": 0, "digest": state.digest})
    store.write_checkpoint(4, files, dumps(m), 3)
    out = tmp_path / "hf"
    assert main(["export", "--format", "hf", "--state-dir", str(tmp_path / "state"), "--out", str(out)]) == 0
    assert "round 4" in capsys.readouterr().out
    tokens = _tokens(m)
    with torch.no_grad():
        theirs = _hf_model(out)(tokens).logits
    assert _close(_swarm_logits(model, tokens), theirs, 1e-4)
    # the default format still writes one file
    assert main(["export", "--state-dir", str(tmp_path / "state"), "--out", str(tmp_path / "all.safetensors")]) == 0


def test_export_refusals(tmp_path, capsys):
    m = _manifest(count=2)
    (tmp_path / "run.toml").write_text(dumps(m))
    dirs = _save_dirs(tmp_path, m)
    args = ["export", "--format", "hf", "--out", str(tmp_path / "x")]
    assert main([*args, "--save-dir", str(dirs[0])]) == 2
    assert "--manifest" in capsys.readouterr().err
    assert main([*args, "--manifest", str(tmp_path / "run.toml"), "--save-dir", str(dirs[0])]) == 2
    assert "stage(s) [1]" in capsys.readouterr().err
    (dirs[1] / "stage1-abcdefg1.safetensors").unlink()
    _save_dirs(tmp_path / "later", m, round_no=9)
    assert main([*args, "--manifest", str(tmp_path / "run.toml"), "--save-dir", str(dirs[0]),
                 str(tmp_path / "later" / "peer1")]) == 2
    assert "no round in common" in capsys.readouterr().err
    wider = tmp_path / "wider.toml"
    wider.write_text(dumps(m).replace("ffn_hidden = 40", "ffn_hidden = 48"))
    good = [str(dirs[0]), str(tmp_path / "peer1")]
    _save_dirs(tmp_path, m)
    assert main([*args, "--manifest", str(wider), "--save-dir", *good]) == 2
    assert "is it this run's manifest" in capsys.readouterr().err
    gpt = tmp_path / "gpt.toml"
    gpt.write_text('run_id = "g"\n')
    assert main([*args, "--manifest", str(gpt), "--save-dir", *map(str, dirs)]) == 2


def test_init_from_starts_from_the_checkpoint_with_equal_logits(tmp_path):
    source = _manifest(count=1)
    tensors = {n: p for n, p in from_manifest(source).build_stage(0).named_parameters()}
    write_hf_folder(tmp_path / "ckpt", LlamaConfig(**_llama_fields(source)), tensors)
    # another seed and split: every weight must come from the folder, each stage its own
    m = loads(MANIFEST.format(count=3, extra='init_from = "ckpt"').replace("seed = 5", "seed = 6"))
    model = from_manifest(m, tmp_path)
    tokens = _tokens(m)
    with torch.no_grad():
        theirs = _hf_model(tmp_path / "ckpt")(tokens).logits
    assert _close(_swarm_logits(model, tokens), theirs, 1e-4)
    assert _close(_swarm_logits(from_manifest(source), tokens), theirs, 1e-4)


def test_init_from_refuses_a_checkpoint_of_another_shape(tmp_path):
    source = _manifest(count=1)
    tensors = {n: p for n, p in from_manifest(source).build_stage(0).named_parameters()}
    write_hf_folder(tmp_path / "ckpt", LlamaConfig(**_llama_fields(source)), tensors)
    wider = loads(MANIFEST.format(count=2, extra='init_from = "ckpt"').replace("ffn_hidden = 40", "ffn_hidden = 48"))
    with pytest.raises(HFCheckpointError, match="intermediate_size is 40 but model.ffn_hidden"):
        from_manifest(wider, tmp_path)
    with pytest.raises(HFCheckpointError, match="no config.json"):
        from_manifest(_manifest(count=2, extra='init_from = "nowhere"'), tmp_path)
    # shapes are checked tensor by tensor too
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    from safetensors.torch import load_file, save_file
    weights = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    weights["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(3, 3)
    save_file(weights, str(tmp_path / "ckpt" / "model.safetensors"))
    model = from_manifest(_manifest(count=2, extra='init_from = "ckpt"'), tmp_path)
    with pytest.raises(HFCheckpointError, match="k_proj.weight has shape"):
        model.build_stage(0)
    assert config["model_type"] == "llama"
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0}
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFCheckpointError, match="rope scaling"):
        from_manifest(_manifest(count=2, extra='init_from = "ckpt"'), tmp_path)


def test_init_from_is_only_for_llama():
    with pytest.raises(ManifestError, match=r"model\.init_from"):
        loads('run_id = "g"\n[model]\ninit_from = "x"\n')


def test_generate_prints_a_continuation(tmp_path, capsys):
    m = _manifest(count=1)
    tensors = {n: p for n, p in from_manifest(m).build_stage(0).named_parameters()}
    write_hf_folder(tmp_path / "hf", LlamaConfig(**_llama_fields(m)), tensors)
    assert main(["generate", "--model", str(tmp_path / "hf"), "--prompt", "def ", "--max-new-tokens", "5",
                 "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def ") and len(out.rstrip("\n")) > len("def ")
    assert main(["generate", "--model", str(tmp_path / "nowhere"), "--prompt", "x"]) == 2


def test_byte_tokenizer_ids_are_bytes():
    from tokenizers import Tokenizer
    tok = Tokenizer.from_str(byte_tokenizer_json())
    data = "Ünïcode ☃ and\ttabs\n".encode()
    assert tok.encode(data.decode()).ids == list(data)
    assert tok.decode(list(data)) == data.decode()


def _llama_fields(m) -> dict:
    md = m.model
    return dict(vocab_size=md.vocab_size, d_model=md.d_model, n_layers=md.n_layers, n_heads=md.n_heads,
                n_kv_heads=md.n_kv_heads, seq_len=md.seq_len, ffn_hidden=md.ffn_hidden, rope_theta=md.rope_theta,
                norm_eps=md.norm_eps, tie_embeddings=md.tie_embeddings)


def test_init_from_a_sharded_tied_checkpoint_into_an_untied_split(tmp_path):
    """A tied checkpoint in two shards with an index (as transformers writes big models): each
    stage reads its tensors from whichever shard holds them, the head gets the embedding."""
    from safetensors.torch import save_file
    source = _manifest(count=1, extra="tie_embeddings = true")
    tensors = {hf_name(n): p.detach() for n, p in from_manifest(source).build_stage(0).named_parameters()}
    folder = tmp_path / "ckpt"
    write_hf_folder(folder, LlamaConfig(**_llama_fields(source)), {n: p for n, p in
                                                                   from_manifest(source).build_stage(0).named_parameters()})
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(folder / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    m = _manifest(count=2, extra='init_from = "ckpt"')
    tokens = _tokens(m)
    assert _close(_swarm_logits(from_manifest(m, tmp_path), tokens), _swarm_logits(from_manifest(source), tokens), 1e-5)
    with torch.no_grad():
        theirs = _hf_model(folder)(tokens).logits
    assert _close(_swarm_logits(from_manifest(m, tmp_path), tokens), theirs, 1e-4)
    # the reverse, an untied checkpoint into a tied run, would drop its head: refused
    untied = tmp_path / "untied"
    write_hf_folder(untied, LlamaConfig(**_llama_fields(_manifest(count=1))),
                    dict(from_manifest(_manifest(count=1)).build_stage(0).named_parameters()))
    with pytest.raises(HFCheckpointError, match="tie_word_embeddings"):
        from_manifest(_manifest(count=1, extra='tie_embeddings = true\ninit_from = "untied"'), tmp_path)


def test_a_peer_with_an_init_from_that_does_not_fit_stops_with_one_line(tmp_path, capsys):
    source = _manifest(count=1)
    write_hf_folder(tmp_path / "ckpt", LlamaConfig(**_llama_fields(source)),
                    dict(from_manifest(source).build_stage(0).named_parameters()))
    run = tmp_path / "run" / "run.toml"  # init_from is read from the manifest's folder
    run.parent.mkdir()
    run.write_text(dumps(_manifest(count=2, extra='init_from = "../ckpt"')).replace("ffn_hidden = 40", "ffn_hidden = 64"))
    assert main(["peer", "--manifest", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert "intermediate_size is 40 but model.ffn_hidden gives 64" in err and len(err.splitlines()) == 1


def test_export_with_the_runs_bpe_tokenizer(tmp_path, capsys):
    """A run with data.tokenizer: the export carries that tokenizer, AutoTokenizer encodes as the
    run does, the end-of-document token is bos/eos, and generate runs on it."""
    from swarmgrad.peer.text.tokenizer import load_tokenizer, train_bpe
    texts = [f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(200)]
    trained = train_bpe(texts, 300, tmp_path / "tok.json")
    text = MANIFEST.format(count=2, extra="").replace("vocab_size = 300", f"vocab_size = {trained.vocab_size}")
    text += f'[data]\ntokenizer = "tok.json"\ntokenizer_sha256 = "{trained.sha256}"\n'
    (tmp_path / "run.toml").write_text(text)
    from swarmgrad.peer.manifest import load
    m = load(tmp_path / "run.toml")
    dirs = _save_dirs(tmp_path, m)
    out = tmp_path / "hf"
    assert main(["export", "--format", "hf", "--manifest", str(tmp_path / "run.toml"), "--save-dir",
                 *map(str, dirs), "--out", str(out)]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    sample = "def g(x):\n    return x * 7\n"
    assert tok(sample, add_special_tokens=False).input_ids == load_tokenizer(m.data.tokenizer).encode(sample)
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token) == ("<|endoftext|>", 0, "<|pad|>")
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 0
    capsys.readouterr()
    assert main(["generate", "--model", str(out), "--prompt", "def ", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("def ")
