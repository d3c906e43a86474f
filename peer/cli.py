"""`swarmgrad peer | status | demo`: the command line. It only parses flags, sets up logging and
hivemind, and hands over to the daemon; no training logic lives here."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

DEFAULT_MANIFEST = Path(__file__).resolve().parent / "defaults" / "tiny-gpt.toml"


def _setup_logging(verbose: bool) -> None:
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    os.environ.setdefault("GOLOG_LOG_LEVEL", "error")
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _start_dht(initial_peers: list[str], host_maddrs: list[str], announce_maddrs: list[str],
               identity: str | None, timeout: float, key=None, authorizer=None, network: dict | None = None):
    """Start this peer's DHT under an Ed25519 identity whose key swarmgrad holds, with the record
    signer every peer of a swarm runs (peer/record_signing.py). `identity`: a key file to reuse,
    created (Ed25519) if missing; None: a fresh key, written to a private temp folder only
    while p2pd starts. `network`: the reachability plan's DHT/libp2p options (peer/reachability.py).
    Raises identity.IdentityError for a key file swarmgrad cannot use."""
    from contextlib import nullcontext

    from hivemind import DHT

    from swarmgrad.peer.identity import ephemeral_key_file, load_or_create, peer_id_of
    from swarmgrad.peer.record_signing import SignedRecordValidator
    if identity:
        key = load_or_create(Path(identity))
        key_file = nullcontext((Path(identity), key))
    else:
        key_file = ephemeral_key_file(key)
    with key_file as (path, key):
        # check_if_identity_free=False: hivemind's check parses RSA key files only (PeerID.from_identity)
        kwargs = dict(initial_peers=initial_peers or None, host_maddrs=host_maddrs, start=True,
                      startup_timeout=timeout, identity_path=str(path), check_if_identity_free=False,
                      record_validators=[SignedRecordValidator(key)])
        if authorizer is not None:
            kwargs["authorizer"] = authorizer
        if announce_maddrs:
            kwargs["announce_maddrs"] = announce_maddrs
        kwargs.update(network or {})
        dht = DHT(**kwargs)
    if str(dht.peer_id) != peer_id_of(key):  # p2pd runs with another key: every record we sign would be refused
        dht.shutdown()
        raise RuntimeError(f"p2pd runs as {dht.peer_id}, not as the identity key's {peer_id_of(key)}")
    return dht


def cmd_peer(args: argparse.Namespace) -> int:
    from swarmgrad.peer.manifest import ManifestError, load
    from swarmgrad.peer.reachability import plan as network_plan
    try:
        network = network_plan(args.reachability, args.host_maddrs, args.announce_maddrs)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if not network.serves:  # a client drives: stage 0, and it never moves to a stage others must dial
        if args.stage not in ("auto", 0):
            print(f"--reachability client drives stage 0 and serves no other stage (got --stage {args.stage})",
                  file=sys.stderr)
            return 2
        args.stage, args.rebalance = 0, "off"
    private = None
    key = None
    if args.join or args.coordinator:  # a private run: admission first, the manifest comes signed
        from swarmgrad.peer.coordinator.client import CoordinatorUnavailable
        from swarmgrad.peer.coordinator.credentials import CredentialError
        from swarmgrad.peer.identity import IdentityError, load_or_create
        from swarmgrad.peer.private import join
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
            if local.hash != manifest.hash:
                print(f"--manifest {args.manifest} is not the run's manifest (the coordinator signed "
                      f"{manifest.hash[:12]}, this one is {local.hash[:12]}); leave --manifest out", file=sys.stderr)
                return 2
        print(f"admitted to run {manifest.run_id} as {private.admitted.certificate.peer_id} until "
              f"{_clock(private.admitted.certificate.expires_at)}", flush=True)
    else:
        if not args.manifest:
            print("--manifest is required (or --join INVITATION for a private run)", file=sys.stderr)
            return 2
        try:
            manifest = load(args.manifest)
        except ManifestError as e:
            print(e, file=sys.stderr)
            return 2
    if args.stage != "auto" and args.stage >= manifest.stages.count:
        print(f"--stage {args.stage}: the run has stages 0..{manifest.stages.count - 1}", file=sys.stderr)
        return 2
    from swarmgrad.peer.daemon import Peer, PeerOptions
    from swarmgrad.peer.model import from_manifest
    model = from_manifest(manifest)
    if args.device.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            print(f"--device {args.device}: CUDA is not available on this machine", file=sys.stderr)
            return 2
    stage = None if args.stage == "auto" else args.stage
    if private is not None and stage is None and private.admitted.certificate.stage is not None:
        stage = private.admitted.certificate.stage  # the invitation pinned a stage
    options = PeerOptions(stage=stage, device=args.device,
                          events_path=args.events, save_dir=args.save_dir, data_seed=args.data_seed,
                          max_rounds=args.max_rounds, linger=args.linger, slowdown=args.slowdown,
                          byzantine=args.byzantine,
                          max_memory=_parse_bytes(args.max_memory) if args.max_memory else None,
                          rebalance=args.rebalance, metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                          reachability=network.mode)
    # Until the event loop takes over the signals, SIGTERM ends the process through SystemExit, so
    # the `finally` below still shuts down a DHT that was started.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    # The DHT forks: start it before torch spins up threads (and before CUDA is initialised).
    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

    from swarmgrad.peer.identity import IdentityError
    initial_peers = list(args.initial_peers) or (list(private.admitted.initial_peers) if private else [])
    try:
        dht = _start_dht(initial_peers, args.host_maddrs, args.announce_maddrs, args.identity,
                         manifest.timeouts.state_download, key=key,
                         authorizer=private.authorizer() if private else None, network=network.dht_kwargs)
    except IdentityError as e:
        print(f"--identity {e}", file=sys.stderr)
        return 2
    except (P2PDaemonError, RuntimeError) as e:  # e.g. none of --initial-peers answered
        print(f"could not join the swarm: {str(e).strip().splitlines()[-1] if str(e).strip() else e!r}",
              file=sys.stderr)
        if private is not None:
            private.close()
        return 1
    log = logging.getLogger("swarmgrad")
    code = 0
    try:  # from here on, whatever fails, the DHT (a child process and its p2pd) is shut down
        print("swarmgrad peer", dht.peer_id, "run", manifest.run_id, "manifest", manifest.hash[:12], flush=True)
        print(f"  reachability {network.mode} ({network.reason})", flush=True)
        from swarmgrad.peer.reachability import visible_maddrs
        for addr in visible_maddrs(dht):
            print("  visible at", addr, flush=True)
        admission = checkpoints = None
        if private is not None:
            admission = private.admission(dht)
            checkpoints = private.checkpoint_source(model, admission)
        peer = Peer(manifest, model, dht, options, admission=admission, checkpoints=checkpoints)
        asyncio.run(_run_peer(peer, manifest.timeouts.shutdown, log))
    except Exception:
        log.exception("peer failed")
        code = 1
    finally:
        dht.shutdown()
        if private is not None:
            private.close()
    return code


def _clock(t: float) -> str:
    import time
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


async def _run_peer(peer, shutdown_s: float, log: logging.Logger) -> None:
    """Run the peer until it ends or a signal arrives; after a signal it has `timeouts.shutdown`
    seconds to leave cleanly before its tasks are abandoned."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    run = asyncio.create_task(peer.run(stop), name="peer")
    stopper = asyncio.create_task(stop.wait(), name="stop-signal")
    await asyncio.wait([run, stopper], return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if not run.done():
        try:
            await asyncio.wait_for(asyncio.shield(run), shutdown_s)
        except asyncio.TimeoutError:
            log.error("the peer did not stop within timeouts.shutdown (%.0fs); abandoning it", shutdown_s)
            run.cancel()
            return
    run.result()


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _parse_bytes(text: str) -> int:
    """'8G', '512M', '1.5GiB', '1000000' -> bytes (binary units)."""
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1] if t and t[-1] in units else ""
    try:
        value = float(t[:-1] if unit else t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--max-memory: {text!r} is not a size like 8G or 512M") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"--max-memory must be > 0 (got {text!r})")
    return int(value * units[unit])


def _memory_arg(text: str) -> str:
    _parse_bytes(text)
    return text


def _slowdown_arg(text: str) -> float:
    value = _nonneg_float(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (1: full speed; got {value})")
    return value


def _stage_arg(text: str) -> str | int:
    return text if text == "auto" else _nonneg_int(text, "must be 'auto' or a stage index")


def _nonneg_int(text: str, what: str = "must be an integer") -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}, not {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (got {value})")
    return value


def _port_arg(text: str) -> int:
    value = _nonneg_int(text, "must be a port number")
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 0..65535 (got {value})")
    return value


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, not {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (got {value})")
    return value


def cmd_relay(args: argparse.Namespace) -> int:
    """A public peer that trains nothing: a DHT node whose p2pd relays for peers behind NAT
    (docs/nat.md). p2pd reserves relay slots at once only when it knows 4 relays or more."""
    import time

    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

    from swarmgrad.peer.reachability import plan, visible_maddrs
    network = plan("public", args.host_maddrs, args.announce_maddrs)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        dht = _start_dht(list(args.initial_peers), args.host_maddrs, args.announce_maddrs, args.identity,
                         args.timeout, network=network.dht_kwargs)
    except (P2PDaemonError, RuntimeError) as e:
        print(f"could not join the swarm: {str(e).strip().splitlines()[-1] if str(e).strip() else e!r}",
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


def cmd_status(args: argparse.Namespace) -> int:
    from swarmgrad.peer.status import print_status
    return print_status(args.initial_peers, args.run_id, args.manifest, args.json, args.timeout)


def cmd_demo(args: argparse.Namespace) -> int:
    from swarmgrad.peer.demo import run_demo
    return run_demo(manifest_path=Path(args.manifest), rounds=args.rounds, replicas=args.replicas,
                    workdir=Path(args.workdir) if args.workdir else None, round_seconds=args.round_seconds)


def cmd_simulate(args: argparse.Namespace) -> int:
    from swarmgrad.peer.sim_report import run_cli
    return run_cli(peers=args.peers, hours=args.hours, seed=args.seed, policy=args.policy, as_json=args.json,
                   plot=args.plot)


# ------------------------------------------------------------------------------ private runs

def _load_key(path: str):
    from swarmgrad.peer.identity import load_key
    return load_key(Path(path))


def _run_id_from(coordinator: str, key, run_id: str | None) -> str:
    """The run id: --run-id, or the one in the manifest the coordinator serves signed by `key`."""
    if run_id:
        return run_id
    from swarmgrad.peer.coordinator.client import CoordinatorUnavailable, served_run_id
    from swarmgrad.peer.identity import peer_id_of
    try:
        return served_run_id(coordinator, peer_id_of(key))
    except CoordinatorUnavailable as e:
        raise RuntimeError(f"{e}; give --run-id") from None


def cmd_keygen(args: argparse.Namespace) -> int:
    from swarmgrad.peer.identity import peer_id_of, write_key_file
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
    print(f"wrote {args.out}; public key (coordinator id): {peer_id_of(key)}")
    return 0


def cmd_invite(args: argparse.Namespace) -> int:
    from swarmgrad.peer.coordinator.credentials import make_invitation
    from swarmgrad.peer.identity import IdentityError
    try:
        key = _load_key(args.key)
        run_id = _run_id_from(args.coordinator, key, args.run_id)
    except (IdentityError, RuntimeError) as e:
        print(e, file=sys.stderr)
        return 2
    except Exception as e:  # a manifest not signed by this key
        print(f"the coordinator at {args.coordinator} does not hold this key: {e}", file=sys.stderr)
        return 2
    invitation = make_invitation(key, run_id, args.coordinator, expires_in=args.expires, stage=args.stage)
    print(invitation.encode())
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    from swarmgrad.peer.coordinator.client import CoordinatorClient, CoordinatorUnavailable
    from swarmgrad.peer.coordinator.credentials import Authority, CredentialError, revoke_order
    from swarmgrad.peer.identity import IdentityError, is_peer_id, peer_id_of
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
    from swarmgrad.peer.identity import IdentityError
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
                                  metrics_port=args.metrics_port)
    except ValueError as e:  # a state dir of another run
        print(e, file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _exit_on_signal)
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
    from swarmgrad.peer.coordinator.checkpoints import export_model
    try:
        round, n = export_model(Path(args.state_dir), Path(args.out), args.round)
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {n} tensors of the checkpoint of round {round}")
    return 0


def _duration_arg(text: str) -> float:
    from swarmgrad.peer.coordinator.credentials import parse_duration
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _address_arg(text: str) -> str:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return text


def _positive_int(text: str) -> int:
    value = _nonneg_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarmgrad", description="Decentralized low-bandwidth pipeline training.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("peer", help="run a peer: join (or start) a swarm and serve one stage")
    p.add_argument("--manifest", default=None, help="run manifest (TOML); a private run's comes from its coordinator")
    p.add_argument("--join", default=None, metavar="INVITATION",
                   help="join a private run with an invitation from `swarmgrad invite`")
    p.add_argument("--coordinator", default=None, type=_address_arg, metavar="HOST:PORT",
                   help="rejoin a private run with the certificate saved beside --identity at an earlier --join")
    p.add_argument("--initial-peers", nargs="*", default=[], metavar="MADDR",
                   help="multiaddrs of peers already in the swarm; none starts a new swarm")
    p.add_argument("--stage", default="auto", type=_stage_arg,
                   help="stage to serve: auto (fewest replicas) or an index")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--host-maddrs", nargs="*", default=["/ip4/127.0.0.1/tcp/0"], metavar="MADDR",
                   help="where to listen (default: loopback, a free port)")
    p.add_argument("--announce-maddrs", nargs="*", default=[], metavar="MADDR",
                   help="addresses other peers should dial (public IP behind NAT)")
    p.add_argument("--reachability", choices=("auto", "public", "relay", "client"), default="auto",
                   help="how other peers reach this one (docs/nat.md): public (dialable), relay (behind NAT: "
                        "served through a relay on its initial peers, hole punching where the NAT allows), client "
                        "(behind NAT, no relay: drives stage 0, serves nothing), auto (public on loopback or with "
                        "--announce-maddrs, else libp2p's AutoNAT and auto-relay decide)")
    p.add_argument("--identity", default=None,
                   help="Ed25519 key file for a stable peer id (created if missing; default: a fresh id each run)")
    p.add_argument("--events", default=None, metavar="PATH", help="append JSON-lines events here")
    p.add_argument("--save-dir", default=None, help="write the stage's θ_global (safetensors) after each round")
    p.add_argument("--data-seed", type=int, default=None, help="seed of this driver's data shard")
    p.add_argument("--max-rounds", type=_nonneg_int, default=None,
                   help="stop after this many rounds (overrides manifest; 0: until stopped)")
    p.add_argument("--slowdown", type=_slowdown_arg, default=1.0, metavar="F",
                   help="TESTING AID: make this peer's compute F times slower (a sleep of (F-1) x each measured "
                        "forward/backward), to emulate unequal devices on one machine")
    p.add_argument("--byzantine", choices=("scale", "random"), default=None,
                   help="TESTING AID: send hostile pseudo-gradients (scale: 100 x the honest one; random: noise "
                        "of 10 x its RMS), to measure robust averaging (benchmarks/byzantine.py)")
    p.add_argument("--max-memory", type=_memory_arg, default=None, metavar="SIZE",
                   help="memory this peer offers for a stage, e.g. 8G (default: what the device has)")
    p.add_argument("--rebalance", choices=("auto", "on", "off"), default="auto",
                   help="move to another stage when the placement policy says it pays (auto: only with --stage auto)")
    p.add_argument("--linger", type=_nonneg_float, default=60.0,
                   help="seconds a non-driver keeps serving after its last round while drivers evaluate")
    p.add_argument("--metrics-port", type=_port_arg, default=None, metavar="PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (0: a free port, in the started event)")
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="address the metrics server listens on (default 127.0.0.1)")
    p.set_defaults(fn=cmd_peer)

    rl = sub.add_parser("relay", help="run a public peer that trains nothing and relays for peers behind NAT")
    rl.add_argument("--initial-peers", nargs="*", default=[], metavar="MADDR")
    rl.add_argument("--host-maddrs", nargs="*", default=["/ip4/0.0.0.0/tcp/0"], metavar="MADDR")
    rl.add_argument("--announce-maddrs", nargs="*", default=[], metavar="MADDR")
    rl.add_argument("--identity", default=None, help="Ed25519 key file for a stable peer id")
    rl.add_argument("--timeout", type=_nonneg_float, default=60.0, help="seconds to start and join")
    rl.set_defaults(fn=cmd_relay)

    s = sub.add_parser("status", help="print the swarm as the DHT sees it")
    s.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR")
    group = s.add_mutually_exclusive_group(required=True)
    group.add_argument("--run-id", default=None)
    group.add_argument("--manifest", default=None, help="take the run id and stage count from this manifest")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.add_argument("--timeout", type=float, default=15.0)
    s.set_defaults(fn=cmd_status)

    d = sub.add_parser("demo", help="train the built-in tiny GPT on a local swarm of 4 peers and summarise")
    d.add_argument("--manifest", default=str(DEFAULT_MANIFEST))
    d.add_argument("--rounds", type=int, default=14)
    d.add_argument("--replicas", type=int, default=2, help="replicas per stage")
    d.add_argument("--round-seconds", type=float, default=None, help="override rounds.round_seconds")
    d.add_argument("--workdir", default=None, help="keep logs and events here (default: a temp dir)")
    d.set_defaults(fn=cmd_demo)

    m = sub.add_parser("simulate", help="play the placement policy over a simulated swarm with churn")
    m.add_argument("--peers", type=int, default=1000, help="mean number of peers")
    m.add_argument("--hours", type=float, default=3.0, help="simulated hours")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--policy", choices=["full", "no-margin"], default="full",
                   help="no-margin: move on any improvement, at once (the ablation)")
    m.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    m.add_argument("--plot", default=None, metavar="PNG", help="write throughput and optimum over time here")
    m.set_defaults(fn=cmd_simulate)

    k = sub.add_parser("keygen", help="create an Ed25519 key (a coordinator's, or a stable peer identity)")
    k.add_argument("--out", required=True, metavar="KEY")
    k.set_defaults(fn=cmd_keygen)

    i = sub.add_parser("invite", help="print a single-use invitation to a private run")
    i.add_argument("--key", required=True, metavar="KEY", help="the coordinator's key")
    i.add_argument("--coordinator", required=True, type=_address_arg, metavar="HOST:PORT",
                   help="where peers reach the coordinator (written into the invitation)")
    i.add_argument("--expires", type=_duration_arg, default=7 * 86400.0, metavar="DURATION",
                   help="e.g. 7d, 12h, 30m (default 7d)")
    i.add_argument("--stage", type=_nonneg_int, default=None, help="the stage the invited peer serves")
    i.add_argument("--run-id", default=None, help="the run id, if the coordinator is not running (default: ask it)")
    i.set_defaults(fn=cmd_invite)

    r = sub.add_parser("revoke", help="revoke a peer of a private run: every peer refuses it within a heartbeat")
    r.add_argument("--key", required=True, metavar="KEY", help="the coordinator's key")
    r.add_argument("--coordinator", default="127.0.0.1:7000", type=_address_arg, metavar="HOST:PORT")
    r.add_argument("peer_id")
    r.set_defaults(fn=cmd_revoke)

    c = sub.add_parser("coordinator", help="host a private run: admission, checkpoints, dashboard")
    c.add_argument("--manifest", required=True)
    c.add_argument("--key", required=True, metavar="KEY", help="from `swarmgrad keygen`")
    c.add_argument("--listen", default="0.0.0.0:7000", type=_address_arg, metavar="HOST:PORT", help="gRPC service")
    c.add_argument("--http", default=None, type=_address_arg, metavar="HOST:PORT", help="serve the dashboard here")
    c.add_argument("--state-dir", default="coordinator-state", metavar="DIR",
                   help="admitted peers, revocations, checkpoints (recovered on restart)")
    c.add_argument("--checkpoint-every", type=_positive_int, default=5, metavar="N", help="rounds between checkpoints")
    c.add_argument("--keep-checkpoints", type=_positive_int, default=3, metavar="K")
    c.add_argument("--certificate-ttl", type=_duration_arg, default=12 * 3600.0, metavar="DURATION",
                   help="how long a certificate lives; peers renew at half of it (default 12h)")
    c.add_argument("--host-maddrs", nargs="*", default=["/ip4/0.0.0.0/tcp/0"], metavar="MADDR",
                   help="where the coordinator's DHT node listens")
    c.add_argument("--announce-maddrs", nargs="*", default=[], metavar="MADDR")
    c.add_argument("--initial-peers", nargs="*", default=[], metavar="MADDR",
                   help="peers of the run already running (a restarted coordinator rejoins its swarm)")
    c.add_argument("--events", default=None, metavar="PATH", help="append JSON-lines events here")
    c.add_argument("--metrics-port", type=_port_arg, default=None, metavar="PORT",
                   help="serve Prometheus metrics on this port")
    c.set_defaults(fn=cmd_coordinator)

    e = sub.add_parser("export", help="write the whole model of a private run's newest checkpoint to one file")
    e.add_argument("--state-dir", required=True, metavar="DIR")
    e.add_argument("--out", required=True, metavar="FILE")
    e.add_argument("--round", type=_nonneg_int, default=None, help="a checkpoint other than the newest")
    e.set_defaults(fn=cmd_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
