"""A public run on the command line (docs/public-runs.md): the owner's `--manifest PATH --owner-key
KEY` (sign), a joiner's `--run NAME[@FINGERPRINT]` (fetch, verify, cache), and `swarmgrad runs`."""
from __future__ import annotations

import argparse
import dataclasses
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
    published = verify(blob, RunName(manifest.run_id, fingerprint(key)))
    # the TOML text alone resolves data's relative paths against the working folder: train with the
    # ones resolved against the manifest's folder (not hashed, so the run is the same)
    return dataclasses.replace(published, manifest=dataclasses.replace(published.manifest, data=manifest.data))


def public_run_warnings(manifest, path: str) -> list[str]:
    """What the owner of a public run is told on start about its manifest (`manifest`, read from
    `path`): the defences a public run needs that the manifest leaves off."""
    if manifest.averaging.verify:
        return []
    return [f"warning: {path} has averaging.verify off: in a public run any id that joins a round's group can "
            f"write the values of the part it reduces into every replica; set [averaging] verify = true (with "
            f"gather_up_to >= the replicas per stage it costs 64 bytes per part: docs/trust.md, \"Reducers\")"]


def fetch_run(run: str, peers: Sequence[str], cache_dir: str | None, bootstrap_wait: float):
    """The verified manifest `--run` names, fetched through a short-lived client node and cached;
    for a run with a tokenizer, its `data.tokenizer` is the verified file in the cache, fetched from
    the run's peers when the cache lacks it (peer/public/tokenizer_share.py). Raises PublicRunError
    for a name that is malformed, unknown, ambiguous or refused, or a tokenizer no peer served, and
    swarm_access.SwarmUnreachable when no initial peer answers."""
    from swarmgrad.peer.cli.swarm_access import start_client_dht
    from swarmgrad.peer.public.directory import RunDirectory
    from swarmgrad.peer.public.resolve import RunNotFound, default_cache_dir, resolve
    from swarmgrad.peer.public.run_name import parse
    from swarmgrad.peer.public.signed_manifest import ManifestRefused
    from swarmgrad.peer.public.tokenizer_share import TokenizerUnavailable
    try:
        name = parse(run)
    except ValueError as e:
        raise PublicRunError(f"--run {e}") from None
    folder = Path(cache_dir) if cache_dir else default_cache_dir()
    dht = start_client_dht(peers, RUN_FETCH_TIMEOUT_S, bootstrap_wait)

    async def fetch():  # type: ignore[no-untyped-def]
        directory = RunDirectory(dht, RUN_FETCH_TIMEOUT_S)
        published = await within(resolve(directory, name, folder), 3 * RUN_FETCH_TIMEOUT_S)
        return await _with_tokenizer(dht, directory, published, folder)

    try:
        return asyncio.run(fetch())
    except (RunNotFound, ManifestRefused) as e:
        raise PublicRunError(str(e)) from None
    except TokenizerUnavailable as e:
        raise PublicRunError(f"tokenizer: {e}") from None
    except OSError as e:  # the cache folder
        raise PublicRunError(f"--cache-dir {folder}: {e.strerror}") from None
    finally:
        dht.shutdown()


async def _with_tokenizer(dht, directory, published, folder: Path):  # type: ignore[no-untyped-def]
    """`published` with its tokenizer file provided (cached, or fetched over the client node's p2p)."""
    import sys

    from swarmgrad.peer.net.rpc import FramedRPC, Traffic
    from swarmgrad.peer.public.tokenizer_share import MESSAGE_BYTES, namespace, provide_tokenizer
    if not published.manifest.data.tokenizer or published.tokenizer_sha256 is None:
        return published
    p2p = None

    async def rpc() -> FramedRPC:
        nonlocal p2p
        p2p = await dht.replicate_p2p()
        return FramedRPC(p2p, namespace(published.run_id), Traffic(), MESSAGE_BYTES,
                         read_timeout=published.manifest.timeouts.tokenizer)
    try:
        return await provide_tokenizer(directory, rpc, published, folder,
                                       say=lambda line: print(line, file=sys.stderr, flush=True))
    finally:
        if p2p is not None:
            await p2p.shutdown()


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


def missing_data(manifest) -> str | None:  # type: ignore[no-untyped-def]
    """Why this machine cannot read the run's training data, which a stage-0 peer (a driver) reads,
    or None. A public run's data is each joiner's own (docs/public-runs.md): only the standard
    library's sources (`data.source = "stdlib"`) are everywhere."""
    from swarmgrad.peer.text.sources import expand_paths
    d = manifest.data
    if d.source == "stdlib":
        return None
    try:
        expand_paths(d.paths, d.base_dir, want_dirs=d.source == "hf-disk")
    except ValueError as e:
        return str(e)
    return None


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


VOUCHER_DAYS = 30.0
"""How long a voucher from `swarmgrad vouch` holds by default (`--days`)."""


def cmd_vouch(args: argparse.Namespace) -> int:
    """`swarmgrad vouch`: the owner's voucher for a peer id of its public run, written to `--out`
    (docs/public-runs.md, "Anchors"). The run is `--run NAME[@FINGERPRINT]` (any manifest of it) or
    `--manifest PATH` (its manifest only); the peer is `--peer-id ID` or the key file `--identity`."""
    import sys
    import time

    from swarmgrad.peer.manifest import ManifestError, load
    from swarmgrad.peer.net.identity import IdentityError, fingerprint, is_peer_id, load_key, peer_id_of
    from swarmgrad.peer.net.vouchers import sign_voucher, voucher_text
    from swarmgrad.peer.public.run_name import parse
    from swarmgrad.peer.public.signed_manifest import public_manifest
    try:
        owner = load_key(Path(args.owner_key))
    except IdentityError as e:
        print(f"--owner-key {e}", file=sys.stderr)
        return 2
    owner_fp = fingerprint(owner)
    if args.identity:
        try:
            peer_id = peer_id_of(load_key(Path(args.identity)))
        except IdentityError as e:
            print(f"--identity {e}", file=sys.stderr)
            return 2
    else:
        peer_id = args.peer_id
        if not is_peer_id(peer_id):
            print(f"--peer-id {peer_id[:60]!r} is not an Ed25519 peer id (as `swarmgrad peer` prints it)", file=sys.stderr)
            return 2
    manifest_hash = ""
    if args.manifest:
        try:
            manifest = public_manifest(load(args.manifest), owner_fp)
        except ManifestError as e:
            print(e, file=sys.stderr)
            return 2
        run_id, manifest_hash = manifest.run_id, manifest.hash
    else:
        try:
            name = parse(args.run)
        except ValueError as e:
            print(f"--run {e}", file=sys.stderr)
            return 2
        if name.fingerprint is not None and name.fingerprint != owner_fp:
            print(f"--run {args.run}: the run's owner key has fingerprint {name.fingerprint}; --owner-key's is "
                  f"{owner_fp}", file=sys.stderr)
            return 2
        run_id = f"{name.name}@{owner_fp}"
    if not args.days > 0:
        print(f"--days must be > 0 (got {args.days})", file=sys.stderr)
        return 2
    expires = time.time() + args.days * 86400.0
    blob = sign_voucher(owner, run_id, peer_id, expires, manifest_hash)
    try:
        Path(args.out).write_text(voucher_text(blob))
    except OSError as e:
        print(f"--out {args.out}: {e.strerror}", file=sys.stderr)
        return 2
    until = time.strftime("%Y-%m-%d %H:%M", time.gmtime(expires))
    print(f"wrote {args.out}: peer {peer_id} is an anchor of run {run_id}"
          f"{' (manifest ' + manifest_hash[:12] + ')' if manifest_hash else ''} until {until} UTC; "
          f"it runs with `swarmgrad peer --run {run_id} --identity ITS_KEY --voucher {args.out}`")
    return 0


def read_own_voucher(path: str, manifest, peer_id: str) -> bytes:  # type: ignore[no-untyped-def]
    """The voucher in file `path`, checked for this peer of this run now (`swarmgrad peer --voucher`).
    Raises PublicRunError saying why in one line."""
    import time

    from swarmgrad.peer.net.vouchers import VoucherRefused, check_voucher, voucher_from_text
    try:
        blob = voucher_from_text(Path(path).read_text(errors="replace"))
        check_voucher(blob, manifest.run_id, peer_id, time.time(), manifest.hash)
    except OSError as e:
        raise PublicRunError(e.strerror or str(e)) from None
    except VoucherRefused as e:
        hint = " (run with --identity FILE, the key it was made for)" if "for peer" in str(e) else ""
        raise PublicRunError(f"{e}{hint}") from None
    return blob
