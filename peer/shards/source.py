"""What the lease machinery needs from a corpus: an ordered list of shards with stable ids, each
yielding its training windows in a fixed order.

A window is a 1-D int64 tensor of `seq_len + 1` tokens: a microbatch's inputs are its first
`seq_len`, its targets its last `seq_len`. A shard's windows come out in the same order on every
peer and every time (`windows(shard_id, start)` skips the first `start`), so a driver taking over
a shard another one left half-trained continues at the window where that one stopped. A source
with real text (tokenized documents packed into windows) provides the same two methods; this
module's `ByteShards` cuts today's byte-level corpus (peer/data.py).
"""
from __future__ import annotations

import hashlib
import itertools
from typing import Any, Iterator, Protocol, runtime_checkable

import torch

from swarmgrad.peer.data import ByteCorpus

__all__ = ["ByteShards", "ShardSource", "TextShards", "Window"]

Window = torch.Tensor
"""int64 [seq_len + 1]."""


@runtime_checkable
class ShardSource(Protocol):
    """An ordered list of shards, each an ordered, finite list of windows.

    Contract (every driver of a run must see the same thing, the lease records name shards by
    their index in `shard_ids()`):
    - `shard_ids()` is the same list, in the same order, on every peer with the same manifest;
    - `windows(shard_id, start, epoch)` yields the shard's windows in `epoch` from index `start`
      on, in an order that depends only on the manifest and the epoch (not on the peer, nor on the
      time); it ends when the shard does (a `start` past the end yields nothing);
    - every window has `seq_len + 1` tokens.
    """

    def shard_ids(self) -> list[str]: ...

    def windows(self, shard_id: str, start: int = 0, epoch: int = 0) -> Iterator[Window]: ...


def _permutation(n: int, *salt: object) -> torch.Tensor:
    digest = hashlib.sha256("/".join(str(s) for s in salt).encode()).digest()
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int.from_bytes(digest[:8], "big") & (2**63 - 1))
    return torch.randperm(n, generator=gen)


class ByteShards:
    """A byte corpus cut into `n_shards` contiguous ranges of non-overlapping windows.

    The corpus's windows are `data[i·seq_len : i·seq_len + seq_len + 1]` for i in [0, W) with
    W = (len − 1) // seq_len: each byte is a target exactly once per epoch. Shard k holds windows
    [k·W // n, (k+1)·W // n), yielded in an order shuffled by (seed, epoch, shard), so a microbatch
    mixes far-apart text, and the same on every peer.

    Raises:
        ValueError: if the corpus has fewer windows than shards.
    """

    def __init__(self, corpus: ByteCorpus, n_shards: int, seq_len: int, seed: int = 0) -> None:
        if n_shards < 1 or seq_len < 1:
            raise ValueError(f"n_shards and seq_len must be >= 1 (got {n_shards}, {seq_len})")
        self.corpus = corpus
        self.seq_len = seq_len
        self.seed = seed
        self.n_windows = max(0, (len(corpus) - 1) // seq_len)
        if self.n_windows < n_shards:
            raise ValueError(f"the training corpus has {self.n_windows} windows of {seq_len + 1} bytes, fewer than "
                             f"data.shards = {n_shards}: lower data.shards or add data")
        self._bounds = [k * self.n_windows // n_shards for k in range(n_shards + 1)]
        self._ids = [f"bytes-{k:05d}-of-{n_shards:05d}" for k in range(n_shards)]
        self._index = {sid: k for k, sid in enumerate(self._ids)}
        self._offsets = torch.arange(seq_len + 1)

    def shard_ids(self) -> list[str]:
        return list(self._ids)

    def shard_windows(self, shard_id: str) -> int:
        """How many windows the shard holds."""
        k = self._index[shard_id]
        return self._bounds[k + 1] - self._bounds[k]

    def windows(self, shard_id: str, start: int = 0, epoch: int = 0) -> Iterator[Window]:
        if shard_id not in self._index:
            raise KeyError(f"no shard {shard_id!r} in this corpus")
        k = self._index[shard_id]
        lo, n = self._bounds[k], self.shard_windows(shard_id)
        order = _permutation(n, self.seed, epoch, shard_id)
        for i in range(max(0, start), n):
            first = (lo + int(order[i])) * self.seq_len
            yield self.corpus.data[first + self._offsets].long()


class TextShards:
    """The streaming path's corpus (peer/text/: `TokenCorpus`) as a shard source: its shards, by
    their stable ids in corpus order, each shard's training windows in the order
    `TokenStream.window_order` gives them in the epoch (shuffled by (epoch, shard id) alone, so
    every driver reads a shard alike). The windows are read and tokenized as they are taken."""

    def __init__(self, corpus: Any, stream: Any) -> None:
        self.corpus, self.stream = corpus, stream
        self._shards = {shard.id: shard for shard in corpus.shards}

    def shard_ids(self) -> list[str]:
        return [shard.id for shard in self.corpus.shards]

    def windows(self, shard_id: str, start: int = 0, epoch: int = 0) -> Iterator[Window]:
        return itertools.islice(self.stream.window_order(self._shards[shard_id], epoch), max(0, start), None)
