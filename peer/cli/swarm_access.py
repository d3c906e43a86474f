"""How a command reaches a swarm: where its initial peers come from, the short-lived read-only
DHT client of `status`, `runs` and `monitor`, and the one line it prints when none of them answers.

Initial peers, in this order of precedence (docs/public-runs.md):
1. `--initial-peers MADDR...` and `--bootstrap-file PATH` (one multiaddr a line; blank lines and
   `#` comments skipped), together when both are given;
2. otherwise `SWARMGRAD_INITIAL_PEERS` (multiaddrs separated by spaces, commas or newlines).
None at all: `peer` starts a new swarm; the read-only commands refuse.

When the swarm cannot be reached (p2pd cannot dial any initial peer, hivemind's DHT gets no ping
back, a read finds nobody before its deadline, a malformed multiaddr), the commands print
`unreachable_line(...)`, one line naming the peers tried, and exit with UNREACHABLE_EXIT, instead
of hivemind's traceback.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

ENV_INITIAL_PEERS = "SWARMGRAD_INITIAL_PEERS"
UNREACHABLE_EXIT = 1
MAX_BOOTSTRAP_FILE_BYTES = 1 << 20


class SwarmUnreachable(Exception):
    """None of the initial peers answered, or the swarm did not answer in time: str() is one line."""


def add_initial_peer_flags(parser: argparse.ArgumentParser, help_text: str) -> None:
    """`--initial-peers` and `--bootstrap-file`, the same on every command that joins or reads a swarm."""
    parser.add_argument("--initial-peers", nargs="*", default=[], metavar="MADDR",
                        help=f"{help_text}; also --bootstrap-file, or ${ENV_INITIAL_PEERS} when neither is given")
    parser.add_argument("--bootstrap-file", default=None, metavar="PATH",
                        help="initial peers from this file, one multiaddr a line ('#' starts a comment)")


def read_bootstrap_file(path: str | Path) -> list[str]:
    """The multiaddrs of a bootstrap file. Raises ValueError with one line for an unreadable file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BOOTSTRAP_FILE_BYTES + 1)
    except OSError as e:
        raise ValueError(f"--bootstrap-file {path}: {e.strerror}") from None
    if len(data) > MAX_BOOTSTRAP_FILE_BYTES:
        raise ValueError(f"--bootstrap-file {path}: over {MAX_BOOTSTRAP_FILE_BYTES} bytes, not a list of addresses")
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise ValueError(f"--bootstrap-file {path}: not UTF-8 text") from None
    return [line.split("#", 1)[0].strip() for line in text.splitlines() if line.split("#", 1)[0].strip()]


def initial_peers(flag: Sequence[str], bootstrap_file: str | None,
                  environ: Mapping[str, str] = os.environ) -> list[str]:
    """The initial peers by the precedence of the module docstring, each once, in order. Raises
    ValueError (one line) for an unreadable bootstrap file, or an address that is not a multiaddr."""
    peers = list(flag)
    if bootstrap_file is not None:
        peers += read_bootstrap_file(bootstrap_file)
    if not peers and bootstrap_file is None:
        peers = [p for p in re.split(r"[\s,]+", environ.get(ENV_INITIAL_PEERS, "")) if p]
    for p in peers:
        if not p.startswith("/"):
            raise ValueError(f"initial peer {p!r} is not a multiaddr (/ip4/HOST/tcp/PORT/p2p/12D3KooW...)")
    return list(dict.fromkeys(peers))


def _tried(peers: Sequence[str]) -> str:
    shown = ", ".join(peers[:3]) + (f" and {len(peers) - 3} more" if len(peers) > 3 else "")
    return shown or "none given"


def unreachable_line(error: BaseException, peers: Sequence[str]) -> str | None:
    """One line for a failure to reach the swarm through `peers`, or None when `error` is not the
    network's (a bug: let it raise)."""
    import asyncio

    from hivemind.p2p import P2PDaemonError  # late: the CLI starts without hivemind

    from swarmgrad.peer.net.errors import SwarmUnavailable
    text = " ".join(str(error).split())
    if isinstance(error, SwarmUnreachable):
        return text
    if isinstance(error, (asyncio.TimeoutError, TimeoutError, SwarmUnavailable)):
        return f"the swarm did not answer in time through {_tried(peers)} ({text or 'timed out'})"
    if isinstance(error, (P2PDaemonError, RuntimeError)):
        from swarmgrad.peer.cli.peer import is_bootstrap_failure
        if isinstance(error, P2PDaemonError) or is_bootstrap_failure(error):
            why = "no answer" if is_bootstrap_failure(error) else text[-200:]
            return f"none of the initial peers answered ({_tried(peers)}): {why}"
    return None


def start_client_dht(peers: Sequence[str], timeout: float, bootstrap_wait: float = 0.0) -> Any:
    """A read-only, client-mode DHT node joined through `peers` (its records' signatures checked,
    nothing signed), tried for up to `bootstrap_wait` s while none answers. Raises SwarmUnreachable."""
    from swarmgrad.peer.cli.peer import start_dht_waiting
    from swarmgrad.peer.net.dht_process import start_dht_process
    from swarmgrad.peer.net.record_signing import SignedRecordValidator
    if not peers:
        raise SwarmUnreachable(f"no initial peers: give --initial-peers, --bootstrap-file or ${ENV_INITIAL_PEERS}")

    def attempt() -> Any:
        return start_dht_process(initial_peers=list(peers), client_mode=True, startup_timeout=timeout,
                                 record_validators=[SignedRecordValidator()])
    try:
        return start_dht_waiting(attempt, list(peers), bootstrap_wait)
    except Exception as e:
        line = unreachable_line(e, peers)
        if line is None:
            raise
        raise SwarmUnreachable(line) from None


def run_swarm_command(command: str, body: Callable[[], int], peers: Sequence[str]) -> int:
    """`body()`, with the network's failures to reach the swarm turned into one line on stderr
    (`swarmgrad COMMAND: ...`) and UNREACHABLE_EXIT. Any other exception propagates."""
    try:
        return body()
    except Exception as e:
        line = unreachable_line(e, peers)
        if line is None:
            raise
        print(f"swarmgrad {command}: {line}", file=sys.stderr, flush=True)
        return UNREACHABLE_EXIT
