"""Reusable output buffers owned by one codec object: :class:`Workspace`.

Why: a fresh multi-megabyte allocation comes from ``mmap``, and every 4 KiB page of it faults
on first write. On our 2-core machine first-touching 64 MB takes ~30 ms, five times what int8
needs to quantise into a warm buffer; encoding into fresh buffers and then copying them into
``bytes`` spent most of an int8 encode that way. A workspace keeps its buffers between calls.

Safety rule: the workspace never writes into memory anyone else can still see. A buffer lent
out (:meth:`Workspace.lend`, a read-only memoryview inside a borrowed :class:`Encoded`) is
reused only once every view of it is gone; while one is alive, the next claim forgets the
buffers (their holders keep them) and allocates new ones. So a borrowed Encoded stays valid
for as long as it is referenced, and no call ever sees another call's data.

Not global state: each codec object owns its workspace; copies and pickles of a codec start
with an empty one.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch

__all__ = ["Workspace", "fresh", "scratch"]


class Workspace:
    """Named, growable scratch buffers for one codec object.

    Use inside :meth:`claim`; a thread that finds the workspace claimed by another thread gets
    ``None`` and allocates its own buffers (:func:`scratch`), so a codec object stays safe to
    share between threads. Memory held: the largest request seen per name (int8: n + 4n/B
    bytes of codes and scales for the largest tensor encoded so far, plus 1 MiB of chunk
    temporaries).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffers: dict[str, torch.Tensor] = {}
        self._lent: list[weakref.ref] = []  # the arrays behind lent views; alive while any view is

    @contextmanager
    def claim(self) -> Iterator["Workspace | None"]:
        """Hold the workspace for one call; yields ``None`` while another thread holds it."""
        if not self._lock.acquire(blocking=False):
            yield None
            return
        try:
            if any(ref() is not None for ref in self._lent):
                self._buffers.clear()  # still viewed by a borrowed Encoded: leave them to it
            self._lent.clear()
            yield self
        finally:
            self._lock.release()

    def take(self, name: str, dtype: torch.dtype, n: int) -> torch.Tensor:
        """The first ``n`` items of buffer ``name`` (grown when too small). Contents are stale:
        the caller overwrites every item it hands out."""
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < n:
            buf = self._buffers[name] = fresh(dtype, n)
        return buf[:n]

    def lend(self, t: torch.Tensor) -> memoryview:
        """A read-only little-endian byte view of contiguous CPU ``t``, tracked so that its
        memory is not reused while the view (or anything made from it) is alive."""
        arr = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
        if not np.little_endian and arr.dtype.itemsize > 1:
            arr = arr.byteswap()  # a copy in wire order; tracking it is harmless
        self._lent.append(weakref.ref(arr))
        return memoryview(arr).cast("B").toreadonly()

    def __reduce__(self) -> tuple:
        return (Workspace, ())  # copies and pickles start empty (a lock does not pickle)


_NUMPY_DTYPES = {torch.float32: np.float32, torch.int8: np.int8, torch.uint8: np.uint8}


def fresh(dtype: torch.dtype, n: int) -> torch.Tensor:
    """A new flat CPU tensor of ``n`` items whose memory is first touched cheaply.

    Why: ``torch.empty`` takes large blocks from ``mmap`` in 4 KiB pages, each faulting on its
    first write (on our 2-core machine first-writing 256 MB of fp32 that way takes ~150 ms of
    CPU). numpy's allocator asks the kernel for transparent huge pages on large arrays
    (``madvise(MADV_HUGEPAGE)``, honoured where THP is ``madvise`` or ``always``), which faults
    one 2 MiB page at a time: 4-5x less CPU. Where the kernel gives no huge pages it costs the
    same as ``torch.empty``. The tensor owns its memory like any other (it keeps the array
    alive), except that it cannot be resized in place."""
    np_dtype = _NUMPY_DTYPES.get(dtype)
    if np_dtype is None:
        return torch.empty(n, dtype=dtype)
    return torch.from_numpy(np.empty(n, dtype=np_dtype))


def scratch(ws: Workspace | None, name: str, dtype: torch.dtype, n: int) -> torch.Tensor:
    """``ws.take(name, dtype, n)``, or a fresh tensor when there is no workspace."""
    return fresh(dtype, n) if ws is None else ws.take(name, dtype, n)
