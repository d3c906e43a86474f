"""Where documents come from, cut into shards: `data.source` = files | jsonl | parquet | hf-disk.

A corpus is an ordered list of `Shard`s, each a piece of the data that can be read alone: a run of
whole text files (files), a byte range of a JSON-lines file (jsonl: a line belongs to the shard in
which it starts), a range of row groups of a Parquet file (parquet), or one Arrow file of a folder
that `datasets`' ``save_to_disk`` wrote (hf-disk). Listing the shards reads no text: file sizes and
Parquet footers only. A shard's id is a hash of what it covers (kind, path relative to the
manifest's folder, range), so it is the same on every machine and in every run over the same data;
a driver that leases shards (the swarm's data position) names them by it.

Each document has an identity, stable across runs and machines: the file's relative path (files),
``path@byte offset`` of its line (jsonl; in the decompressed text of a ``.gz`` file, which is one
shard: a gzip stream cannot be entered in the middle), ``path#row group:row`` (parquet), ``path#row`` (hf-disk).
The validation split hashes it (`is_validation`).

Memory: `documents` yields one document at a time and holds at most one record batch of
`ROW_BATCH` rows (parquet, hf-disk), one line (jsonl) or one file (files: a file is one document);
nothing of the corpus is kept after it is yielded.
"""
from __future__ import annotations

import dataclasses
import glob
import gzip
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

__all__ = ["SOURCES", "Document", "Shard", "TextSource", "expand_paths", "is_validation"]

SOURCES = ("files", "jsonl", "parquet", "hf-disk")
ROW_BATCH = 256
"""Rows read at a time from Parquet and Arrow files."""


@dataclass(frozen=True)
class Document:
    key: str
    """Identity, stable across runs and machines (the validation split hashes it)."""
    text: str


@dataclass(frozen=True)
class Shard:
    """A piece of the corpus read alone: `TextSource.documents(shard)`."""

    index: int
    """Position in the corpus's order."""
    id: str
    """Stable id: 16 hex digits of sha256 over kind, relative paths and range."""
    kind: str
    paths: tuple[str, ...]
    """Absolute paths (files: several; the others: one)."""
    names: tuple[str, ...]
    """The same paths relative to the manifest's folder (identities are built from these)."""
    start: int = 0
    stop: int = 0
    """jsonl: byte range [start, stop); parquet: row groups [start, stop); files, hf-disk: unused."""
    size: int = 0
    """Bytes on disk this shard covers (for logs and sizing)."""


def _shard_id(kind: str, names: Sequence[str], start: int, stop: int) -> str:
    spec = json.dumps([kind, list(names), start, stop], separators=(",", ":"))
    return hashlib.sha256(spec.encode()).hexdigest()[:16]


def expand_paths(patterns: Sequence[str], base_dir: str | Path, want_dirs: bool = False) -> list[Path]:
    """Each entry of `data.paths` resolved against `base_dir`: a path, a directory (its files below,
    recursively; with `want_dirs` the directory itself) or a glob (``**`` recursive); sorted within
    each entry, duplicates dropped keeping the first.

    Raises:
        ValueError: an entry that matches nothing (naming it).
    """
    base = Path(base_dir or ".")
    out: dict[Path, None] = {}
    for pattern in patterns:
        p = Path(pattern).expanduser()
        p = p if p.is_absolute() else base / p
        if want_dirs:
            matches = [p] if p.is_dir() else sorted(Path(m) for m in glob.glob(str(p), recursive=True)
                                                    if Path(m).is_dir())
        elif p.is_file():
            matches = [p]
        elif p.is_dir():
            matches = sorted(f for f in p.rglob("*") if f.is_file())
        else:
            matches = sorted(Path(m) for m in glob.glob(str(p), recursive=True) if Path(m).is_file())
        if not matches:
            raise ValueError(f"data.paths entry {pattern!r} matches no {'folder' if want_dirs else 'file'} "
                             f"(relative to {base})")
        out.update(dict.fromkeys(m.absolute() for m in matches))
    return list(out)


def is_validation(key: str, val_fraction: float) -> bool:
    """Whether the document with identity `key` is held out: sha256 of the key mapped to [0, 1)
    is below `val_fraction`. The same on every machine, in every run, whatever else the corpus holds."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2.0**64
    return h < val_fraction


def _relative(path: Path, base: Path) -> str:
    try:
        return path.relative_to(base).as_posix()
    except ValueError:
        return path.as_posix()


class TextSource:
    """The documents of `data.source` over `data.paths`, listed as shards.

    Args:
        source: files | jsonl | parquet | hf-disk.
        paths: globs, files or folders (hf-disk: folders), relative to `base_dir`.
        text_field: the column or JSON key holding a document's text (not for files).
        shard_bytes: the target size of a shard on disk (files are grouped, JSON-lines files cut,
            Parquet row groups grouped up to it; an hf-disk shard is one Arrow file).
        files: instead of `paths`, these files in this order (the standard library's sources).
    """

    def __init__(self, source: str, paths: Sequence[str], base_dir: str | Path = "", text_field: str = "text",
                 shard_bytes: int = 64 << 20, files: Sequence[Path] | None = None) -> None:
        if source not in SOURCES:
            raise ValueError(f"data.source must be one of {', '.join(SOURCES)} here, got {source!r}")
        if shard_bytes < 1:
            raise ValueError(f"shard size must be >= 1 byte, got {shard_bytes}")
        self.source, self.text_field, self.shard_bytes = source, text_field, shard_bytes
        self.base = Path(base_dir or ".").absolute()
        if files is not None:
            found = [Path(f).absolute() for f in files]
        else:
            found = expand_paths(paths, self.base, want_dirs=source == "hf-disk")
        self.shards: list[Shard] = getattr(self, f"_list_{source.replace('-', '_')}")(found)

    def _make(self, paths: Sequence[Path], start: int = 0, stop: int = 0, size: int = 0) -> Shard:
        """A shard not yet numbered (`_numbered` gives the indices once the list is complete)."""
        names = tuple(_relative(p, self.base) for p in paths)
        return Shard(0, _shard_id(self.source, names, start, stop), self.source, tuple(str(p) for p in paths),
                     names, start, stop, size)

    def _numbered(self, shards: list[Shard]) -> list[Shard]:
        return [dataclasses.replace(s, index=i) for i, s in enumerate(shards)]

    def _list_files(self, found: list[Path]) -> list[Shard]:
        shards, group, size = [], [], 0
        for p in found:
            n = p.stat().st_size
            if group and size + n > self.shard_bytes:
                shards.append(self._make(group, size=size))
                group, size = [], 0
            group.append(p)
            size += n
        if group:
            shards.append(self._make(group, size=size))
        return self._numbered(shards)

    def _list_jsonl(self, found: list[Path]) -> list[Shard]:
        shards = []
        for p in found:
            n = p.stat().st_size
            if p.name.endswith(".gz"):  # no seeking into a gzip stream: the whole file is one shard
                shards.append(self._make([p], 0, 0, n))
                continue
            for start in range(0, max(n, 1), self.shard_bytes):
                stop = min(n, start + self.shard_bytes)
                shards.append(self._make([p], start, stop, stop - start))
        return self._numbered(shards)

    def _list_parquet(self, found: list[Path]) -> list[Shard]:
        pq = _pyarrow("parquet").parquet
        shards = []
        for p in found:
            meta = pq.ParquetFile(p).metadata
            first, size = 0, 0
            for g in range(meta.num_row_groups):
                n = meta.row_group(g).total_byte_size
                if g > first and size + n > self.shard_bytes:
                    shards.append(self._make([p], first, g, size))
                    first, size = g, 0
                size += n
            if meta.num_row_groups > first:
                shards.append(self._make([p], first, meta.num_row_groups, size))
        return self._numbered(shards)

    def _list_hf_disk(self, found: list[Path]) -> list[Shard]:
        shards = []
        for folder in found:
            if (folder / "dataset_dict.json").is_file():
                splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
                raise ValueError(f"data.paths: {folder} holds a DatasetDict (splits {splits}); name one split's "
                                 f"folder, e.g. {folder.name}/{splits[0] if splits else 'train'}")
            state = folder / "state.json"
            if not state.is_file():
                raise ValueError(f"data.paths: {folder} has no state.json: not a folder written by "
                                 "datasets' save_to_disk")
            for entry in json.loads(state.read_text()).get("_data_files", []):
                f = folder / entry["filename"]
                shards.append(self._make([f], size=f.stat().st_size))
        return self._numbered(shards)

    def documents(self, shard: Shard) -> Iterator[Document]:
        """The shard's documents in order, one at a time (see the module's note on memory)."""
        return getattr(self, f"_docs_{shard.kind.replace('-', '_')}")(shard)

    def _text(self, value: object, where: str) -> str:
        if not isinstance(value, str):
            raise ValueError(f"{where}: data.text_field {self.text_field!r} is {type(value).__name__}, not text")
        return value

    def _docs_files(self, shard: Shard) -> Iterator[Document]:
        for path, name in zip(shard.paths, shard.names):
            try:
                raw = Path(path).read_bytes()
            except OSError:  # vanished or unreadable: skipped, as the byte corpus does
                continue
            yield Document(name, raw.decode("utf-8", errors="replace"))

    def _docs_jsonl(self, shard: Shard) -> Iterator[Document]:
        path, name = shard.paths[0], shard.names[0]
        whole = path.endswith(".gz")
        with (gzip.open(path, "rb") if whole else open(path, "rb")) as f:
            if shard.start:  # the line in progress at `start` belongs to the shard before
                f.seek(shard.start - 1)
                f.readline()
            while True:
                offset = f.tell()  # of the decompressed text, for a gzip file
                if not whole and offset >= shard.stop:
                    return
                line = f.readline()
                if not line:
                    return
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{name}@{offset}: not a JSON line ({e})") from None
                if not isinstance(row, dict) or self.text_field not in row:
                    raise ValueError(f"{name}@{offset}: no field data.text_field = {self.text_field!r}")
                yield Document(f"{name}@{offset}", self._text(row[self.text_field], f"{name}@{offset}"))

    def _column(self, batch: object, where: str) -> list:
        names = batch.schema.names  # type: ignore[attr-defined]
        if self.text_field not in names:
            raise ValueError(f"{where}: no column data.text_field = {self.text_field!r} (columns: {', '.join(names)})")
        return batch.column(self.text_field).to_pylist()  # type: ignore[attr-defined]

    def _docs_parquet(self, shard: Shard) -> Iterator[Document]:
        pq = _pyarrow("parquet").parquet
        path, name = shard.paths[0], shard.names[0]
        pf = pq.ParquetFile(path)
        for g in range(shard.start, shard.stop):
            row = 0
            for batch in pf.iter_batches(batch_size=ROW_BATCH, row_groups=[g], columns=[self.text_field]):
                for text in self._column(batch, name):
                    if text is not None:
                        yield Document(f"{name}#{g}:{row}", self._text(text, f"{name}#{g}:{row}"))
                    row += 1

    def _docs_hf_disk(self, shard: Shard) -> Iterator[Document]:
        pa = _pyarrow("")
        path, name = shard.paths[0], shard.names[0]
        row = 0
        with pa.memory_map(path, "r") as source:
            reader = pa.ipc.open_stream(source)
            for batch in reader:
                for text in self._column(batch, name):
                    if text is not None:
                        yield Document(f"{name}#{row}", self._text(text, f"{name}#{row}"))
                    row += 1


def _pyarrow(submodule: str):  # noqa: ANN202 (a module)
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
        if submodule:
            import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ValueError("data.source parquet and hf-disk read with pyarrow: pip install 'swarmgrad[data]'") from None
    return pyarrow
