"""`swarmgrad peer` and `swarmgrad relay`: admission (private runs), the manifest, the DHT under
this peer's identity, then the daemon (peer/node/peer.py) until it ends or a signal arrives. Every
path out shuts the DHT (a child process and its p2pd) down."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from swarmgrad.peer.cli.args import parse_bytes
from swarmgrad.peer.net.deadline import within
from swarmgrad.peer.net.retry import Backoff

if TYPE_CHECKING:
    from swarmgrad.peer.manifest import Manifest


BOOTSTRAP_WAIT_S = 30.0
"""Default --bootstrap-wait: long enough for a peer launched at the same moment as the one it joins
through to come up on a loaded machine; a wrong address fails after it, saying so on every try."""
BOOTSTRAP_RETRY_S = 2.0
"""Pause between attempts to reach --initial-peers that did not answer yet (--bootstrap-wait)."""
BOOTSTRAP_RETRY = Backoff(first=BOOTSTRAP_RETRY_S, cap=BOOTSTRAP_RETRY_S, growth=1.0)
"""A fixed pace: the peers we wait for come up whenever their machine gets to it."""


def is_bootstrap_failure(e: BaseException) -> bool:
    """None of the initial peers answered: p2pd could not connect to one, or hivemind's DHT
    could not ping one (a peer started before the one it joins through)."""
    text = str(e)
    return "failed to connect to bootstrap peers" in text or "bootstrap failed" in text


def start_dht_waiting(start: Callable[[], Any], initial_peers: list[str], wait: float,
                      clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> Any:
    """`start()`, tried again while none of `initial_peers` answers, for up to `wait` seconds: peers
    launched together with the one they join through (a script, a compose file) come up in any
    order. Any other failure, or the last one, is raised."""
    from hivemind.p2p import P2PDaemonError  # late: the CLI starts without hivemind
    deadline = clock() + wait
    waits = BOOTSTRAP_RETRY.waits()
    while True:
        try:
            return start()
        except (RuntimeError, P2PDaemonError) as e:  # p2pd's and hivemind's bootstrap failures
            left = deadline - clock()
            if not initial_peers or not is_bootstrap_failure(e) or left <= 0:
                raise
            print(f"none of --initial-peers answered yet; trying again for {left:.0f} s more (--bootstrap-wait)",
                  file=sys.stderr, flush=True)
            sleep(min(next(waits), left))


def start_dht(initial_peers: list[str], host_maddrs: list[str], announce_maddrs: list[str],
              identity: str | None, timeout: float, key=None, authorizer=None, network: dict | None = None,
              bootstrap_wait: float = 0.0):
    """`_start_dht`, tried again for up to `bootstrap_wait` seconds while none of `initial_peers`
    answers (`start_dht_waiting`)."""
    def attempt():  # type: ignore[no-untyped-def]
        return _start_dht(initial_peers, host_maddrs, announce_maddrs, identity, timeout,
                          key=key, authorizer=authorizer, network=network)
    return start_dht_waiting(attempt, initial_peers, bootstrap_wait)


def _start_dht(initial_peers: list[str], host_maddrs: list[str], announce_maddrs: list[str],
               identity: str | None, timeout: float, key=None, authorizer=None, network: dict | None = None):
    """Start this peer's DHT under an Ed25519 identity whose key swarmgrad holds, with the record
    signer every peer of a swarm runs (peer/net/record_signing.py). `identity`: a key file to reuse,
    created (Ed25519) if missing; None: a fresh key, written to a private temp folder only
    while p2pd starts. `network`: the reachability plan's DHT/libp2p options (peer/net/reachability.py).
    Raises identity.IdentityError for a key file swarmgrad cannot use."""
    from contextlib import nullcontext

    from swarmgrad.peer.net.dht_process import start_dht_process
    from swarmgrad.peer.net.identity import ephemeral_key_file, load_or_create, peer_id_of
    from swarmgrad.peer.net.record_signing import SignedRecordValidator
    if identity:
        key = load_or_create(Path(identity))
        key_file = nullcontext((Path(identity), key))
    else:
        key_file = ephemeral_key_file(key)
    with key_file as (path, key):
        # check_if_identity_free=False: hivemind's check parses RSA key files only (PeerID.from_identity)
        kwargs = dict(initial_peers=initial_peers or None, host_maddrs=host_maddrs,
                      startup_timeout=timeout, identity_path=str(path), check_if_identity_free=False,
                      record_validators=[SignedRecordValidator(key)])
        if authorizer is not None:
            kwargs["authorizer"] = authorizer
        if announce_maddrs:
            kwargs["announce_maddrs"] = announce_maddrs
        kwargs.update(network or {})
        # its own process group, so that Ctrl-C or a group SIGTERM reaches only this process, which
        # then leaves cleanly and stops the DHT (peer/net/dht_process.py)
        dht = start_dht_process(**kwargs)
    if str(dht.peer_id) != peer_id_of(key):  # p2pd runs with another key: every record we sign would be refused
        dht.shutdown()
        raise RuntimeError(f"p2pd runs as {dht.peer_id}, not as the identity key's {peer_id_of(key)}")
    return dht


def cmd_peer(args: argparse.Namespace) -> int:
    from swarmgrad.peer.cli.public import (PublicRunError, fetch_run, missing_data, public_run_warnings,
                                           read_own_voucher, sign_own_run)
    from swarmgrad.peer.cli.swarm_access import SwarmUnreachable, initial_peers as resolve_initial_peers
    from swarmgrad.peer.manifest import ManifestError, load
    from swarmgrad.peer.net.reachability import plan as network_plan
    try:
        network = network_plan(args.reachability, args.host_maddrs, args.announce_maddrs)
        args.initial_peers = resolve_initial_peers(args.initial_peers, args.bootstrap_file)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    usage = _public_flags_conflict(args)
    if usage:
        print(usage, file=sys.stderr)
        return 2
    if not network.serves:  # a client drives: stage 0, and it never moves to a stage others must dial
        if args.stage not in ("auto", 0):
            print(f"--reachability client drives stage 0 and serves no other stage (got --stage {args.stage})",
                  file=sys.stderr)
            return 2
        args.stage, args.rebalance = 0, "off"
    private = None
    published = None
    key = None
    if args.join or args.coordinator:  # a private run: admission first, the manifest comes signed
        from swarmgrad.peer.private.coordinator_client import CoordinatorUnavailable
        from swarmgrad.peer.private.credentials import CredentialError
        from swarmgrad.peer.net.identity import IdentityError, load_or_create
        from swarmgrad.peer.private.join import join
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        try:
            key = load_or_create(Path(args.identity)) if args.identity else Ed25519PrivateKey.generate()
            private = join(key, invitation=args.join, coordinator=args.coordinator,
                           identity_path=Path(args.identity) if args.identity else None)
        except IdentityError as e:
            print(f"--identity {e}", file=sys.stderr)
            return 2
        except (CredentialError, CoordinatorUnavailable) as e:
            print(f"not admitted: {e}", file=sys.stderr)
            return 1
        manifest = private.manifest
        if args.manifest:
            try:
                local = load(args.manifest)
            except ManifestError as e:
                print(e, file=sys.stderr)
                return 2
            try:
                manifest = with_local_files(manifest, local)
            except ValueError as e:
                print(f"--manifest {args.manifest} {e}: give your copy of the run's manifest (it says where the "
                      "run's files are on this machine), or leave --manifest out", file=sys.stderr)
                return 2
        print(f"admitted to run {manifest.run_id} as {private.admitted.certificate.peer_id} until "
              f"{_clock(private.admitted.certificate.expires_at)}", flush=True)
    elif args.run:  # a public run by name: its owner-signed manifest from the swarm
        try:
            published = fetch_run(args.run, args.initial_peers, args.cache_dir, args.bootstrap_wait)
        except SwarmUnreachable as e:
            print(f"could not join the swarm: {e}", file=sys.stderr)
            return 1
        except PublicRunError as e:
            print(f"--run {args.run}: {e}", file=sys.stderr)
            return 1
        manifest = published.manifest
        print(f"run {published.run_id}: manifest {manifest.hash[:12]} signed by its owner {published.owner_id} "
              "(verified)", flush=True)
        if manifest.data.tokenizer:
            print(f"run {published.run_id}: tokenizer {manifest.data.tokenizer} (sha256 "
                  f"{(published.tokenizer_sha256 or '')[:12]}..., the owner's: verified)", flush=True)
        no_data = missing_data(manifest)
        if no_data is not None:  # a driver would fail on it; a later stage reads no data
            later = args.stage not in ("auto", 0) and args.rebalance != "on"
            if not later:
                stages = f"serve a later stage with --stage 1..{manifest.stages.count - 1}, or " \
                    if manifest.stages.count > 1 else ""
                print(f"--run {args.run}: this machine lacks the run's training data, which a stage-0 peer reads "
                      f"({no_data}): {stages}get the run's data (docs/public-runs.md)", file=sys.stderr)
                return 1
            print(f"run {published.run_id}: no training data here ({no_data}); serving stage {args.stage} only",
                  flush=True)
    else:
        if not args.manifest:
            print("--manifest is required (or --run NAME for a public run, --join INVITATION for a private one)",
                  file=sys.stderr)
            return 2
        try:
            manifest = load(args.manifest)
            if args.owner_key:  # the owner starts its public run: sign, and train as NAME@FINGERPRINT
                published = sign_own_run(args.manifest, args.owner_key)
                manifest = published.manifest
                for warning in public_run_warnings(manifest, args.manifest):
                    print(warning, file=sys.stderr)
        except ManifestError as e:
            print(e, file=sys.stderr)
            return 2
        except PublicRunError as e:
            print(e, file=sys.stderr)
            return 2
    if args.stage != "auto" and args.stage >= manifest.stages.count:
        print(f"--stage {args.stage}: the run has stages 0..{manifest.stages.count - 1}", file=sys.stderr)
        return 2
    from swarmgrad.peer.text.run_data import run_tokenizer
    from swarmgrad.peer.text.tokenizer import TokenizerMismatch
    try:  # every peer, not only drivers: placement may move any of them to stage 0
        run_tokenizer(manifest)
    except TokenizerMismatch as e:
        print(e, file=sys.stderr)
        return 2
    from swarmgrad.peer.node.peer import Peer, PeerNetwork, PeerOptions
    from swarmgrad.peer.model import from_manifest
    try:  # a relative model.init_from is read from the manifest's folder
        model = from_manifest(manifest, Path(args.manifest).parent if args.manifest else None)
    except ValueError as e:  # an init_from checkpoint that does not fit the manifest
        print(e, file=sys.stderr)
        return 2
    if args.device.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            print(f"--device {args.device}: CUDA is not available on this machine", file=sys.stderr)
            return 2
    stage = None if args.stage == "auto" else args.stage
    certified = private.admitted.certificate.stage if private is not None else None
    if certified is not None and stage is not None and stage != certified:
        # every admitted peer ignores our records and registrations under any other stage
        print(f"--stage {stage}: this peer's certificate admits it to stage {certified} only", file=sys.stderr)
        return 2
    if certified is not None:
        stage = certified  # the invitation pinned a stage
    from swarmgrad.peer.compute.precision import resolve_compute_dtype
    try:
        resolve_compute_dtype(manifest.model.dtype, args.device, args.compute_dtype)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    options = PeerOptions(stage=stage, device=args.device, compute_dtype=args.compute_dtype,
                          events_path=args.events, save_dir=args.save_dir, data_seed=args.data_seed,
                          max_rounds=args.max_rounds, linger=args.linger, slowdown=args.slowdown,
                          rate_clock=args.rate_clock,
                          byzantine=args.byzantine,
                          max_memory=parse_bytes(args.max_memory) if args.max_memory else None,
                          rebalance=args.rebalance, metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                          reachability=network.mode)
    # Until the event loop takes over the signals, SIGTERM ends the process through SystemExit, so
    # the `finally` below still shuts down a DHT that was started.
    signal.signal(signal.SIGTERM, exit_on_signal)
    # The DHT forks: start it before torch spins up threads (and before CUDA is initialised).
    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

    from swarmgrad.peer.net.identity import IdentityError
    initial_peers = list(args.initial_peers) or (list(private.admitted.initial_peers) if private else [])
    options = dataclasses.replace(options, initial_peer_ids=tuple(
        m.rsplit("/p2p/", 1)[1] for m in initial_peers if "/p2p/" in m))
    try:
        if key is None:  # the peer signs its round tickets with the key p2pd runs with: hold it here
            from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
            from swarmgrad.peer.net.identity import load_or_create
            key = load_or_create(Path(args.identity)) if args.identity else Ed25519PrivateKey.generate()
        anchor = _anchor_options(args, manifest, key)
        if isinstance(anchor, str):
            print(anchor, file=sys.stderr)
            return 2
        options = dataclasses.replace(options, **anchor)
        dht = start_dht(initial_peers, args.host_maddrs, args.announce_maddrs, args.identity,
                         manifest.timeouts.state_download, key=key,
                         authorizer=private.authorizer() if private else None, network=network.dht_kwargs,
                         bootstrap_wait=args.bootstrap_wait)
    except IdentityError as e:
        print(f"--identity {e}", file=sys.stderr)
        return 2
    except (P2PDaemonError, RuntimeError) as e:  # e.g. none of --initial-peers answered
        from swarmgrad.peer.cli.swarm_access import unreachable_line
        line = unreachable_line(e, initial_peers)
        print(f"could not join the swarm: {line or (str(e).strip().splitlines()[-1] if str(e).strip() else repr(e))}",
              file=sys.stderr)
        if private is not None:
            private.close()
        return 1
    log = logging.getLogger("swarmgrad")
    code = 0
    try:  # from here on, whatever fails, the DHT (a child process and its p2pd) is shut down
        print("swarmgrad peer", dht.peer_id, "run", manifest.run_id, "manifest", manifest.hash[:12], flush=True)
        print(f"  reachability {network.mode} ({network.reason})", flush=True)
        from swarmgrad.peer.net.reachability import visible_maddrs
        for addr in visible_maddrs(dht):
            print(f"  visible at {addr}{' (this machine only)' if _is_loopback(addr) else ''}", flush=True)
        publisher = None
        if published is not None:
            from swarmgrad.peer.public.directory import Publisher, RunDirectory
            publisher = Publisher(RunDirectory(dht, manifest.timeouts.dht), published)
            print(f"  public run {published.run_id}: others join with `swarmgrad peer --run {published.run_id} "
                  "--initial-peers ADDRESS`, ADDRESS one of the above", flush=True)
        if options.voucher or options.owner_key is not None:
            print(f"  anchor of run {manifest.run_id}: its records carry the owner's voucher"
                  f"{' (renewed as it runs)' if options.voucher == b'' else _voucher_until(options.voucher)}", flush=True)
        admission = checkpoints = None
        resume_round = 0
        if private is not None:
            admission = private.admission(dht)
            checkpoints = private.checkpoint_source(model, admission)
            resume_round = private.resume_round()
        from swarmgrad.peer.cli import status_line
        handler = None
        if status_line.wants_status_line(sys.stdout, getattr(args, "no_status_line", False)):  # a terminal: the live line
            from swarmgrad.peer.averaging.credit import tokens_per_sample
            line = status_line.StatusLine(str(dht.peer_id), tokens_per_sample(manifest))
            options = dataclasses.replace(options, event_sink=_both(options.event_sink, line.observe))
            handler = status_line.install(sys.stdout, line)
        try:
            peer = Peer(manifest, model, PeerNetwork.from_dht(dht, key=key), options, admission=admission,
                        checkpoints=checkpoints, resume_round=resume_round)
            asyncio.run(_run_peer(peer, manifest.timeouts.shutdown, log, publisher))
        finally:
            if handler is not None:
                status_line.uninstall(handler)
        if peer.revoked:
            print("this peer was revoked by the run's coordinator", file=sys.stderr)
            code = 3
    except Exception:
        log.exception("peer failed")
        code = 1
    finally:
        dht.shutdown()
        if private is not None:
            private.close()
    return code


def _anchor_options(args: argparse.Namespace, manifest, key) -> dict[str, Any] | str:  # type: ignore[no-untyped-def]
    """PeerOptions fields that make this peer an anchor of its public run (`--voucher FILE`, or
    `--owner-key`: it vouches for itself), or the one-line error of a voucher that does not hold."""
    from swarmgrad.peer.cli.public import PublicRunError, read_own_voucher
    from swarmgrad.peer.net.identity import peer_id_of
    if getattr(args, "voucher", None):
        try:
            return {"voucher": read_own_voucher(args.voucher, manifest, peer_id_of(key))}
        except PublicRunError as e:
            return f"--voucher {args.voucher}: {e}"
    if args.owner_key:
        from swarmgrad.peer.net.identity import load_key
        return {"owner_key": load_key(Path(args.owner_key))}  # sign_own_run loaded it already
    return {}


def _voucher_until(blob: bytes) -> str:
    from swarmgrad.peer.net.vouchers import read_voucher
    return f" until {time.strftime('%Y-%m-%d %H:%M', time.gmtime(read_voucher(blob)[0].expires_at))} UTC"


def _public_flags_conflict(args: argparse.Namespace) -> str | None:
    """The one-line usage error of a contradictory choice of run (private, public by name, own), or None."""
    private = args.join or args.coordinator
    if private and (args.run or args.owner_key or getattr(args, "voucher", None)):
        return "--run, --owner-key and --voucher are for public runs; a private run (--join, --coordinator) has a coordinator"
    if getattr(args, "voucher", None) and args.owner_key:
        return "--owner-key makes the peer vouch for itself: leave --voucher out"
    if args.run and args.manifest:
        return "--run fetches the run's signed manifest: leave --manifest out (or give --manifest alone)"
    if args.owner_key and not args.manifest:
        return "--owner-key signs the run's manifest: give it with --manifest PATH"
    return None


def _is_loopback(maddr: str) -> bool:
    parts = maddr.strip("/").split("/")
    return len(parts) >= 2 and parts[0] in ("ip4", "ip6") and parts[1] in ("127.0.0.1", "::1")


def _both(first: Callable[[dict], None] | None, second: Callable[[dict], None]) -> Callable[[dict], None]:
    if first is None:
        return second

    def sink(record: dict) -> None:
        first(record)
        second(record)
    return sink


def with_local_files(signed: Manifest, local: Manifest) -> Manifest:
    """A private run's manifest as its coordinator signed it, with where this machine keeps the run's
    files (data.tokenizer, data.base_dir: not hashed) taken from `local`, this machine's copy: the
    coordinator's paths name files on its own machine. Raises ValueError (one clause) when `local`
    is another run."""
    if local.hash != signed.hash:
        raise ValueError(f"is not the run's manifest (the coordinator signed {signed.hash[:12]}, "
                         f"this one is {local.hash[:12]})")
    return dataclasses.replace(signed, data=local.data)


def _clock(t: float) -> str:
    import time
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


async def _run_peer(peer, shutdown_s: float, log: logging.Logger, publisher: Any = None) -> None:
    """Run the peer until it ends or a signal arrives; after a signal it has `timeouts.shutdown`
    seconds to leave cleanly before its tasks are abandoned. `publisher` (a public run's
    public.directory.Publisher) keeps the run's manifest in the DHT meanwhile; it is cancelled and
    awaited on the way out."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: the terminal closed
        loop.add_signal_handler(sig, stop.set)
    publishing = asyncio.create_task(publisher.run(stop), name="publish-manifest") if publisher else None
    try:
        await _run_until_stopped(peer, stop, shutdown_s, log)
    finally:
        if publishing is not None:
            publishing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await publishing


async def _run_until_stopped(peer, stop: asyncio.Event, shutdown_s: float, log: logging.Logger) -> None:
    run = asyncio.create_task(peer.run(stop), name="peer")
    stopper = asyncio.create_task(stop.wait(), name="stop-signal")
    await asyncio.wait([run, stopper], return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if not run.done():
        try:
            await within(asyncio.shield(run), shutdown_s)
        except asyncio.TimeoutError:
            log.error("the peer did not stop within timeouts.shutdown (%.0fs); abandoning it", shutdown_s)
            _log_pending(log)
            run.cancel()
            return
    run.result()


def _log_pending(log: logging.Logger) -> None:
    """Where each unfinished task waits: what a shutdown that overran its deadline was stuck on."""
    for task in asyncio.all_tasks():
        if task is asyncio.current_task() or task.done():
            continue
        frames = task.get_stack(limit=3)
        where = " <- ".join(f"{f.f_code.co_name} ({f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno})"
                            for f in reversed(frames)) or "no frame"
        log.error("  still running: %s at %s", task.get_name(), where)


def exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def cmd_relay(args: argparse.Namespace) -> int:
    """A public peer that trains nothing: a DHT node whose p2pd relays for peers behind NAT
    (docs/nat.md). p2pd reserves relay slots at once only when it knows 4 relays or more."""
    import time

    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

    from swarmgrad.peer.cli.swarm_access import initial_peers
    from swarmgrad.peer.net.reachability import plan, visible_maddrs
    try:
        network = plan("public", args.host_maddrs, args.announce_maddrs)
        args.initial_peers = initial_peers(args.initial_peers, args.bootstrap_file)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, exit_on_signal)
    try:
        dht = start_dht(list(args.initial_peers), args.host_maddrs, args.announce_maddrs, args.identity,
                         args.timeout, network=network.dht_kwargs, bootstrap_wait=args.bootstrap_wait)
    except (P2PDaemonError, RuntimeError) as e:
        from swarmgrad.peer.cli.swarm_access import unreachable_line
        line = unreachable_line(e, args.initial_peers)
        print(f"could not join the swarm: {line or (str(e).strip().splitlines()[-1] if str(e).strip() else repr(e))}",
              file=sys.stderr)
        return 1
    log = logging.getLogger("swarmgrad.relay")
    try:
        print("swarmgrad relay", dht.peer_id, flush=True)
        for addr in visible_maddrs(dht):
            print("  visible at", addr, flush=True)
        while True:  # the daemons do the work; say now and then that we are alive
            time.sleep(60)
            log.info("relay %s alive", str(dht.peer_id)[-8:])
    except (KeyboardInterrupt, SystemExit):
        return 0
    finally:
        dht.shutdown()
