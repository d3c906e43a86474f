"""The llama kind in a swarm: with one replica per stage, H = 1, outer lr 1 and no momentum, a
round of 2 real peers (one event loop, loopback transport, tests/support/swarm.py) equals one
AdamW step of the whole model; and the peers' --save-dir files export to a Hugging Face folder
whose logits in transformers equal the stages'."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarmgrad.peer.cli.main import main
from swarmgrad.peer.data import MicrobatchStream, load_corpora
from swarmgrad.peer.manifest import dumps
from swarmgrad.peer.model import from_manifest

from support.swarm import exact_round_manifest, one_saved_round, saved_round

DATA_SEED = 99


@pytest.mark.timeout(120)
def test_a_llama_round_equals_one_whole_model_step_and_exports(inprocess, tmp_path: Path, capsys) -> None:
    m = exact_round_manifest(
        tmp_path, model={"kind": "llama", "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "seq_len": 32})
    saves = inprocess(lambda: one_saved_round(m, tmp_path, DATA_SEED))

    model = from_manifest(m)
    stages = [model.build_stage(s) for s in range(model.n_stages)]
    whole = torch.nn.Sequential(*stages)
    train, _ = load_corpora(m.data.source, m.data.paths, m.data.val_fraction, None)
    stream = MicrobatchStream(train, m.model.seq_len, m.inner.microbatch_size, DATA_SEED)
    batches = [stream.draw(n) for n in m.inner.step_sizes]
    opt = torch.optim.AdamW(whole.parameters(), lr=m.inner.lr, betas=m.inner.betas, weight_decay=m.inner.weight_decay)
    loss = sum(model.loss_fn(whole(x), y) for x, y in batches) / len(batches)
    loss.backward()
    opt.step()
    for s, stage in enumerate(stages):
        params = saved_round(saves[s], s)
        fresh = dict(model.build_stage(s).named_parameters())
        assert any(not torch.equal(params[n], fresh[n].detach()) for n in params)
        for name, p in stage.named_parameters():
            torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda msg: f"stage {s} {name}: {msg}")

    transformers = pytest.importorskip("transformers", reason="the hf extra (pip install 'swarmgrad[hf]') is not "
                                                              "installed")
    (tmp_path / "run.toml").write_text(dumps(m))
    out = tmp_path / "hf"
    assert main(["export", "--format", "hf", "--manifest", str(tmp_path / "run.toml"), "--save-dir",
                 *map(str, saves), "--out", str(out)]) == 0
    tokens = batches[0][0]
    with torch.no_grad():
        ours = whole(tokens)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()(tokens).logits
    assert float((ours - theirs).abs().max()) <= 1e-4 * float(theirs.abs().max())
