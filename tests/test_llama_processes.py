"""A newcomer's path end to end, in real processes: `swarmgrad tokenizer train` on text files the
test writes, a 2-stage Llama swarm of real `swarmgrad peer` processes on them (each with its DHT
child and p2pd, on 127.0.0.1) whose validation loss falls, `swarmgrad export --format hf` from the
peers' --save-dir files and `swarmgrad generate` continuing a prompt with the export.

What the in-process tests (test_text_swarm.py, test_llama_swarm.py) cannot show: the CLI's own
flags and files between the steps, the tokenizer pinned in a manifest that peer processes verify,
and the peers' save files read back by another process's export. 19 s on 2 cores at load ~3 (135 s
at load 16)."""
from __future__ import annotations

import math
import random
import re
from pathlib import Path

import pytest

pytest.importorskip("tokenizers", reason="the BPE tokenizer needs the tokenizers library (pip install 'swarmgrad[hf]')")

from swarmgrad.peer.cli.main import main
from swarmgrad.peer.manifest import dumps

from conftest import small_manifest

pytestmark = pytest.mark.timeout(240)

ROUNDS = 4
WORDS = ("the swarm of peers trains one model over slow links and every stage averages its own part "
         "while drivers read text").split()


def _write_corpus(folder: Path, n: int = 80, seed: int = 0) -> None:
    """`n` small text files, one document each (a files source's unit of the validation split)."""
    folder.mkdir()
    rng = random.Random(seed)
    for i in range(n):
        sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))).capitalize() + "."
                     for _ in range(rng.randint(4, 12))]
        (folder / f"doc{i:03d}.txt").write_text(" ".join(sentences) + "\n")


def test_tokenizer_swarm_export_generate(local_swarm, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # the CLI resolves --files globs against the working folder, as for a user
    _write_corpus(tmp_path / "texts")
    assert main(["tokenizer", "train", "--files", "texts/*.txt", "--vocab-size", "320", "--out", "tok.json"]) == 0
    printed = capsys.readouterr().out
    sha = re.search(r'tokenizer_sha256 = "([0-9a-f]{64})"', printed)
    vocab = re.search(r"vocab_size = (\d+)", printed)
    assert sha and vocab, printed

    manifest = small_manifest(
        run_id="llama-e2e",
        model={"kind": "llama", "d_model": 48, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "seq_len": 32,
               "vocab_size": int(vocab.group(1))},
        inner={"lr": 3e-3, "microbatch_size": 8, "microbatches_per_step": 2},
        rounds={"inner_steps": 6, "round_seconds": 0.0},
        data={"source": "files", "paths": [str(tmp_path / "texts" / "*.txt")], "max_bytes": 0,
              "tokenizer": str(tmp_path / "tok.json"), "tokenizer_sha256": sha.group(1), "val_fraction": 0.1,
              "eval_every": 0, "eval_batches": 2, "shard_mb": 0.002},
        pipeline={"activation_codec": "fp16", "gradient_codec": "fp16", "max_in_flight": 2},
        timeouts={"microbatch": 30.0, "min_microbatch": 10.0})
    (tmp_path / "run.toml").write_text(dumps(manifest))
    swarm = local_swarm(manifest)
    saves = tmp_path / "saves"
    flags = ("--max-rounds", str(ROUNDS), "--save-dir", str(saves), "--linger", "60")
    driver = swarm.start_first(0, *flags)
    swarm.start(1, *flags)
    codes = swarm.wait_exit(180)
    assert codes == [0, 0], "\n".join(p.log_tail() for p in swarm.peers)

    evals = sorted((e for e in driver.events("eval") if e.get("val_nats") is not None), key=lambda e: e["time"])
    assert len(evals) >= 2 and evals[-1]["final"], driver.log_tail()
    first, last = evals[0], evals[-1]
    assert first["val_nats"] > math.log(int(vocab.group(1))) - 1.0  # untrained: about uniform
    assert last["val_nats"] < first["val_nats"] - 1.0, evals
    assert last["val_ppl"] == pytest.approx(math.exp(last["val_nats"]))

    transformers = pytest.importorskip("transformers", reason="export's check and generate need the hf extra "
                                                              "(pip install 'swarmgrad[hf]')")
    out = tmp_path / "hf"
    capsys.readouterr()
    assert main(["export", "--format", "hf", "--manifest", str(tmp_path / "run.toml"), "--save-dir", str(saves),
                 "--out", str(out)]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    assert model.config.vocab_size == manifest.model.vocab_size and tokenizer("the swarm").input_ids
    capsys.readouterr()
    assert main(["generate", "--model", str(out), "--prompt", "The swarm", "--max-new-tokens", "12"]) == 0
    text = capsys.readouterr().out.strip()
    assert text.startswith("The swarm") and len(text) > len("The swarm") + 5, text
    # trained on the test's sentences, greedy decoding continues with the test's own words (the last
    # may be cut mid-word by --max-new-tokens)
    words = re.findall(r"[a-z]+", text[len("The swarm"):].lower())[:-1]
    assert words and set(words) <= set(WORDS), text
