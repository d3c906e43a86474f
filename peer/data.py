"""Byte-level text data: corpora, train/validation split, and per-driver microbatch streams.

The default corpus is the ``.py`` source of the running interpreter's standard library: real
text that every peer already has, so a benchmark needs no download. The train/validation split
is by file, decided by a SHA-256 hash of the path relative to a root, so every machine with the
same Python gets the same split.

Without shards (``data.shards = 0``), a driver's shard *is* its seed. Each driver samples its own
random windows of the training corpus from a ``torch.Generator`` seeded with that seed; drivers
whose seeds differ (derived from their peer ids, say) see different data, and a driver restarted
with the same seed sees the same batches again. No coordination is needed, and nothing keeps two
drivers from training the same window. With ``data.shards = N`` the corpus is cut into N shards
that the drivers lease through the DHT instead (peer/shards/, docs/data.md).
"""

from __future__ import annotations

import glob
import hashlib
import math
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

__all__ = [
    "ByteCorpus",
    "MicrobatchStream",
    "bits_per_byte",
    "load_corpora",
    "split_train_val",
    "stdlib_python_files",
    "stdlib_root",
    "validation_batches",
]

Batch = tuple[torch.Tensor, torch.Tensor]

SEPARATOR = b"\n"
"""Put between files in a corpus, so that one file's last line does not run into the next."""

# Machine-specific or not part of the library proper: installed packages differ per machine,
# and _sysconfigdata_*.py / config-*/ record the build's paths and flags.
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_TEST_DIRS = {"test", "tests", "idle_test"}


def stdlib_root() -> Path:
    """The standard library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_python_files(include_tests: bool = True) -> list[Path]:
    """The ``.py`` files of the running interpreter's standard library, sorted by relative path.

    Excludes site-packages/dist-packages (they differ per machine) and build-specific files
    (``_sysconfigdata_*.py``, ``config-*/``). Test directories (``test/``, ``tests/``, ...) are
    included by default, being real code and about 60% of the bytes; some distributions (Debian's
    ``python3``) ship them separately, so pass ``include_tests=False`` for a corpus that is the
    same across such machines.
    """
    root = stdlib_root()
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):  # does not follow symlinked directories
        rel_dir = Path(dirpath).relative_to(root)
        dirnames[:] = [
            d for d in dirnames
            if d not in _EXCLUDED_DIRS
            and not (d.startswith("config-") and rel_dir == Path("."))
            and (include_tests or d not in _TEST_DIRS)
        ]
        for name in filenames:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                found.append(((rel_dir / name).as_posix(), Path(dirpath) / name))
    return [path for _, path in sorted(found)]


def _split_key(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return path.as_posix()


def split_train_val(
    paths: Sequence[Path | str], val_fraction: float = 0.05, root: Path | str | None = None
) -> tuple[list[Path], list[Path]]:
    """Split files into (train, val) by a stable hash of each path relative to ``root``.

    A file is in validation iff ``sha256(relative path)`` mapped to [0, 1) is below
    ``val_fraction``. ``root`` defaults to the common directory of ``paths``; pass
    ``stdlib_root()`` for the stdlib so the split does not depend on which files are listed.
    Order within each part follows ``paths``.

    Raises:
        ValueError: if ``val_fraction`` is not in (0, 1).
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
    ps = [Path(p) for p in paths]
    if not ps:
        return [], []
    absolute = [p.absolute() for p in ps]
    if root is not None:
        base = Path(root).absolute()
    elif len(absolute) == 1:
        base = absolute[0].parent
    else:
        base = Path(os.path.commonpath(absolute))
    train, val = [], []
    for p, a in zip(ps, absolute):
        key = _split_key(a, base).encode()
        h = int.from_bytes(hashlib.sha256(key).digest()[:8], "big") / 2.0**64
        (val if h < val_fraction else train).append(p)
    return train, val


@dataclass(frozen=True)
class ByteCorpus:
    """A corpus as one flat ``torch.uint8`` tensor of bytes (files joined by ``SEPARATOR``)."""

    data: torch.Tensor
    """1-D uint8 tensor."""
    n_files: int = 0
    """How many files went in (for logs)."""

    def __post_init__(self) -> None:
        if self.data.dtype != torch.uint8 or self.data.dim() != 1:
            raise ValueError(
                f"ByteCorpus.data must be a 1-D uint8 tensor, got {self.data.dtype} {tuple(self.data.shape)}"
            )

    def __len__(self) -> int:
        return self.data.numel()

    @classmethod
    def from_bytes(cls, raw: bytes, n_files: int = 0) -> ByteCorpus:
        """A corpus holding a copy of ``raw`` (handy for tests and in-memory text)."""
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return cls(data, n_files)

    @classmethod
    def from_files(cls, paths: Sequence[Path | str], max_bytes: int | None = None) -> ByteCorpus:
        """Read ``paths`` in order as raw bytes, joined by ``SEPARATOR``.

        Unreadable files (permissions, vanished) are skipped. With ``max_bytes``, files are taken
        in order until the cap and the result is cut to exactly ``max_bytes``: deterministic, and
        memory stays bounded.
        """
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"data.max_bytes must be >= 0, got {max_bytes}")
        buf = bytearray()
        n_files = 0
        for p in paths:
            if max_bytes is not None and len(buf) >= max_bytes:
                break
            try:
                raw = Path(p).read_bytes()
            except OSError:
                continue
            if n_files:
                buf += SEPARATOR
            buf += raw
            n_files += 1
        if max_bytes is not None:
            del buf[max_bytes:]
        data = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
        return cls(data, n_files)


class MicrobatchStream:
    """Endless ``(inputs, targets)`` microbatches of random windows from a corpus.

    ``inputs`` and ``targets`` are int64 ``[batch_size, seq_len]``; ``targets`` is ``inputs``
    shifted by one byte (the next byte at each position). Windows start uniformly at random,
    drawn from this stream's own ``torch.Generator(seed)``: the same seed gives the same
    batches, and the global RNG is untouched.

    Raises:
        ValueError: if the corpus is shorter than ``seq_len + 1`` bytes or sizes are not positive.
    """

    def __init__(self, corpus: ByteCorpus, seq_len: int, batch_size: int, seed: int) -> None:
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
        if len(corpus) < seq_len + 1:
            raise ValueError(
                f"corpus has {len(corpus)} bytes, too few for windows of seq_len+1={seq_len + 1}; "
                "add data (data.paths) or raise data.max_bytes"
            )
        self.corpus = corpus
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.batches_drawn = 0
        self._gen = torch.Generator(device="cpu")
        self._gen.manual_seed(seed)
        self._offsets = torch.arange(seq_len + 1)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return self.draw(self.batch_size)

    def draw(self, size: int) -> Batch:
        """The next microbatch, of `size` windows (a tapered step's: inner.microbatch_sizes). The
        windows come from the stream's one generator in order, so any sizes give the same sequence
        of windows cut differently."""
        if size < 1:
            raise ValueError(f"a microbatch needs >= 1 window, got {size}")
        n_starts = len(self.corpus) - self.seq_len  # a window needs seq_len + 1 bytes
        starts = torch.randint(0, n_starts, (size, 1), generator=self._gen)
        self.batches_drawn += 1
        return _windows(self.corpus, starts + self._offsets)


def _windows(corpus: ByteCorpus, idx: torch.Tensor) -> Batch:
    chunk = corpus.data[idx].long()
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


def validation_batches(
    corpus: ByteCorpus, seq_len: int, batch_size: int, n_batches: int, seed: int = 0
) -> list[Batch]:
    """A fixed list of ``n_batches`` microbatches for evaluation (same args -> same batches)."""
    stream = MicrobatchStream(corpus, seq_len, batch_size, seed)
    return [next(stream) for _ in range(n_batches)]


def bits_per_byte(mean_loss_nats: float) -> float:
    """Convert a mean per-byte cross entropy in nats to bits per byte."""
    return mean_loss_nats / math.log(2)


def _expand_paths(patterns: Sequence[str]) -> list[Path]:
    """Files named directly, by glob pattern (``**`` recursive), or as directories (all files
    below, recursively). Sorted within each entry; duplicates dropped keeping the first."""
    out: dict[Path, None] = {}
    for pattern in patterns:
        p = Path(pattern).expanduser()
        if p.is_file():
            matches = [p]
        elif p.is_dir():
            matches = sorted(f for f in p.rglob("*") if f.is_file())
        else:
            matches = sorted(Path(m) for m in glob.glob(str(p), recursive=True) if Path(m).is_file())
        if not matches:
            raise ValueError(f"data.paths entry {pattern!r} matches no file")
        out.update(dict.fromkeys(matches))
    return list(out)


def load_corpora(
    source: str = "stdlib",
    paths: Sequence[str] = (),
    val_fraction: float = 0.05,
    max_bytes: int | None = None,
) -> tuple[ByteCorpus, ByteCorpus]:
    """Load (train, val) corpora.

    Args:
        source: ``"stdlib"`` (the interpreter's standard library, see ``stdlib_python_files``)
            or ``"files"`` (``paths``).
        paths: for ``"files"``: files, directories or glob patterns.
        val_fraction: share of files held out for validation (split by path hash).
        max_bytes: cap on each corpus's size in bytes (train and val separately); ``None`` or
            0 means no cap (0 is the manifest's "unset").

    With ``"files"``, if the per-file split leaves one side empty (say, a single file), the
    concatenated bytes are split instead: the last ``val_fraction`` goes to validation.

    Raises:
        ValueError: on an unknown source, an empty ``paths`` for ``"files"`` or a non-empty one
            for ``"stdlib"`` (naming ``data.paths``), or an entry that matches no file.
    """
    if not max_bytes:
        max_bytes = None
    if source == "stdlib":
        if paths:
            raise ValueError('data.paths is only used with data.source = "files"; remove it or change the source')
        train_paths, val_paths = split_train_val(stdlib_python_files(), val_fraction, root=stdlib_root())
    elif source == "files":
        if not paths:
            raise ValueError('data.paths is empty: data.source = "files" needs at least one file or glob')
        files = _expand_paths(paths)
        train_paths, val_paths = split_train_val(files, val_fraction)
        if not train_paths or not val_paths:
            whole = ByteCorpus.from_files(files)
            cut = len(whole) - max(1, int(len(whole) * val_fraction))
            train = ByteCorpus(whole.data[:cut].clone(), whole.n_files)
            val = ByteCorpus(whole.data[cut:].clone(), whole.n_files)
            if max_bytes is not None:
                train, val = (ByteCorpus(c.data[:max_bytes].clone(), c.n_files) for c in (train, val))
            return train, val
    else:
        raise ValueError(f'data.source must be "stdlib" or "files", got {source!r}')
    return ByteCorpus.from_files(train_paths, max_bytes), ByteCorpus.from_files(val_paths, max_bytes)
