"""A tokenized corpus: shards of documents → token windows, the validation split by document, and
the driver's stream of training microbatches.

The unit of work is the shard (peer/text/sources.py): `TokenCorpus.shard_windows(shard)` yields the
shard's training windows (its documents outside validation, tokenized and packed:
peer/text/packing.py), the same windows on every machine. A driver's `TokenStream` walks shards in
an order it is given: by default each pass over the corpus (an epoch) is a permutation of the
shards drawn from the driver's seed, so drivers with different seeds start on different shards;
a driver that leases its shards from the swarm hands the stream an iterator of the shards it
holds instead (``shards=``), and reads `TokenStream.position` to report what it finished.

Memory is bounded by one shard reader's (sources.py), `ENCODE_BATCH` documents being tokenized and
the packer's carry-over (packing.py); no corpus-sized structure exists anywhere.
"""
from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

from swarmgrad.peer.text.packing import pack_windows
from swarmgrad.peer.text.sources import Document, Shard, TextSource, is_validation
from swarmgrad.peer.text.tokenizer import TextTokenizer

__all__ = ["ENCODE_BATCH", "StreamPosition", "TokenCorpus", "TokenStream", "ValidationSet"]

ENCODE_BATCH = 64
"""Documents tokenized at once (a BPE tokenizer spreads a batch over its threads)."""

Batch = tuple[torch.Tensor, torch.Tensor]


def _batched(docs: Iterator[Document], n: int) -> Iterator[list[Document]]:
    while chunk := list(itertools.islice(docs, n)):
        yield chunk


class TokenCorpus:
    """`source`'s documents tokenized with `tokenizer` into windows of ``seq_len + 1`` tokens.

    A document is in validation iff `is_validation(doc.key, val_fraction)`; training windows never
    hold a validation document's token and validation windows never a training one's.
    """

    def __init__(self, source: TextSource, tokenizer: TextTokenizer, seq_len: int, val_fraction: float) -> None:
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
        self.source, self.tokenizer, self.seq_len, self.val_fraction = source, tokenizer, seq_len, val_fraction

    @property
    def shards(self) -> list[Shard]:
        return self.source.shards

    def documents(self, shard: Shard, validation: bool = False) -> Iterator[Document]:
        """The shard's documents of one side of the split."""
        return (d for d in self.source.documents(shard) if is_validation(d.key, self.val_fraction) == validation)

    def token_docs(self, shard: Shard, validation: bool = False) -> Iterator[list[int]]:
        encode_batch = getattr(self.tokenizer, "encode_batch", None)
        for chunk in _batched(self.documents(shard, validation), ENCODE_BATCH):
            texts = [d.text for d in chunk]
            yield from (encode_batch(texts) if encode_batch else map(self.tokenizer.encode, texts))

    def shard_windows(self, shard: Shard, validation: bool = False) -> Iterator[torch.Tensor]:
        """The shard's windows in order: int64 tensors of ``seq_len + 1`` tokens."""
        for w in pack_windows(self.token_docs(shard, validation), self.seq_len, self.tokenizer.eod_id):
            yield torch.tensor(w, dtype=torch.long)

    def validation(self, n_windows: int) -> ValidationSet:
        """The first `n_windows` windows of the validation documents, shards in corpus order (each
        shard's validation documents packed alone). A corpus with fewer repeats them.

        Raises:
            ValueError: no document fell in validation (say how many were read and what to change).
        """
        windows: list[torch.Tensor] = []
        for shard in self.shards:
            windows.extend(itertools.islice(self.shard_windows(shard, validation=True), n_windows - len(windows)))
            if len(windows) >= n_windows:
                break
        if not windows:
            raise ValueError(f"data: no document of the {len(self.shards)} shard(s) fell in validation "
                             f"(data.val_fraction = {self.val_fraction}); a files source holds one document per "
                             "file: add files, split the text into more documents (jsonl), or raise data.val_fraction")
        windows = list(itertools.islice(itertools.cycle(windows), n_windows))
        token_bytes = self.tokenizer.token_bytes()
        n_bytes = sum(token_bytes[t] for w in windows for t in w[1:].tolist())
        return ValidationSet(windows, tokens=len(windows) * self.seq_len, bytes=n_bytes)


@dataclass
class ValidationSet:
    windows: list[torch.Tensor]
    tokens: int
    """Target tokens of all windows."""
    bytes: int
    """UTF-8 bytes of text those target tokens stand for (special tokens count none): bits per byte's denominator."""

    def batches(self, batch_size: int) -> list[Batch]:
        out = []
        for i in range(0, len(self.windows), batch_size):
            w = torch.stack(self.windows[i:i + batch_size])
            out.append((w[:, :-1].contiguous(), w[:, 1:].contiguous()))
        return out


@dataclass
class StreamPosition:
    """Where a `TokenStream` is: for a driver to report (and later resume) its data position."""
    epoch: int = 0
    shard: Shard | None = None
    windows_in_shard: int = 0
    """Windows drawn from `shard` so far."""
    shards_done: list[str] = field(default_factory=list)
    """Ids of the shards drawn to their end in this epoch, in order."""


class TokenStream:
    """Endless training microbatches from a `TokenCorpus`, the driver's `stream` (``draw(size)``).

    Windows come in order from one shard after another. `shards`: an iterable of the shards to read
    (a lease-holding driver's); by default every epoch is a permutation of the corpus's shards drawn
    from a generator seeded by a hash of (seed, epoch), forever. Same seed, same batches.

    Raises (from `draw`):
        ValueError: a whole pass over the shards yielded no training window.
    """

    def __init__(self, corpus: TokenCorpus, batch_size: int, seed: int, shards: Iterable[Shard] | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.corpus, self.batch_size, self.seed = corpus, batch_size, seed
        self.batches_drawn = 0
        self.position = StreamPosition()
        self._windows = self._all_windows(shards)

    def _epochs(self) -> Iterator[tuple[int, list[Shard]]]:
        shards = self.corpus.shards
        for epoch in itertools.count():
            # hashed, not seed + epoch: another driver's seed must not replay this one's next epoch
            gen = torch.Generator().manual_seed(int.from_bytes(
                hashlib.sha256(f"{self.seed}:{epoch}".encode()).digest()[:8], "big") >> 1)
            yield epoch, [shards[i] for i in torch.randperm(len(shards), generator=gen).tolist()]

    def _all_windows(self, shards: Iterable[Shard] | None) -> Iterator[torch.Tensor]:
        passes = self._epochs() if shards is None else iter([(0, shards)])
        for epoch, order in passes:
            pos = self.position
            if epoch != pos.epoch:
                pos.epoch, pos.shards_done = epoch, []
            found = False
            for shard in order:
                pos.shard, pos.windows_in_shard = shard, 0
                for w in self.corpus.shard_windows(shard):
                    pos.windows_in_shard += 1
                    found = True
                    yield w
                pos.shards_done.append(shard.id)
            if not found:
                raise ValueError(f"data: a pass over {len(self.corpus.shards)} shard(s) gave no training window "
                                 "(every document in validation, or the corpus is empty)")

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> Batch:
        return self.draw(self.batch_size)

    def draw(self, size: int) -> Batch:
        """The next `size` windows as (inputs, targets), int64 ``[size, seq_len]``."""
        if size < 1:
            raise ValueError(f"a microbatch needs >= 1 window, got {size}")
        rows = list(itertools.islice(self._windows, size))
        if not rows:
            raise ValueError("data: the shards this stream was given are exhausted")
        w = torch.stack(rows)
        if w.shape[0] < size:  # a leased iterator ran out: repeat what we have rather than a short batch
            w = w.repeat((size + w.shape[0] - 1) // w.shape[0], 1)[:size]
        self.batches_drawn += 1
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()
