"""The commands of a private run's host: `keygen`, `invite`, `revoke`, `coordinator`, `export`
(docs/private-runs.md). The coordinator itself lives in peer/coordinator/."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from swarmgrad.peer.cli.peer import exit_on_signal


def _load_key(path: str):
    from swarmgrad.peer.net.identity import load_key
    return load_key(Path(path))


def _run_id_from(coordinator: str, key, run_id: str | None) -> str:
    """The run id: --run-id, or the one in the manifest the coordinator serves signed by `key`."""
    if run_id:
        return run_id
    from swarmgrad.peer.private.coordinator_client import CoordinatorUnavailable, served_run_id
    from swarmgrad.peer.net.identity import peer_id_of
    try:
        return served_run_id(coordinator, peer_id_of(key))
    except CoordinatorUnavailable as e:
        raise RuntimeError(f"{e}; give --run-id") from None


def cmd_keygen(args: argparse.Namespace) -> int:
    from swarmgrad.peer.net.identity import peer_id_of, write_key_file
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    key = Ed25519PrivateKey.generate()
    try:
        write_key_file(Path(args.out), key)
    except FileExistsError:
        print(f"{args.out} exists: keygen never overwrites a key", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"{args.out}: {e.strerror}", file=sys.stderr)
        return 2
    from swarmgrad.peer.public.run_name import fingerprint
    print(f"wrote {args.out}; public key (coordinator id): {peer_id_of(key)}")
    # a public run started with --owner-key KEY is NAME@FINGERPRINT (docs/public-runs.md)
    print(f"fingerprint: {fingerprint(key)}")
    return 0


def cmd_invite(args: argparse.Namespace) -> int:
    from swarmgrad.peer.private.credentials import CredentialError, make_invitation
    from swarmgrad.peer.net.identity import IdentityError
    try:
        key = _load_key(args.key)
        run_id = _run_id_from(args.coordinator, key, args.run_id)
    except (IdentityError, RuntimeError) as e:
        print(e, file=sys.stderr)
        return 2
    except CredentialError as e:  # a manifest not signed by this key
        print(f"the coordinator at {args.coordinator} does not hold this key: {e}", file=sys.stderr)
        return 2
    invitation = make_invitation(key, run_id, args.coordinator, expires_in=args.expires, stage=args.stage)
    print(invitation.encode())
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    from swarmgrad.peer.private.coordinator_client import CoordinatorClient, CoordinatorUnavailable
    from swarmgrad.peer.private.credentials import Authority, CredentialError, revoke_order
    from swarmgrad.peer.net.identity import IdentityError, is_peer_id, peer_id_of
    if not is_peer_id(args.peer_id):
        print(f"{args.peer_id!r} is not a peer id (12D3KooW...)", file=sys.stderr)
        return 2
    try:
        key = _load_key(args.key)
        run_id = _run_id_from(args.coordinator, key, None)
        client = CoordinatorClient(args.coordinator, Authority(peer_id_of(key), run_id), key)
        revocations = client.revoke(revoke_order(key, run_id, args.peer_id))
        client.close()
    except (IdentityError, RuntimeError, CoordinatorUnavailable, CredentialError) as e:
        print(e, file=sys.stderr)
        return 1
    print(f"revoked {args.peer_id}: revocation list v{revocations.version} ({len(revocations.peer_ids)} peers)")
    return 0


def cmd_coordinator(args: argparse.Namespace) -> int:
    from swarmgrad.peer.coordinator.coordinator import Coordinator
    from swarmgrad.peer.net.identity import IdentityError
    from swarmgrad.peer.manifest import ManifestError, load
    try:
        manifest = load(args.manifest)
        key = _load_key(args.key)
    except ManifestError as e:
        print(e, file=sys.stderr)
        return 2
    except IdentityError as e:
        print(f"--key {e} (create one with: swarmgrad keygen --out KEY)", file=sys.stderr)
        return 2
    try:
        coordinator = Coordinator(manifest, Path(args.manifest).read_text(), key, Path(args.key), Path(args.state_dir),
                                  listen=args.listen, http=args.http, host_maddrs=tuple(args.host_maddrs),
                                  announce_maddrs=tuple(args.announce_maddrs), initial_peers=tuple(args.initial_peers),
                                  checkpoint_every=args.checkpoint_every, keep_checkpoints=args.keep_checkpoints,
                                  certificate_ttl=args.certificate_ttl, events_path=args.events,
                                  metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                                  http_allowed_hosts=tuple(args.http_allow_host))
    except ValueError as e:  # a state dir of another run
        print(e, file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, exit_on_signal)
    dht = coordinator.start_dht(manifest.timeouts.state_download)
    code = 0
    try:
        print(f"swarmgrad coordinator {coordinator.peer_id} run {manifest.run_id}", flush=True)
        asyncio.run(_run_coordinator(coordinator))
    except Exception:
        logging.getLogger("swarmgrad").exception("coordinator failed")
        code = 1
    finally:
        dht.shutdown()
    return code


async def _run_coordinator(coordinator) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await coordinator.run(stop)


def cmd_export(args: argparse.Namespace) -> int:
    if getattr(args, "format", "safetensors") == "hf":
        from swarmgrad.peer.cli.export import ExportError, export_hf
        from swarmgrad.peer.manifest import ManifestError
        try:
            print(export_hf(args))
        except (ExportError, ManifestError, FileNotFoundError) as e:
            print(e, file=sys.stderr)
            return 2 if isinstance(e, (ExportError, ManifestError)) else 1
        return 0
    from swarmgrad.peer.coordinator.checkpoints import export_model
    if not args.state_dir or args.save_dir:
        print("the default format exports a coordinator's checkpoint: give --state-dir DIR "
              "(--save-dir is for --format hf)", file=sys.stderr)
        return 2
    try:
        round, n = export_model(Path(args.state_dir), Path(args.out), args.round)
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {n} tensors of the checkpoint of round {round}")
    return 0
