"""The BPE tokenizer (peer/text/tokenizer.py) and how a manifest names and pins it: training is
deterministic, text round-trips, a peer with a different file refuses to start in one line, and
the model's vocabulary must cover the tokenizer."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("tokenizers", reason="the BPE tokenizer needs the tokenizers library")

from swarmgrad.peer.cli.main import main
from swarmgrad.peer.manifest import ManifestError, load, loads
from swarmgrad.peer.text.run_data import run_tokenizer
from swarmgrad.peer.text.tokenizer import (EOD_TOKEN, SPECIAL_TOKENS, BPETokenizer, ByteTokenizer, TokenizerMismatch,
                                           file_sha256, train_bpe_on_files)

TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.\n"
        "Sphinx of black quartz, judge my vow! Ünïcödé, 日本語, emoji 🙂 and tabs\tand spaces  .\n")


def _corpus(tmp: Path) -> list[Path]:
    files = []
    for i in range(4):
        p = tmp / f"doc{i}.txt"
        p.write_text(TEXT * (20 + i) + f"document number {i}\n")
        files.append(p)
    return files


def _manifest(folder: Path, tokenizer: str, sha: str, vocab: int = 512, model: str = "gpt") -> Path:
    path = folder / "run.toml"
    path.write_text(f'run_id = "t"\n[model]\nkind = "{model}"\nvocab_size = {vocab}\nd_model = 32\nn_layers = 2\n'
                    f'n_heads = 2\nseq_len = 16\n[data]\nsource = "files"\npaths = ["*.txt"]\n'
                    f'tokenizer = "{tokenizer}"\ntokenizer_sha256 = "{sha}"\n')
    return path


def test_training_is_deterministic_and_round_trips(tmp_path: Path) -> None:
    files = _corpus(tmp_path)
    a = train_bpe_on_files(files, 400, tmp_path / "a.json")
    b = train_bpe_on_files(files, 400, tmp_path / "b.json")
    assert a.sha256 == b.sha256 == file_sha256(a.path)
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    tok = BPETokenizer(a.path)
    assert tok.vocab_size == a.vocab_size <= 400
    assert [tok._tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert tok.eod_id == 0
    for text in (TEXT, "never seen: ζ∑ 🚀 \x00\x7f", "", f"quotes {EOD_TOKEN} as text"):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.eod_id not in ids  # a quoted end-of-document marker is text, not the token
        assert sum(tok.token_bytes()[i] for i in ids) == len(text.encode())  # bits per byte's count
    assert len(tok.encode(TEXT)) < len(TEXT.encode()) / 2  # it learned merges


def test_byte_tokenizer_is_todays_bytes() -> None:
    tok = ByteTokenizer()
    assert tok.encode("aé\n") == list("aé\n".encode()) and tok.decode(tok.encode("aé\n")) == "aé\n"
    assert tok.vocab_size == 256 and tok.eod_id == ord("\n") and tok.token_bytes() == [1] * 256


def test_cli_train_prints_the_manifest_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    _corpus(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["tokenizer", "train", "--files", "doc*.txt", "--vocab-size", "300", "--out", "tok.json"]) == 0
    out = capsys.readouterr().out
    sha = file_sha256(tmp_path / "tok.json")
    assert 'tokenizer = "tok.json"' in out and f'tokenizer_sha256 = "{sha}"' in out
    assert "vocab_size = 300" in out and "4 file(s)" in out
    # the printed lines make a manifest that loads, and whose tokenizer verifies
    m = load(_manifest(tmp_path, "tok.json", sha, vocab=300))
    assert run_tokenizer(m).vocab_size == 300
    assert main(["tokenizer", "train", "--files", "nothing*.txt", "--vocab-size", "300", "--out", "x.json"]) == 2
    assert "matches no file" in capsys.readouterr().err
    assert main(["tokenizer", "train", "--files", "doc*.txt", "--vocab-size", "100", "--out", "x.json"]) == 2


def test_tokenizer_path_is_relative_to_the_manifest_and_not_hashed(tmp_path: Path) -> None:
    files = _corpus(tmp_path)
    trained = train_bpe_on_files(files, 300, tmp_path / "tok.json")
    m = load(_manifest(tmp_path, "tok.json", trained.sha256))
    assert m.data.tokenizer == str(tmp_path / "tok.json") and m.data.base_dir == str(tmp_path)
    # the same run kept in another folder (another machine) is the same run
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "tok.json").write_bytes(trained.path.read_bytes())
    m2 = load(_manifest(other, "tok.json", trained.sha256))
    assert m2.data.tokenizer == str(other / "tok.json")
    assert m2.hash == m.hash and m2 == m
    # a different pin is a different run
    assert load(_manifest(other, "tok.json", "0" * 64)).hash != m.hash


def test_a_peer_whose_tokenizer_differs_refuses_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = _corpus(tmp_path)
    trained = train_bpe_on_files(files, 300, tmp_path / "tok.json")
    path = _manifest(tmp_path, "tok.json", trained.sha256)
    (tmp_path / "tok.json").write_bytes(train_bpe_on_files(files[:1], 290, tmp_path / "other.json").path.read_bytes())
    with pytest.raises(TokenizerMismatch) as e:
        run_tokenizer(load(path))
    assert "\n" not in str(e.value) and trained.sha256 in str(e.value) and "differs" in str(e.value)
    # the peer command says it the same way and starts nothing
    assert main(["peer", "--manifest", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "data.tokenizer_sha256" in err
    (tmp_path / "tok.json").unlink()
    with pytest.raises(TokenizerMismatch, match="does not exist"):
        run_tokenizer(load(path))


def test_model_vocab_must_cover_the_tokenizer(tmp_path: Path) -> None:
    trained = train_bpe_on_files(_corpus(tmp_path), 300, tmp_path / "tok.json")
    with pytest.raises(TokenizerMismatch, match="model.vocab_size to at least 300"):
        run_tokenizer(load(_manifest(tmp_path, "tok.json", trained.sha256, vocab=299)))
    assert run_tokenizer(load(_manifest(tmp_path, "tok.json", trained.sha256, vocab=320))).vocab_size == 300


def test_manifest_refuses_a_tokenizer_without_its_pin() -> None:
    base = 'run_id = "t"\n[model]\nvocab_size = 300\n[data]\nsource = "files"\npaths = ["x"]\n'
    with pytest.raises(ManifestError, match="data.tokenizer_sha256 must pin"):
        loads(base + 'tokenizer = "tok.json"\n')
    with pytest.raises(ManifestError, match="data.tokenizer names none"):
        loads(base.replace("vocab_size = 300", "vocab_size = 256") + f'tokenizer_sha256 = "{"0" * 64}"\n')
    with pytest.raises(ManifestError, match="model.vocab_size must be 256"):
        loads(base)  # the byte-level GPT without a tokenizer


def test_the_standard_library_through_a_bpe(tmp_path: Path) -> None:
    """source = "stdlib" with a tokenizer (what an embedded BPE demo reads): the streaming path, the
    byte path's split by file, bits per byte counted over the text the tokens stand for."""
    from swarmgrad.peer.data import split_train_val, stdlib_python_files, stdlib_root
    from swarmgrad.peer.text.run_data import load_run_data
    files = stdlib_python_files(include_tests=False)
    trained = train_bpe_on_files(files[:40], 512, tmp_path / "tok.json")
    (tmp_path / "m.toml").write_text(
        f'run_id = "t"\n[model]\nvocab_size = 512\nseq_len = 64\n[inner]\nmicrobatch_size = 4\n'
        f'[data]\ntokenizer = "tok.json"\ntokenizer_sha256 = "{trained.sha256}"\neval_batches = 2\n')
    data = load_run_data(load(tmp_path / "m.toml"), seed=0)
    try:
        assert data.corpus is not None and data.val_bytes > data.val_tokens == 2 * 4 * 64
        x, y = data.stream.draw(4)
        assert x.shape == (4, 64) and int(x.max()) < 512
        val_docs = {d.key for s in data.corpus.shards[:1] for d in data.corpus.documents(s, validation=True)}
        _, val_files = split_train_val(stdlib_python_files(), 0.05, root=stdlib_root())
        assert val_docs and val_docs <= {f.relative_to(stdlib_root()).as_posix() for f in val_files}
    finally:
        data.close()
