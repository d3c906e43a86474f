"""What the network does to a call, as the exceptions peer code catches, and how a best-effort
read survives them.

A swarm fails all the time in ordinary ways (a peer dies, the DHT is slow, a link drops), and peer
code survives those by keeping what it had or skipping a step. It must not survive its own bugs
that way: an `except Exception` around a DHT read turns a refactoring's TypeError into a quiet
"could not read the records". So the network's failures arrive as two exceptions:

- `SwarmUnavailable`: a DHT read or write did not complete (its deadline passed, the DHT process
  is gone, the p2p daemon refused). Raised by `dht_call`, which every DHT access goes through
  (`SwarmView`, the private run's admission, the coordinator's revocation list).
- `RPCFailed`: a framed RPC got no usable response (peer/net/rpc.py).

Anything else (TypeError, AttributeError, KeyError...) is a bug and propagates. `BestEffort`
wraps one read or call whose failure its caller survives: it names what was being read, logs the
first failure at WARNING, later ones at DEBUG, and the recovery at INFO.
"""
from __future__ import annotations

import asyncio
import logging
import time
from types import TracebackType
from typing import Awaitable, Callable, TypeVar

from hivemind.p2p import P2PDaemonError, P2PHandlerError

from swarmgrad.peer.net.deadline import within

T = TypeVar("T")


class SwarmUnavailable(Exception):
    """A DHT read or write that did not complete: the network's failure, not a bug of ours."""


class RPCFailed(Exception):
    """A call that got no usable response: timeout, unreachable peer, broken stream, bad bytes."""


P2P_FAILURES: tuple[type[BaseException], ...] = (OSError, EOFError, P2PDaemonError, P2PHandlerError)
"""What hivemind's p2p layer raises when the network or a remote failed: a reset or closed stream
(ConnectionError, IncompleteReadError), a peer the daemon cannot dial or a daemon gone
(P2PDaemonError), a broken pipe to the DHT process (BrokenPipeError, EOFError: it died)."""

DHT_FAILURES: tuple[type[BaseException], ...] = (asyncio.TimeoutError, *P2P_FAILURES)
"""What a hivemind DHT call raises when the network, not our code, failed: P2P_FAILURES, or its
deadline passed (`within`). A DHT process that died makes every later call hang rather than fail,
which the deadline turns into a timeout."""

NETWORK_FAILURES: tuple[type[BaseException], ...] = (SwarmUnavailable, RPCFailed, asyncio.TimeoutError,
                                                     TimeoutError)
"""What a best-effort read or call fails with when the network failed: the two errors above, and a
deadline the caller put around the call (`within`; asyncio's TimeoutError is the builtin one from
Python 3.11, another class on 3.10)."""


async def dht_call(what: str, call: Callable[[], Awaitable[T]], timeout: float | None) -> T:
    """`await call()` within `timeout` seconds; the network's failures (DHT_FAILURES) are raised as
    SwarmUnavailable naming `what`, anything else as it is. `call` starts the DHT call (hivemind's
    `dht.get(..., return_future=True)` writes to the DHT process's pipe, which fails once it is gone),
    so it runs inside the deadline and the translation."""
    try:
        return await within(call(), timeout)
    except DHT_FAILURES as e:
        timed_out = isinstance(e, asyncio.TimeoutError) and timeout is not None
        why = f"no answer within {timeout:g}s" if timed_out else f"{type(e).__name__}: {e}"
        raise SwarmUnavailable(f"{what}: {why}") from e


class BestEffort:
    """One read or call, made again and again, whose failure its caller survives (it keeps what it
    had, or skips a step). `what` names it ("reading the replicas of stage 2").

    Its failures (`errors`, default NETWORK_FAILURES) are logged with `what`: the first at WARNING,
    later ones at DEBUG while it keeps failing, and the first success after them at INFO, so an
    outage is seen once and its end too. Any other exception is a bug and propagates.

    As a context manager it swallows those failures and sets `ok`::

        with self._reading:            # BestEffort("reading the drivers' records", logger)
            self._ids = await ...      # on a failure, the last list stays
    """

    def __init__(self, what: str, log: logging.Logger,
                 errors: tuple[type[BaseException], ...] = NETWORK_FAILURES,
                 clock: Callable[[], float] = time.monotonic):
        self.what = what
        self.log = log
        self.errors = errors
        self.clock = clock
        self.failures = 0
        """Failures in a row (0: the last one succeeded, or there was none yet)."""
        self.ok = True
        """Whether the last use succeeded."""
        self._since = 0.0

    def failed(self, error: BaseException) -> None:
        """Count and log one failure (`error` must be one of `errors`)."""
        self.ok = False
        self.failures += 1
        if self.failures == 1:
            self._since = self.clock()
            self.log.warning("%s failed: %s: %s", self.what, type(error).__name__, error)
        else:
            self.log.debug("%s failed (%d times in a row): %s: %s", self.what, self.failures,
                           type(error).__name__, error)

    def succeeded(self) -> None:
        self.ok = True
        if self.failures:
            self.log.info("%s works again after %d failure(s) over %.1fs", self.what, self.failures,
                          self.clock() - self._since)
        self.failures = 0

    def __enter__(self) -> "BestEffort":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> bool:
        if error is None:
            self.succeeded()
            return False
        if isinstance(error, self.errors):
            self.failed(error)
            return True
        return False


class LoopSteps:
    """The steps of a loop that must outlive any one step's failure (a heartbeat's parts, a
    dial-out look): each step keeps its own `BestEffort` (the network's failures, logged once),
    and anything else it raises is a bug, logged with its traceback; the loop runs the next step
    and the next round anyway. `owner` names the loop in every line ("admission: publish failed")."""

    def __init__(self, owner: str, log: logging.Logger):
        self.owner = owner
        self.log = log
        self._attempts: dict[str, BestEffort] = {}

    def attempt(self, name: str) -> BestEffort:
        """The `BestEffort` of step `name` (made on its first run)."""
        if name not in self._attempts:
            self._attempts[name] = BestEffort(f"{self.owner}: {name}", self.log)
        return self._attempts[name]

    async def run(self, name: str, step: Callable[[], Awaitable[None]]) -> None:
        """Run one step; it never raises (but for cancellation, which is not an Exception)."""
        try:
            with self.attempt(name):
                await step()
        except Exception:  # not the network's failure (the step's BestEffort took those): a bug
            self.log.exception("%s: %s failed", self.owner, name)
