"""`swarmgrad monitor`: a public run's dashboard with no coordinator (peer/coordinator/monitor.py) on
a client-mode DHT node that only reads; and `swarmgrad status --contributors`, one read of the
credit for the completed rounds the DHT still holds."""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_INTERVAL_S = 5.0
"""Seconds between two looks at the swarm (the page polls every 2 s; records change per heartbeat)."""
STATUS_LOOKBACK_ROUNDS = 64
"""`status --contributors`: rounds below each stage's latest that one read goes through (the DHT
keeps a round's entries 4 × announce_ttl, so most of these are gone in a long run)."""


def _open_view(peers: list[str], run_id: str | None, manifest: Any, run: str | None, timeout: float):  # type: ignore[no-untyped-def]
    """(dht, view, manifest): a read-only client-mode DHT node (cli/swarm_access.py: it raises
    SwarmUnreachable, one line, when no initial peer answers) and a SwarmView of the run on it.

    `run` NAME[@FINGERPRINT]: a public run's verified manifest, read from the swarm (cli/public.py),
    which gives the stage count, tokens per sample and the rounds' capacity. A bare NAME that no
    published manifest carries is taken as a plain run id (a run started without --owner-key)."""
    from swarmgrad.peer.cli.swarm_access import start_client_dht
    from swarmgrad.peer.net.dht_view import SwarmView
    from swarmgrad.peer.net.record_signing import MAX_RECORD_TTL
    dht = start_client_dht(peers, timeout)
    try:
        if run is not None and manifest is None:
            from swarmgrad.peer.cli.public import PublicRunError, published_over
            try:
                manifest = asyncio.run(published_over(dht, run, timeout)).manifest
            except PublicRunError as e:
                if "@" in run:
                    raise
                print(f"no public run named {run} ({e}); reading records of run id {run!r}", file=sys.stderr)
                run_id = run
        if manifest is not None:
            run_id = manifest.run_id
        assert run_id is not None
        n_stages = manifest.stages.count if manifest is not None else 0
        ttl = manifest.timeouts.announce_ttl if manifest is not None else MAX_RECORD_TTL
        view = SwarmView(dht, run_id, manifest.hash if manifest is not None else "", n_stages, timeout, ttl=ttl)
    except BaseException:
        dht.shutdown()
        raise
    return dht, view, manifest


def _contributors(run_id: str, manifest: Any, path: Path | None, lookback: int):  # type: ignore[no-untyped-def]
    from swarmgrad.peer.averaging.credit import RoundBounds, manifest_bounds, tokens_per_sample
    from swarmgrad.peer.coordinator.contributors import Contributors
    if manifest is None:  # no manifest: the other members' weights bound a claim, the round's capacity is unknown
        return Contributors(run_id, RoundBounds(), None, path=path, lookback=lookback)
    return Contributors(run_id, manifest_bounds(manifest), tokens_per_sample(manifest), path=path, lookback=lookback)


def _load_manifest(path: str | None):  # type: ignore[no-untyped-def]
    if not path:
        return None
    from swarmgrad.peer.manifest import load
    return load(path)


def cmd_monitor(args: argparse.Namespace) -> int:
    from swarmgrad.peer.cli.public import PublicRunError
    from swarmgrad.peer.cli.swarm_access import initial_peers, run_swarm_command
    from swarmgrad.peer.manifest import ManifestError
    try:
        peers = initial_peers(args.initial_peers, args.bootstrap_file)
        manifest = _load_manifest(args.manifest)
    except (ValueError, ManifestError) as e:
        print(e, file=sys.stderr)
        return 2
    if manifest is not None and args.run:
        print("swarmgrad monitor: give --run NAME or --manifest PATH, not both", file=sys.stderr)
        return 2
    try:
        return run_swarm_command("monitor", lambda: _monitor(args, peers, manifest), peers)
    except PublicRunError as e:
        print(f"swarmgrad monitor: {e}", file=sys.stderr)
        return 1


def _monitor(args: argparse.Namespace, peers: list[str], manifest: Any) -> int:
    from swarmgrad.peer.coordinator.monitor import Monitor
    from swarmgrad.peer.coordinator.web import DashboardServer
    dht, view, manifest = _open_view(peers, None, manifest, args.run, args.timeout)
    try:
        try:
            contributors = _contributors(view.run_id, manifest, Path(args.ledger) if args.ledger else None,
                                         lookback=8)
        except ValueError as e:
            print(f"--ledger {e}", file=sys.stderr)
            return 2
        monitor = Monitor(view, view.run_id, manifest.stages.count if manifest is not None else None, contributors,
                          str(dht.peer_id), args.interval)
        host, port = args.http.rsplit(":", 1)
        web = DashboardServer(host, int(port), lambda: monitor.documents()[0], lambda: monitor.documents()[1],
                              contributors=lambda: monitor.documents()[2],
                              allowed_hosts=tuple(getattr(args, "http_allow_host", ())))
        try:
            bound = web.start()
        except OSError as e:
            print(f"--http {args.http}: {e}", file=sys.stderr)
            return 2
        try:
            print(f"swarmgrad monitor of run {view.run_id}: dashboard at http://{host}:{bound}/", flush=True)
            asyncio.run(_serve(monitor))
        finally:
            web.close()
    finally:
        dht.shutdown()
    return 0


async def _serve(monitor: Any) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    await monitor.run(stop)


def print_contributors(initial_peers: list[str], run_id: str | None, manifest_path: str | None, as_json: bool,
                       timeout: float, out: str | None, run: str | None = None) -> int:
    """`swarmgrad status --contributors`: the credit for the completed rounds the DHT still holds,
    as a table or JSON (also written to `out`). Raises SwarmUnreachable / PublicRunError as
    `print_status` does."""
    from swarmgrad.peer.coordinator.monitor import Monitor
    dht, view, manifest = _open_view(initial_peers, run_id, _load_manifest(manifest_path), run, timeout)
    try:
        contributors = _contributors(view.run_id, manifest, None, lookback=STATUS_LOOKBACK_ROUNDS)
        monitor = Monitor(view, view.run_id, manifest.stages.count if manifest is not None else None, contributors,
                          str(dht.peer_id), 0.0)
        asyncio.run(_look_once(monitor, timeout * 4))
    finally:
        dht.shutdown()
    document = contributors.document()
    text = json.dumps(document, indent=1)
    if out:
        Path(out).write_text(text + "\n")
    if as_json:
        print(text)
        return 0
    print(format_contributors(document))
    return 0


async def _look_once(monitor: Any, timeout: float) -> None:
    from swarmgrad.peer.net.deadline import within
    await within(monitor.look(), timeout)


def format_contributors(document: dict[str, Any]) -> str:
    """The leaderboard as a table for a terminal."""
    rows = document.get("contributors", [])
    totals = document.get("totals", {})
    lines = [f"run {document.get('run_id')}: {totals.get('contributors', 0)} contributor(s), "
             f"{totals.get('samples', 0):,.0f} samples in {totals.get('rounds', 0)} completed round(s) "
             f"(credit counted from the rounds' votes, as of {time.strftime('%H:%M:%S')})"]
    if not rows:
        lines.append("  no completed round credited (rounds of one member, or older than the DHT keeps them)")
    for r in rows:
        tokens = f"{r['tokens']:>14,d} tokens" if r.get("tokens") is not None else ""
        lines.append(f"  {r['rank']:3d}. {r['peer_id']}  {r['samples']:>12,.0f} samples {tokens}  "
                     f"{r['rounds']:4d} rounds  stages {','.join(map(str, r['stages']))}")
    return "\n".join(lines)
