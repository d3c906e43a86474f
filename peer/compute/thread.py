"""The one thread a replica's torch work runs on, the seconds it spends there, and the rate the
replica announces from them."""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from swarmgrad.peer.compute.rate import RateMeter
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.framing import ProtocolError

RATE_CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}
"""The seconds an announced rate divides by. "wall": elapsed time of each compute call, what the
swarm gets from this peer. "cpu" (testing aid, --rate-clock cpu): the compute thread's CPU time, so
that peers sharing one machine's cores, each with one torch thread, measure themselves rather than
their neighbours' share of the cores (the 6-peer rebalancing test and benchmark on 2 cores).
`ComputeThread.timed` reads both once per call (the cpu one is also the core share's)."""


class FirstServed:
    """One thread running submitted calls in order, except that calls submitted `first` run before
    every call waiting without it (in their own order): the executor of a ComputeThread with
    `forward_first` (pipeline.forward_first). Same contract as a one-worker ThreadPoolExecutor's
    submit and shutdown(wait=True, cancel_futures=True)."""

    def __init__(self, name: str):
        self._ready = threading.Condition()
        self._first: deque = deque()
        self._rest: deque = deque()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any, first: bool = False) -> Future:
        future: Future = Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            (self._first if first else self._rest).append((fn, args, future))
            self._ready.notify()
        return future

    def _serve(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._first or self._rest or self._closed)
                if not (self._first or self._rest):
                    return
                fn, args, future = (self._first or self._rest).popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to the caller, as an executor does
                future.set_exception(e)

    def shutdown(self) -> None:
        """Cancel what waits; wait for the call running now."""
        with self._ready:
            self._closed = True
            for queue in (self._first, self._rest):
                while queue:
                    queue.popleft()[2].cancel()
            self._ready.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()


class ComputeThread:
    """A replica's compute thread and what it measured.

    Invariants:
    - Every call submitted through `run` executes on one thread, in submission order (with
      `forward_first`: the calls submitted `first` before the others waiting, each kind in its
      order), one at a time: compute never blocks the event loop that serves RPCs, and the forward
      and backward of different microbatches never interleave mid-op.
    - Once `close` has run nothing more runs: `run` refuses with NOT_READY (a request admitted
      before the replica stopped is refused, not reported as a server bug).
    - `compute_total` and `core_time` only grow. `rate` changes only in `update_rate` (once per
      inner step): trained samples over the seconds measured for them since the last update.
    """

    def __init__(self, slowdown: float = 1.0, rate_clock: str = "wall", forward_first: bool = False):
        """`rate_clock`: a key of RATE_CLOCKS (KeyError otherwise). `forward_first`
        (pipeline.forward_first): a call `run` with `first` goes before the calls waiting without it."""
        self.forward_first = forward_first
        self.executor: ThreadPoolExecutor | None = None
        self.ordered: FirstServed | None = None
        if forward_first:
            self.ordered = FirstServed("stage-compute")
        else:
            self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-compute")
        self.closed = False
        """Set by `close`: the thread is gone; work that still arrives is refused."""
        self.slowdown = slowdown
        """Testing aid (--slowdown F): each timed call sleeps (F−1)× its measured time, on the
        compute thread, so the replica really is F times slower and measures itself so."""
        self.rate_clock = RATE_CLOCKS[rate_clock]
        """What the announced rate's seconds are (testing aid --rate-clock)."""
        self.rate = RateMeter()
        """Samples/s of this replica's forward+backward compute alone (waits excluded), an EMA over
        inner steps: what it announces and what placement reasons with."""
        self.rate_s = 0.0
        """Seconds (of the rate clock, slowdown included) timed since the rate's last update."""
        self.rate_samples = 0
        """Samples trained since the rate's last update. Evaluation forwards count in `rate_s` but
        not here: only steps that trained move the rate."""
        self.compute_total = 0.0
        """Seconds this replica has spent computing (forward, backward, inner steps; waits excluded),
        ever, never reset: the round runner turns its growth over a round into the round's utilisation,
        the driver its growth over a report window into its compute utilisation (peer/pipeline/window.py)."""
        self.core_time = [0.0, 0.0]
        """[CPU seconds of the compute thread, elapsed seconds] over the compute calls themselves
        (the --slowdown sleep excluded), ever: their ratio is the share of a core the compute
        thread got while it ran. Below 1 on a CPU device, other processes shared its core, and the
        time this replica waits is theirs to use (the driver reports it, `core_share`)."""

    async def run(self, fn: Callable[..., Any], *args: Any, first: bool = False) -> Any:
        """`fn(*args)` on the compute thread. Raises ProtocolError(NOT_READY) once closed. `first`
        (with forward_first only): before the calls waiting without it (a forward that feeds the
        link, ahead of backwards that do not)."""
        if self.closed:
            raise ProtocolError(pb.NOT_READY, "this replica is stopping")
        if self.ordered is not None:
            return await asyncio.wrap_future(self.ordered.submit(fn, *args, first=first))
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def timed(self, fn: Callable[..., Any], *args: Any) -> Any:
        """On the compute thread: `fn(*args)` (a forward or backward), measured into the rate's
        seconds, `compute_total` and `core_time`, and stretched by the slowdown (testing aid)."""
        wall = self.rate_clock is time.perf_counter  # one reading per clock: two differ under load
        cpu_started = time.thread_time()  # the cpu rate clock's reading too (RATE_CLOCKS)
        started = time.perf_counter()
        out = fn(*args)
        spent = time.perf_counter() - started
        cpu_spent = time.thread_time() - cpu_started
        measured = spent if wall else cpu_spent
        self._core(cpu_spent, spent)
        if self.slowdown > 1:
            time.sleep((self.slowdown - 1) * spent)
            spent, measured = spent * self.slowdown, measured * self.slowdown
        self.rate_s += measured
        self.compute_total += spent
        return out

    def counted(self, fn: Callable[..., Any], *args: Any) -> Any:
        """On the compute thread: `fn(*args)` (an inner step), counted in `compute_total` and
        `core_time` (even if it raises) but not in the rate's seconds and not stretched."""
        cpu_started = time.thread_time()
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            spent = time.perf_counter() - started
            self.compute_total += spent
            self._core(time.thread_time() - cpu_started, spent)

    def _core(self, cpu_spent: float, spent: float) -> None:
        self.core_time[0] += cpu_spent
        self.core_time[1] += spent

    def trained(self, samples: int) -> None:
        """`samples` were trained on (their gradients joined a step): they count into the rate."""
        self.rate_samples += samples

    def update_rate(self) -> None:
        """At an inner step: fold what was measured since the last one into the rate."""
        self.rate.update(self.rate_samples, self.rate_s)
        self.rate_s, self.rate_samples = 0.0, 0

    def close(self) -> None:
        """Refuse new work, cancel what is queued, and wait for the call running now to finish."""
        self.closed = True
        if self.ordered is not None:
            self.ordered.shutdown()
        else:
            assert self.executor is not None
            self.executor.shutdown(wait=True, cancel_futures=True)
