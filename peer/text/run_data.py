"""A run's data as a driver uses it, from the manifest's `[data]`: the training stream, the fixed
validation batches and what they count (target tokens, bytes of text) for the evaluation units.

Two paths. The byte-level one (peer/data.py: random windows of the standard library's or the
files' bytes, split by file) is what a manifest that names no tokenizer and a `stdlib` or `files`
source gets, unchanged. A manifest that names a tokenizer, or a row source (jsonl, parquet,
hf-disk), gets the streaming path (peer/text/: shards, packing, split by document).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Union

import torch

from swarmgrad.peer.data import (MicrobatchStream, load_corpora, stdlib_python_files, stdlib_root,
                                 validation_batches)
from swarmgrad.peer.manifest import DataConfig, Manifest
from swarmgrad.peer.text.corpus import TokenCorpus, TokenStream
from swarmgrad.peer.text.sources import Shard, TextSource
from swarmgrad.peer.text.tokenizer import ByteTokenizer, TextTokenizer, verify_tokenizer

__all__ = ["RunData", "load_run_data", "run_tokenizer", "text_corpus", "uses_text_pipeline"]

Batch = tuple[torch.Tensor, torch.Tensor]


PREFETCH_BATCHES = 8
"""Microbatches a driver's token stream reads ahead on its thread (the event loop never tokenizes)."""


def uses_text_pipeline(d: DataConfig) -> bool:
    """Whether `[data]` is read through the streaming path (a tokenizer, or a row source)."""
    return bool(d.tokenizer) or d.source in ("jsonl", "parquet", "hf-disk")


def run_tokenizer(m: Manifest) -> TextTokenizer:
    """The run's tokenizer, checked against the manifest (TokenizerMismatch: one line)."""
    return verify_tokenizer(m.data.tokenizer, m.data.tokenizer_sha256,
                            None if m.model.kind == "entry_point" else m.model.vocab_size)


def text_corpus(m: Manifest, tokenizer: TextTokenizer | None = None) -> TokenCorpus:
    """The manifest's corpus on the streaming path, its shards listed (no text read yet)."""
    d = m.data
    shard_bytes = max(1, int(d.shard_mb * (1 << 20)))
    if d.source == "stdlib":
        source = TextSource("files", (), stdlib_root(), shard_bytes=shard_bytes, files=stdlib_python_files())
    else:
        source = TextSource(d.source, d.paths, d.base_dir, d.text_field, shard_bytes)
    return TokenCorpus(source, tokenizer or run_tokenizer(m), m.model.seq_len, d.val_fraction)


@dataclass
class RunData:
    stream: Union[MicrobatchStream, TokenStream]
    """What the driver draws training microbatches from (``draw(size)``); `close` it when done."""
    validation: list[Batch]
    val_tokens: int
    """Target tokens of the validation batches."""
    val_bytes: int
    """Bytes of text those tokens stand for (bits per byte's denominator)."""
    tokenizer: TextTokenizer
    corpus: TokenCorpus | None = None
    """The streaming path's corpus (its shards); None on the byte-level path."""

    def close(self) -> None:
        """Stop the stream's reading thread (the streaming path's); idempotent."""
        if isinstance(self.stream, TokenStream):
            self.stream.close()


def load_run_data(m: Manifest, seed: int, shards: Iterable[Shard | tuple[Shard, int]] | None = None,
                  epoch: int = 0) -> RunData:
    """Everything a driver with data seed `seed` reads (blocking I/O: call it off the event loop).

    `shards`: on the streaming path, the shards this driver reads in `epoch` (a lease-holding
    driver's iterator; ``(shard, k)`` skips its first k windows: TokenStream); None: the whole
    corpus, epoch after epoch, in an order drawn from `seed`.
    """
    d, batch = m.data, m.inner.microbatch_size
    if not uses_text_pipeline(d):
        paths = [str(Path(d.base_dir or ".") / p) for p in d.paths]  # relative to the manifest's folder
        train, val = load_corpora(d.source, paths, d.val_fraction, d.max_bytes or None)
        stream = MicrobatchStream(train, m.model.seq_len, batch, seed)
        val_batches = validation_batches(val, m.model.seq_len, batch, d.eval_batches, seed=m.seed)
        tokens = sum(t.numel() for _, t in val_batches)
        return RunData(stream, val_batches, tokens, tokens, ByteTokenizer())
    corpus = text_corpus(m)
    val = corpus.validation(d.eval_batches * batch)
    stream = TokenStream(corpus, batch, seed, shards, epoch, prefetch=PREFETCH_BATCHES * batch)
    return RunData(stream, val.batches(batch), val.tokens, val.bytes, corpus.tokenizer, corpus)
