"""Packing documents' tokens into training windows.

A shard's documents, in order, each followed by the end-of-document id, form one token stream:
``doc₁ EOD doc₂ EOD … docₙ EOD``. It is cut into windows of ``seq_len + 1`` tokens with a stride of
``seq_len`` (a window's inputs are its first ``seq_len`` tokens, its targets the last ``seq_len``),
so consecutive windows share one token and every token of the stream after the first is a target
exactly once: no token is lost and none is predicted twice. Documents run across windows (no
padding: every position trains).

The stream's end rarely falls on a window's end: the last window is completed with the stream's
first tokens (the stream is read as a cycle, ``… docₙ EOD doc₁ …``), so every window has exactly
``seq_len`` positions and the shard's last tokens are still trained; at most ``seq_len`` tokens of
the shard's start are seen twice per pass. A shard shorter than one window repeats to fill it.

Memory: the packer holds the current document's tokens plus at most ``seq_len`` carried over, and the
stream's first ``seq_len + 1`` tokens for the wrap.
"""
from __future__ import annotations

import itertools
from typing import Iterable, Iterator, Sequence

__all__ = ["pack_windows"]


def pack_windows(token_docs: Iterable[Sequence[int]], seq_len: int, eod_id: int) -> Iterator[list[int]]:
    """Windows of exactly ``seq_len + 1`` tokens (see the module's docstring); none for no documents.

    Raises:
        ValueError: ``seq_len`` < 1.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    width = seq_len + 1
    buf: list[int] = []
    head: list[int] = []
    emitted = False
    for doc in token_docs:
        buf.extend(doc)
        buf.append(eod_id)
        if len(head) < width:
            head = (head + list(doc) + [eod_id])[:width]
        pos = 0
        while len(buf) - pos >= width:
            yield buf[pos:pos + width]
            pos += seq_len
            emitted = True
        if pos:
            del buf[:pos]
    # buf now holds the last window's final token (already a target) and the tokens after it
    if head and (len(buf) > 1 or not emitted):
        yield list(itertools.islice(itertools.chain(buf, itertools.cycle(head)), width))
