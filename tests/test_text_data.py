"""Real text in (peer/text/): each source kind read into documents and shards, packing into
windows, the document-level validation split, streaming without a corpus in memory, the driver's
stream, and the evaluation units. Files are written by the tests; all fast."""
from __future__ import annotations

import json
import math
import tracemalloc
from pathlib import Path

import pytest
import torch

from swarmgrad.peer.manifest import loads
from swarmgrad.peer.text.corpus import TokenCorpus, TokenStream
from swarmgrad.peer.text.packing import pack_windows
from swarmgrad.peer.text.run_data import load_run_data, uses_text_pipeline
from swarmgrad.peer.text.sources import TextSource, is_validation
from swarmgrad.peer.text.tokenizer import ByteTokenizer
from swarmgrad.peer.text.units import eval_units

DOCS = [f"document {i}: " + "word " * (i % 7 + 1) + ("ünï " if i % 3 == 0 else "") for i in range(60)]


def _write_jsonl(path: Path, docs: list[str], field: str = "text") -> None:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))


def _texts(source: TextSource) -> list[str]:
    return [d.text for s in source.shards for d in source.documents(s)]


# --------------------------------------------------------------------------- sources


def test_files_source_groups_files_into_shards(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    for i, d in enumerate(DOCS[:10]):
        (tmp_path / ("sub" if i % 2 else ".") / f"f{i:02d}.txt").write_text(d)
    src = TextSource("files", ["*.txt", "sub/**/*.txt"], tmp_path, shard_bytes=40)
    names = [n for s in src.shards for n in s.names]
    assert names == sorted(f"f{i:02d}.txt" for i in range(0, 10, 2)) + sorted(f"sub/f{i:02d}.txt" for i in range(1, 10, 2))
    assert len(src.shards) > 1 and [s.index for s in src.shards] == list(range(len(src.shards)))
    assert sorted(_texts(src)) == sorted(DOCS[:10])
    # ids are stable: the same corpus listed from another folder (another machine) has the same ids
    again = TextSource("files", [str(tmp_path / "*.txt"), str(tmp_path / "sub/**/*.txt")], tmp_path, shard_bytes=40)
    assert [s.id for s in again.shards] == [s.id for s in src.shards]
    with pytest.raises(ValueError, match="matches no file"):
        TextSource("files", ["missing/*.txt"], tmp_path)


@pytest.mark.parametrize("shard_bytes", [1, 50, 1000, 1 << 20])
def test_jsonl_byte_ranges_hold_every_line_once(tmp_path: Path, shard_bytes: int) -> None:
    _write_jsonl(tmp_path / "a.jsonl", DOCS[:30])
    _write_jsonl(tmp_path / "b.jsonl", DOCS[30:], field="body")
    src = TextSource("jsonl", ["a.jsonl"], tmp_path, shard_bytes=shard_bytes)
    assert _texts(src) == DOCS[:30]  # cut anywhere, every line is in exactly the shard it starts in
    keys = [d.key for s in src.shards for d in src.documents(s)]
    assert len(set(keys)) == 30 and keys[0] == "a.jsonl@0"
    assert _texts(TextSource("jsonl", ["b.jsonl"], tmp_path, "body", shard_bytes)) == DOCS[30:]
    with pytest.raises(ValueError, match="no field data.text_field = 'text'"):
        _texts(TextSource("jsonl", ["b.jsonl"], tmp_path))
    # gzip: the same documents and identities, one shard
    import gzip
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress((tmp_path / "a.jsonl").read_bytes()))
    gz = TextSource("jsonl", ["a.jsonl.gz"], tmp_path, shard_bytes=shard_bytes)
    assert len(gz.shards) == 1 and _texts(gz) == DOCS[:30]
    assert [d.key.split("@")[1] for d in gz.documents(gz.shards[0])] == [k.split("@")[1] for k in keys]


def test_parquet_row_groups(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow", reason="parquet is read with pyarrow (pip install 'swarmgrad[data]')")
    import pyarrow.parquet as pq
    table = pa.table({"content": DOCS, "n": list(range(len(DOCS)))})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=7)
    src = TextSource("parquet", ["*.parquet"], tmp_path, "content", shard_bytes=1)
    assert len(src.shards) == math.ceil(len(DOCS) / 7)  # a row group per shard at this size
    assert _texts(src) == DOCS
    assert len(TextSource("parquet", ["*.parquet"], tmp_path, "content").shards) == 1
    with pytest.raises(ValueError, match="no column data.text_field = 'text'"):
        _texts(TextSource("parquet", ["*.parquet"], tmp_path))


def _save_to_disk(folder: Path, docs: list[str], files: int = 2) -> None:
    """What datasets' save_to_disk writes (Arrow IPC streams, state.json, dataset_info.json), without datasets."""
    pa = pytest.importorskip("pyarrow", reason="hf-disk is read with pyarrow (pip install 'swarmgrad[data]')")
    folder.mkdir(parents=True)
    per = math.ceil(len(docs) / files)
    names = []
    for k in range(files):
        name = f"data-{k:05d}-of-{files:05d}.arrow"
        table = pa.table({"text": docs[k * per:(k + 1) * per]})
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=5):
                writer.write_batch(batch)
        names.append(name)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names],
                                                   "_fingerprint": "x", "_split": "train"}))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))


def test_hf_disk_folder(tmp_path: Path) -> None:
    _save_to_disk(tmp_path / "ds" / "train", DOCS)
    src = TextSource("hf-disk", ["ds/train"], tmp_path)
    assert len(src.shards) == 2 and _texts(src) == DOCS
    (tmp_path / "ds" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    with pytest.raises(ValueError, match="name one split's folder, e.g. ds/train"):
        TextSource("hf-disk", ["ds"], tmp_path)


# --------------------------------------------------------------------------- packing


@pytest.mark.parametrize("seq_len", [1, 3, 8, 50])
def test_packing_loses_no_token(seq_len: int) -> None:
    docs = [[100 + i] * (i % 5 + 1) for i in range(20)]
    stream = [t for d in docs for t in d + [0]]  # EOD after every document
    windows = list(pack_windows(docs, seq_len, eod_id=0))
    assert all(len(w) == seq_len + 1 for w in windows)
    targets = [t for w in windows for t in w[1:]]
    covered = len(stream) - 1  # every token after the first is a target once, in order ...
    assert targets[:covered] == stream[1:]
    assert targets[covered:] == stream[:len(targets) - covered]  # ... then the wrap to the stream's start
    assert len(targets) - covered < seq_len
    assert [w[0] for w in windows] == stream[:len(windows) * seq_len:seq_len]


def test_packing_short_and_empty() -> None:
    assert list(pack_windows([], 4, 0)) == []
    assert list(pack_windows([[5, 6]], 4, 0)) == [[5, 6, 0, 5, 6]]  # one window from a short shard


# --------------------------------------------------------------------------- split, stream, memory


def test_validation_split_is_by_document_and_stable(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "a.jsonl", DOCS)
    corpus = TokenCorpus(TextSource("jsonl", ["a.jsonl"], tmp_path, shard_bytes=300), ByteTokenizer(), 8, 0.25)
    train = [d.key for s in corpus.shards for d in corpus.documents(s)]
    val = [d.key for s in corpus.shards for d in corpus.documents(s, validation=True)]
    assert not set(train) & set(val) and len(train) + len(val) == len(DOCS) and 0 < len(val) < len(DOCS) / 2
    assert val == [k for k in train + val if is_validation(k, 0.25)]
    again = TokenCorpus(TextSource("jsonl", [str(tmp_path / "a.jsonl")], tmp_path, shard_bytes=999), ByteTokenizer(),
                        8, 0.25)
    assert val == [d.key for s in again.shards for d in again.documents(s, validation=True)]
    # the validation windows hold validation text only
    vs = corpus.validation(6)
    val_text = "\n".join(d.text for s in corpus.shards for d in corpus.documents(s, validation=True))
    for w in vs.windows:
        assert bytes(w[1:].tolist()).decode(errors="ignore").strip("\n").split("\n")[0] in val_text
    assert vs.tokens == 6 * 8 and vs.bytes == vs.tokens  # bytes: one per token
    assert [w.tolist() for w in corpus.validation(6).windows] == [w.tolist() for w in vs.windows]


def test_stream_draws_whole_shards_reproducibly(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "a.jsonl", DOCS)
    corpus = TokenCorpus(TextSource("jsonl", ["a.jsonl"], tmp_path, shard_bytes=400), ByteTokenizer(), 16, 0.1)
    a, b, c = (TokenStream(corpus, 4, seed=3) for _ in range(3))
    for _ in range(12):  # past the first shard's end
        (xa, ya), (xb, _), (xc1, _), (xc2, _) = a.draw(4), b.draw(4), c.draw(1), c.draw(3)
        assert xa.shape == ya.shape == (4, 16) and xa.dtype == torch.long
        assert torch.equal(xa[:, 1:], ya[:, :-1])
        assert torch.equal(xa, xb) and torch.equal(xa, torch.cat([xc1, xc2]))  # same seed, same windows
    assert a.batches_drawn == 12 and a.position.shards_done and len(set(a.position.shards_done)) == len(a.position.shards_done)
    firsts = {repr(TokenStream(corpus, 4, seed=seed).draw(4)[0].tolist()) for seed in range(8)}
    assert len(firsts) > 2  # drivers of different seeds start on different shards
    # a leasing driver hands its own shards: only their windows come out
    one = corpus.shards[1]
    expected = list(corpus.shard_windows(one))
    in_order = TokenStream(corpus, 2, seed=0, shards=iter([one]), shuffle=0)
    got = torch.cat([in_order.draw(1)[0] for _ in range(len(expected))])
    assert torch.equal(got, torch.stack([w[:-1] for w in expected]))
    assert in_order.position.shard == one and in_order.position.windows_in_shard == len(expected)
    assert in_order.position.shards_done == [one.id]
    # shuffled within the shard: the same windows, another order, and every one before the shard is done
    shuffled = TokenStream(corpus, 2, seed=0, shards=iter([one]), shuffle=4)
    rows = [shuffled.draw(1)[0][0] for _ in range(len(expected))]
    assert sorted(r.tolist() for r in rows) == sorted(w[:-1].tolist() for w in expected)
    assert [r.tolist() for r in rows] != [w[:-1].tolist() for w in expected]
    assert shuffled.position.shards_done == [one.id]


def test_streaming_does_not_materialise_the_corpus(tmp_path: Path) -> None:
    big = tmp_path / "big.jsonl"
    line = json.dumps({"text": "lorem ipsum dolor sit amet " * 40}) + "\n"
    with open(big, "w") as f:
        for _ in range(20_000):  # ~22 MB
            f.write(line)
    corpus = TokenCorpus(TextSource("jsonl", ["big.jsonl"], tmp_path, shard_bytes=8 << 20), ByteTokenizer(), 64, 0.01)
    tracemalloc.start()
    try:
        stream = TokenStream(corpus, 8, seed=0)
        for _ in range(50):
            stream.draw(8)
        corpus.validation(16)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert big.stat().st_size > 20e6 and peak < 4e6, f"peak {peak / 1e6:.1f} MB"


# --------------------------------------------------------------------------- the run's data, the units


def test_run_data_picks_the_path(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "a.jsonl", DOCS * 3)
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "m.toml").write_text('run_id = "t"\n[model]\nseq_len = 16\n[inner]\nmicrobatch_size = 4\n'
                                   '[data]\nsource = "jsonl"\npaths = ["../a.jsonl"]\nval_fraction = 0.2\n'
                                   'eval_batches = 2\n')
    from swarmgrad.peer.manifest import load
    m = load(folder / "m.toml")
    assert uses_text_pipeline(m.data)
    data = load_run_data(m, seed=1)
    assert len(data.validation) == 2 and data.validation[0][0].shape == (4, 16)
    assert data.val_tokens == 2 * 4 * 16 == data.val_bytes and data.corpus is not None
    assert data.stream.draw(4)[0].shape == (4, 16)
    default = loads('run_id = "t"\n[data]\nmax_bytes = 20000\neval_batches = 1\n')
    assert not uses_text_pipeline(default.data)
    byte_data = load_run_data(default, seed=1)
    assert byte_data.corpus is None and byte_data.val_tokens == byte_data.val_bytes == 8 * 128


def test_eval_units() -> None:
    u = eval_units(math.log(2), tokens=100, n_bytes=100)  # a byte model: 1 bit per byte
    assert u.bits_per_byte == pytest.approx(1.0) and u.perplexity == pytest.approx(2.0)
    u = eval_units(2.0, tokens=250, n_bytes=1000)  # 4 bytes per token
    assert u.bits_per_byte == pytest.approx(2.0 * 250 / 1000 / math.log(2))
    assert u.perplexity == pytest.approx(math.exp(2.0)) and u.nats_per_token == 2.0
    assert set(u.fields()) == {"val_nats", "val_ppl", "val_bpb", "val_tokens", "val_bytes"}
    assert math.isnan(eval_units(math.nan, 1, 1).bits_per_byte) and eval_units(800.0, 1, 1).perplexity == math.inf


def test_prefetching_stream_gives_the_same_windows_and_stops(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "a.jsonl", DOCS * 2)
    corpus = TokenCorpus(TextSource("jsonl", ["a.jsonl"], tmp_path, shard_bytes=500), ByteTokenizer(), 16, 0.1)
    plain, ahead = TokenStream(corpus, 4, seed=5), TokenStream(corpus, 4, seed=5, prefetch=8)
    try:
        for _ in range(30):  # past the end of an epoch
            assert torch.equal(plain.draw(4)[0], ahead.draw(4)[0])
        assert plain.position == ahead.position  # what was drawn, not what the thread read ahead
    finally:
        ahead.close()
    assert ahead._thread is not None and not ahead._thread.is_alive()
    with pytest.raises(ValueError, match="closed"):
        ahead.draw(1)
    # an error while reading reaches the consumer (here: every document in validation)
    empty = TokenStream(TokenCorpus(corpus.source, ByteTokenizer(), 16, 0.999999), 4, seed=0, prefetch=4)
    try:
        with pytest.raises(ValueError, match="gave no training window"):
            empty.draw(1)
    finally:
        empty.close()


@pytest.mark.parametrize("data,error", [
    ({"source": "jsonl"}, "data.paths must list files"),
    ({"source": "stdlib", "paths": ["x"]}, "data.paths is only used with a source other than"),
    ({"source": "csv", "paths": ["x"]}, "data.source must be one of"),
    ({"source": "jsonl", "paths": ["x"], "text_field": ""}, "data.text_field must name"),
    ({"source": "jsonl", "paths": ["x"], "max_bytes": 1000}, "data.max_bytes caps the byte-level corpus only"),
    ({"source": "jsonl", "paths": ["x"], "shard_mb": 0}, "data.shard_mb must be > 0"),
])
def test_manifest_refuses_bad_data_fields(data: dict, error: str) -> None:
    from swarmgrad.peer.manifest import ManifestError, from_dict
    with pytest.raises(ManifestError, match=error):
        from_dict({"run_id": "t", "data": data})


def test_paths_resolve_against_the_manifests_folder(tmp_path: Path) -> None:
    from swarmgrad.peer.manifest import load
    (tmp_path / "data").mkdir()
    _write_jsonl(tmp_path / "data" / "a.jsonl", DOCS)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "m.toml").write_text('run_id = "t"\n[data]\nsource = "jsonl"\npaths = ["../data/*.jsonl"]\n')
    m = load(tmp_path / "run" / "m.toml")
    assert m.data.base_dir == str(tmp_path / "run")
    (tmp_path / "run" / "n.toml").write_text('run_id = "t"\n[data]\nsource = "jsonl"\npaths = ["*.jsonl"]\n'
                                             'base_dir = "../data"\n')
    n = load(tmp_path / "run" / "n.toml")
    assert n.hash != m.hash  # other paths ...
    for manifest in (m, n):  # ... the same documents
        assert _texts(TextSource("jsonl", manifest.data.paths, manifest.data.base_dir)) == DOCS


def test_a_shard_taken_over_part_way_continues_where_its_holder_stopped(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "a.jsonl", DOCS * 3)
    corpus = TokenCorpus(TextSource("jsonl", ["a.jsonl"], tmp_path, shard_bytes=2000), ByteTokenizer(), 8, 0.1)
    shard = corpus.shards[0]
    holder = TokenStream(corpus, 1, seed=11, shards=iter([shard]), epoch=2, shuffle=16)
    order = [w[:-1] for w in holder.window_order(shard, epoch=2)]
    assert len(order) > 20
    drawn = [holder.draw(1)[0][0] for _ in range(7)]
    assert holder.position.windows_in_shard == 7 and holder.position.epoch == 2
    # another driver (another seed) takes the shard over, skipping what the holder drew
    taker = TokenStream(corpus, 1, seed=99, shards=iter([(shard, 7)]), epoch=2, shuffle=16)
    rest = [taker.draw(1)[0][0] for _ in range(len(order) - 7)]
    assert [r.tolist() for r in drawn + rest] == [w.tolist() for w in order]  # none twice, none lost
    assert taker.position.windows_in_shard == len(order) and taker.position.shards_done == [shard.id]
    with pytest.raises(ValueError, match="exhausted"):
        taker.draw(1)
