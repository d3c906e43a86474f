"""Byte corpora, the stable train/val split and seeded microbatch streams."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from swarmgrad.peer.data import (
    SEPARATOR,
    ByteCorpus,
    MicrobatchStream,
    bits_per_byte,
    load_corpora,
    split_train_val,
    stdlib_python_files,
    stdlib_root,
    validation_batches,
)


@pytest.fixture(scope="module")
def stdlib_files() -> list[Path]:
    return stdlib_python_files()


def _corpus(n: int = 5000) -> ByteCorpus:
    return ByteCorpus.from_bytes(bytes(i % 251 for i in range(n)))


def test_stdlib_files(stdlib_files: list[Path]) -> None:
    root = stdlib_root()
    assert len(stdlib_files) > 100
    assert all(p.suffix == ".py" for p in stdlib_files)
    rel = [p.relative_to(root).as_posix() for p in stdlib_files]
    assert rel == sorted(rel)
    assert "os.py" in rel and "json/decoder.py" in rel
    assert not any("site-packages" in r or "dist-packages" in r or "_sysconfigdata" in r for r in rel)
    without_tests = stdlib_python_files(include_tests=False)
    assert set(without_tests) <= set(stdlib_files)
    assert not any("/test/" in f"/{p.relative_to(root).as_posix()}" for p in without_tests)


def test_split_stable_and_disjoint(stdlib_files: list[Path]) -> None:
    train, val = split_train_val(stdlib_files, 0.05, root=stdlib_root())
    assert set(train).isdisjoint(val)
    assert set(train) | set(val) == set(stdlib_files)
    assert 0.02 < len(val) / len(stdlib_files) < 0.10
    # same answer again, and for any subset or order of the files (the hash is per file)
    assert split_train_val(stdlib_files, 0.05, root=stdlib_root()) == (train, val)
    subset = stdlib_files[::7][::-1]
    sub_train, sub_val = split_train_val(subset, 0.05, root=stdlib_root())
    assert set(sub_val) == set(val) & set(subset)
    assert set(sub_train) == set(train) & set(subset)


def test_split_depends_on_relative_path_only(tmp_path: Path) -> None:
    names = [f"pkg/mod{i}.py" for i in range(200)]
    splits = []
    for where in ("a", "b/c"):
        files = [tmp_path / where / n for n in names]
        train, val = split_train_val(files, 0.2, root=tmp_path / where)
        base = tmp_path / where
        splits.append(([f.relative_to(base) for f in train], [f.relative_to(base) for f in val]))
    assert splits[0] == splits[1]
    assert 20 < len(splits[0][1]) < 60


def test_split_rejects_bad_fraction() -> None:
    with pytest.raises(ValueError, match="val_fraction"):
        split_train_val([Path("a.py")], 0.0)


def test_corpus_from_files(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"hello")
    (tmp_path / "b.txt").write_bytes(b"world!")
    paths = [tmp_path / "a.txt", tmp_path / "missing.txt", tmp_path / "b.txt"]
    corpus = ByteCorpus.from_files(paths)
    assert corpus.data.dtype == torch.uint8
    assert bytes(corpus.data.tolist()) == b"hello" + SEPARATOR + b"world!"
    assert corpus.n_files == 2 and len(corpus) == 12
    capped = ByteCorpus.from_files(paths, max_bytes=7)
    assert bytes(capped.data.tolist()) == (b"hello" + SEPARATOR + b"world!")[:7]
    assert len(ByteCorpus.from_files(paths, max_bytes=3)) == 3
    assert ByteCorpus.from_files(paths, max_bytes=3).n_files == 1


def test_stream_shapes_and_shift() -> None:
    corpus = _corpus()
    inputs, targets = next(MicrobatchStream(corpus, seq_len=16, batch_size=4, seed=0))
    assert inputs.shape == targets.shape == (4, 16)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    data = corpus.data.long()
    for row_in, row_t in zip(inputs, targets):
        # each row is a real window of the corpus, and targets are the next bytes
        matches = [s for s in range(len(data) - 16) if torch.equal(data[s : s + 16], row_in)]
        assert matches and torch.equal(data[matches[0] + 1 : matches[0] + 17], row_t)


def test_stream_reproducible_and_seeded() -> None:
    corpus = _corpus()
    state = torch.get_rng_state()
    a = [next(s) for s in [MicrobatchStream(corpus, 16, 4, seed=1)] for _ in range(3)]
    b = [next(s) for s in [MicrobatchStream(corpus, 16, 4, seed=1)] for _ in range(3)]
    c = [next(s) for s in [MicrobatchStream(corpus, 16, 4, seed=2)] for _ in range(3)]
    assert torch.equal(torch.get_rng_state(), state), "streams must not touch the global RNG"
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not all(torch.equal(xa, xc) for (xa, _), (xc, _) in zip(a, c))
    assert not torch.equal(a[0][0], a[1][0])  # successive batches differ


@pytest.mark.parametrize("sizes", [(2, 8, 8, 8, 8, 8, 8, 8, 4, 2), (1, 3), (5,)])
def test_draws_of_any_sizes_cut_the_same_windows(sizes: tuple[int, ...]) -> None:
    # a tapered step (inner.microbatch_sizes) draws the windows a stream of full batches would
    corpus = _corpus()
    whole = MicrobatchStream(corpus, 16, sum(sizes), seed=3).draw(sum(sizes))
    tapered = MicrobatchStream(corpus, 16, 8, seed=3)
    parts = [tapered.draw(n) for n in sizes]
    assert [x.shape[0] for x, _ in parts] == list(sizes)
    for got, want in zip((torch.cat([p[i] for p in parts]) for i in (0, 1)), whole):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="window"):
        tapered.draw(0)


def test_stream_edges() -> None:
    exact = ByteCorpus.from_bytes(bytes(range(17)))
    inputs, targets = next(MicrobatchStream(exact, seq_len=16, batch_size=2, seed=0))
    assert torch.equal(inputs[0], torch.arange(16)) and torch.equal(targets[0], torch.arange(1, 17))
    with pytest.raises(ValueError, match="too few"):
        MicrobatchStream(ByteCorpus.from_bytes(bytes(16)), seq_len=16, batch_size=2, seed=0)


def test_validation_batches_fixed() -> None:
    corpus = _corpus()
    a = validation_batches(corpus, 16, 4, n_batches=3)
    b = validation_batches(corpus, 16, 4, n_batches=3)
    assert len(a) == 3
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_bits_per_byte() -> None:
    assert bits_per_byte(math.log(2)) == pytest.approx(1.0)
    assert bits_per_byte(math.log(256)) == pytest.approx(8.0)


def test_load_stdlib_corpora() -> None:
    train, val = load_corpora("stdlib", max_bytes=100_000)
    assert len(train) == len(val) == 100_000
    assert not torch.equal(train.data[:1000], val.data[:1000])


def test_load_files_source(tmp_path: Path) -> None:
    for i in range(60):
        (tmp_path / "d" / f"sub{i % 3}").mkdir(parents=True, exist_ok=True)
        (tmp_path / "d" / f"sub{i % 3}" / f"f{i}.txt").write_text(f"file {i}\n" * 20)
    (tmp_path / "d" / "ignored.bin").write_bytes(b"\x00")
    train, val = load_corpora("files", [str(tmp_path / "d" / "**" / "*.txt")], val_fraction=0.2)
    assert train.n_files + val.n_files == 60 and val.n_files > 0
    # a directory means every file below it
    train_d, val_d = load_corpora("files", [str(tmp_path / "d")], val_fraction=0.2)
    assert train_d.n_files + val_d.n_files == 61
    # a single file is split by bytes: the tail goes to validation
    single = tmp_path / "one.txt"
    single.write_bytes(bytes(range(100)) * 10)
    train_s, val_s = load_corpora("files", [str(single)], val_fraction=0.1)
    assert len(train_s) == 900 and len(val_s) == 100
    assert [len(c) for c in load_corpora("files", [str(single)], 0.1, max_bytes=50)] == [50, 50]
    assert [len(c) for c in load_corpora("files", [str(single)], 0.1, max_bytes=0)] == [900, 100]  # 0: no cap
    whole = torch.tensor(list(bytes(range(100)) * 10), dtype=torch.uint8)
    assert torch.equal(torch.cat([train_s.data, val_s.data]), whole)


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="data.paths"):
        load_corpora("files", [])
    with pytest.raises(ValueError, match="data.paths"):
        load_corpora("files", [str(tmp_path / "nothing*.txt")])
    with pytest.raises(ValueError, match="data.paths"):
        load_corpora("stdlib", ["x.txt"])
    with pytest.raises(ValueError, match="data.source"):
        load_corpora("web")
