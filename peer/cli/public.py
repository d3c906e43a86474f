"""A public run on the command line (docs/public-runs.md): the owner's `--manifest PATH --owner-key
KEY` (sign), a joiner's `--run NAME[@FINGERPRINT]` (fetch, verify, cache), and `swarmgrad runs`."""
from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Sequence

from swarmgrad.peer.net.deadline import within

RUN_FETCH_TIMEOUT_S = 15.0
"""Deadline of each DHT read (and of the client node's start) while a joiner fetches a run's
manifest; `--bootstrap-wait` bounds the wait for an initial peer before that."""


class PublicRunError(Exception):
    """A public run that cannot be started or joined: str() is one line, for stderr."""


def sign_own_run(manifest_path: str, key_path: str):
    """The owner's manifest, signed (`--manifest PATH --owner-key KEY`): a PublishedManifest whose
    `manifest` is the one to train with. Raises PublicRunError."""
    from swarmgrad.peer.manifest import ManifestError, load
    from swarmgrad.peer.net.identity import IdentityError, load_key
    from swarmgrad.peer.public.run_name import RunName, fingerprint
    from swarmgrad.peer.public.signed_manifest import ManifestRefused, sign, tokenizer_digest, verify
    try:
        key = load_key(Path(key_path))
    except IdentityError as e:
        raise PublicRunError(f"--owner-key {e} (create one with: swarmgrad keygen --out KEY)") from None
    try:
        manifest = load(manifest_path)
        text = Path(manifest_path).read_text()
        blob = sign(key, text, tokenizer_sha256=tokenizer_digest(manifest, Path(manifest_path).resolve().parent))
    except (ManifestError, ManifestRefused) as e:
        raise PublicRunError(str(e)) from None
    return verify(blob, RunName(manifest.run_id, fingerprint(key)))


def fetch_run(run: str, peers: Sequence[str], cache_dir: str | None, bootstrap_wait: float):
    """The verified manifest `--run` names, fetched through a short-lived client node and cached.
    Raises PublicRunError for a name that is malformed, unknown, ambiguous or refused, and
    swarm_access.SwarmUnreachable when no initial peer answers."""
    from swarmgrad.peer.cli.swarm_access import start_client_dht
    from swarmgrad.peer.public.directory import RunDirectory
    from swarmgrad.peer.public.resolve import RunNotFound, default_cache_dir, resolve
    from swarmgrad.peer.public.run_name import parse
    from swarmgrad.peer.public.signed_manifest import ManifestRefused
    try:
        name = parse(run)
    except ValueError as e:
        raise PublicRunError(f"--run {e}") from None
    folder = Path(cache_dir) if cache_dir else default_cache_dir()
    dht = start_client_dht(peers, RUN_FETCH_TIMEOUT_S, bootstrap_wait)
    try:
        directory = RunDirectory(dht, RUN_FETCH_TIMEOUT_S)
        return asyncio.run(within(resolve(directory, name, folder), 3 * RUN_FETCH_TIMEOUT_S))
    except (RunNotFound, ManifestRefused) as e:
        raise PublicRunError(str(e)) from None
    except OSError as e:  # the cache folder
        raise PublicRunError(f"--cache-dir {folder}: {e.strerror}") from None
    finally:
        dht.shutdown()


async def published_over(dht, run: str, timeout: float):
    """The verified manifest `run` (NAME[@FINGERPRINT]) names, read over a started DHT node (nothing
    cached): for commands that only look at a run (`status --run`). Raises PublicRunError."""
    from swarmgrad.peer.public.directory import RunDirectory
    from swarmgrad.peer.public.resolve import RunNotFound, choose
    from swarmgrad.peer.public.run_name import parse
    from swarmgrad.peer.public.signed_manifest import ManifestRefused
    try:
        name = parse(run)
    except ValueError as e:
        raise PublicRunError(f"--run {e}") from None
    found = await within(RunDirectory(dht, timeout).find(name), 2 * timeout)
    try:
        return choose(name, found, None)
    except (RunNotFound, ManifestRefused) as e:
        raise PublicRunError(str(e)) from None


def check_local_tokenizer(published, base: Path) -> None:
    """Where the run names a tokenizer file and it is here, its bytes must be the ones the owner
    signed. Raises PublicRunError."""
    from swarmgrad.peer.public.signed_manifest import ManifestRefused, tokenizer_digest
    path = getattr(published.manifest.data, "tokenizer", "") or ""
    if not path or published.tokenizer_sha256 is None or not (base / path).exists():
        return
    try:
        digest = tokenizer_digest(published.manifest, base)
    except ManifestRefused as e:
        raise PublicRunError(str(e)) from None
    if digest != published.tokenizer_sha256:
        raise PublicRunError(f"data.tokenizer {base / path} is not the tokenizer the owner of {published.run_id} "
                             "signed")


def cmd_runs(args: argparse.Namespace) -> int:
    import sys

    from swarmgrad.peer.cli.runs import list_runs
    from swarmgrad.peer.cli.swarm_access import initial_peers, run_swarm_command
    try:
        peers = initial_peers(args.initial_peers, args.bootstrap_file)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    return run_swarm_command("runs", lambda: list_runs(peers, args.json, args.timeout), peers)
