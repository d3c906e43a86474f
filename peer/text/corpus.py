"""A tokenized corpus: shards of documents → token windows, the validation split by document, and
the driver's stream of training microbatches.

The unit of work is the shard (peer/text/sources.py): `TokenCorpus.shard_windows(shard)` yields the
shard's training windows (its documents outside validation, tokenized and packed:
peer/text/packing.py), the same windows on every machine. A driver's `TokenStream` walks shards in
an order it is given: by default each pass over the corpus (an epoch) is a permutation of the
shards drawn from the driver's seed, so drivers with different seeds start on different shards;
a driver that leases its shards from the swarm hands the stream an iterator of the shards it
holds instead (``shards=``), and reads `TokenStream.position` to report what it finished.

Memory is bounded by one shard reader's (sources.py), `ENCODE_BATCH` documents being tokenized, the
packer's carry-over (packing.py), a stream's shuffle buffer (`SHUFFLE_WINDOWS`) and its read-ahead;
no corpus-sized structure exists anywhere.
"""
from __future__ import annotations

import hashlib
import itertools
import queue
import random
import threading
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

from swarmgrad.peer.text.packing import pack_windows
from swarmgrad.peer.text.sources import Document, Shard, TextSource, is_validation
from swarmgrad.peer.text.tokenizer import TextTokenizer

__all__ = ["ENCODE_BATCH", "StreamPosition", "TokenCorpus", "TokenStream", "ValidationSet"]

ENCODE_BATCH = 64
"""Documents tokenized at once (a BPE tokenizer spreads a batch over its threads)."""
SHUFFLE_WINDOWS = 1024
"""A driver's shuffle buffer within a shard, in windows (at seq_len 2048, 16 MiB of int64)."""

Batch = tuple[torch.Tensor, torch.Tensor]


def _batched(docs: Iterator[Document], n: int) -> Iterator[list[Document]]:
    """Chunks of 1, 2, 4, … up to `n` documents: the first windows come after one document's
    tokenization, not `n` documents' (a validation set of a few windows, a driver's first batch)."""
    size = 1
    while chunk := list(itertools.islice(docs, size)):
        yield chunk
        size = min(n, 2 * size)


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
            texts = [d.text for d in chunk if d.text]  # an empty document would only add an end-of-document
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
    """Where a `TokenStream`'s consumer is (what was drawn, not what was read ahead): for a driver to
    report, and later resume, its data position."""
    epoch: int = 0
    shard: Shard | None = None
    windows_in_shard: int = 0
    """Windows drawn from `shard` so far."""
    shards_done: list[str] = field(default_factory=list)
    """Ids of the shards drawn to their end in this epoch, in order (a shard with no training window
    counts once the stream passes it)."""


@dataclass(frozen=True)
class _Item:
    epoch: int
    shard: Shard
    window: torch.Tensor | None
    """None: a shard without a training window (or none after the skipped ones), passed."""
    last: bool
    """The shard's last window."""
    drawn: int
    """Windows of the shard drawn once this item is (skipped ones included)."""


_END = object()


class TokenStream:
    """Endless training microbatches from a `TokenCorpus`, the driver's `stream` (``draw(size)``).

    Windows come from one shard after another, each shard's in `window_order` (a shuffle buffer of
    `shuffle` windows; 0 or 1: in order). `shards`: an iterable of the shards to read in `epoch` (a
    lease-holding driver's), each a `Shard` or ``(Shard, k)`` to skip its first k windows (a shard
    taken over part-way); by default every epoch is a permutation of the corpus's shards drawn from
    a generator seeded by a hash of (seed, epoch), forever. Same seed, same batches.

    `prefetch` > 0 reads and tokenizes on a thread of the stream's own, up to that many windows
    ahead, so a driver's event loop does not wait for the tokenizer (a batch of long documents takes
    a large part of a second); `close` stops it. The windows and their order are the same either way.

    Raises (from `draw`):
        ValueError: a whole pass over the shards yielded no training window; a given shard iterator
            is exhausted.
    """

    def __init__(self, corpus: TokenCorpus, batch_size: int, seed: int,
                 shards: Iterable[Shard | tuple[Shard, int]] | None = None, epoch: int = 0,
                 prefetch: int = 0, shuffle: int = SHUFFLE_WINDOWS) -> None:
        if batch_size < 1 or prefetch < 0 or shuffle < 0:
            raise ValueError(f"batch_size must be >= 1, prefetch and shuffle >= 0, got {batch_size}, {prefetch}, "
                             f"{shuffle}")
        self.corpus, self.batch_size, self.seed, self.shuffle = corpus, batch_size, seed, shuffle
        self.batches_drawn = 0
        self.position = StreamPosition()
        self._items = self._all_items(shards, epoch)
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if prefetch:
            self._queue = queue.Queue(maxsize=prefetch)
            self._thread = threading.Thread(target=self._produce, name="token-stream", daemon=True)
            self._thread.start()

    def _epochs(self) -> Iterator[tuple[int, list[Shard]]]:
        shards = self.corpus.shards
        for epoch in itertools.count():
            # hashed, not seed + epoch: another driver's seed must not replay this one's next epoch
            gen = torch.Generator().manual_seed(int.from_bytes(
                hashlib.sha256(f"{self.seed}:{epoch}".encode()).digest()[:8], "big") >> 1)
            yield epoch, [shards[i] for i in torch.randperm(len(shards), generator=gen).tolist()]

    def _all_items(self, shards: Iterable[Shard | tuple[Shard, int]] | None, given_epoch: int) -> Iterator[_Item]:
        passes = self._epochs() if shards is None else iter([(given_epoch, shards)])
        for epoch, order in passes:
            found = False
            for entry in order:
                shard, skip = (entry, 0) if isinstance(entry, Shard) else entry
                windows = itertools.islice(self.window_order(shard, epoch), skip, None)
                w = next(windows, None)
                if w is None:
                    yield _Item(epoch, shard, None, True, skip)
                    continue
                found = True
                k = skip
                for following in windows:  # one ahead, to tag the shard's last window
                    k += 1
                    yield _Item(epoch, shard, w, False, k)
                    w = following
                yield _Item(epoch, shard, w, True, k + 1)
            if not found and shards is None:
                raise ValueError(f"data: a pass over {len(self.corpus.shards)} shard(s) gave no training window "
                                 "(every document in validation, or the corpus is empty)")

    def window_order(self, shard: Shard, epoch: int = 0) -> Iterator[torch.Tensor]:
        """The shard's training windows in the order this stream draws them in `epoch`: through a
        shuffle buffer of `self.shuffle` windows (a window leaves it for a random one that comes in;
        the rest, shuffled, at the shard's end), so a microbatch's windows come from across the shard
        rather than one document's consecutive windows. Seeded by (epoch, shard id) alone, not by the
        driver: whoever reads a shard in an epoch draws the same windows in the same order, so a
        driver that takes a shard over may skip the windows its previous holder drew."""
        windows = self.corpus.shard_windows(shard)
        if self.shuffle <= 1:
            yield from windows
            return
        rng = random.Random(f"{epoch}:{shard.id}")  # a str seed is hashed (sha512): the same on every machine
        buf: list[torch.Tensor] = []
        for w in windows:
            if len(buf) < self.shuffle:
                buf.append(w)
                continue
            i = rng.randrange(self.shuffle)
            yield buf[i]
            buf[i] = w
        rng.shuffle(buf)
        yield from buf

    def _produce(self) -> None:
        assert self._queue is not None
        try:
            for item in self._items:
                if not self._put(item):
                    return
        except Exception as e:  # handed to the consumer, raised by its draw
            self._put(e)
            return
        self._put(_END)

    def _put(self, item: object) -> bool:
        assert self._queue is not None
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _next(self) -> _Item | None:
        if self._stop.is_set():
            raise ValueError("data: the token stream is closed")
        if self._queue is None:
            return next(self._items, None)
        while True:
            try:
                item = self._queue.get(timeout=0.1)
                break
            except queue.Empty:
                if self._stop.is_set():
                    raise ValueError("data: the token stream is closed") from None
        if item is _END or isinstance(item, Exception):
            self._queue.put(item)  # the producer has stopped: every later draw sees it too
            if isinstance(item, Exception):
                raise item
            return None
        return item  # type: ignore[return-value]

    def close(self) -> None:
        """Stop the prefetching thread (if any) and wait for it; the stream draws nothing after."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> Batch:
        return self.draw(self.batch_size)

    def draw(self, size: int) -> Batch:
        """The next `size` windows as (inputs, targets), int64 ``[size, seq_len]``."""
        if size < 1:
            raise ValueError(f"a microbatch needs >= 1 window, got {size}")
        rows: list[torch.Tensor] = []
        pos = self.position
        while len(rows) < size and (item := self._next()) is not None:
            if item.epoch != pos.epoch:
                pos.epoch, pos.shards_done, pos.shard = item.epoch, [], None
            pos.shard, pos.windows_in_shard = item.shard, item.drawn
            if item.window is not None:
                rows.append(item.window)
            if item.last:
                pos.shards_done.append(item.shard.id)
        if not rows:
            raise ValueError("data: the shards this stream was given are exhausted")
        w = torch.stack(rows)
        if w.shape[0] < size:  # a given shard iterator ran out: repeat what we have rather than a short batch
            w = w.repeat((size + w.shape[0] - 1) // w.shape[0], 1)[:size]
        self.batches_drawn += 1
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()
