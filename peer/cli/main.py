"""`swarmgrad ...`: the command line. It parses flags, sets up logging and hands over: the peer
and relay commands to peer/cli/peer.py, a private run's host commands to peer/cli/private.py,
the argument types to peer/cli/args.py. No training logic lives here."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from swarmgrad.peer.cli.args import (address_arg, duration_arg, fraction_arg, memory_arg, nonneg_float, nonneg_int,
                                     port_arg, positive_float, positive_int, slowdown_arg, stage_arg)
from swarmgrad.peer.cli.peer import BOOTSTRAP_WAIT_S, cmd_peer, cmd_relay
from swarmgrad.peer.cli.export import cmd_generate
from swarmgrad.peer.cli.private import cmd_coordinator, cmd_export, cmd_invite, cmd_keygen, cmd_revoke
from swarmgrad.peer.cli.public import VOUCHER_DAYS, cmd_runs, cmd_vouch
from swarmgrad.peer.cli.swarm_access import add_initial_peer_flags

DEFAULT_MANIFEST = Path(__file__).resolve().parent.parent / "defaults" / "tiny-llama.toml"


def _setup_logging(verbose: bool) -> None:
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    os.environ.setdefault("GOLOG_LOG_LEVEL", "error")
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def cmd_status(args: argparse.Namespace) -> int:
    from swarmgrad.peer.cli.status import print_status
    from swarmgrad.peer.cli.swarm_access import initial_peers, run_swarm_command
    try:
        peers = initial_peers(args.initial_peers, args.bootstrap_file)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    from swarmgrad.peer.cli.public import PublicRunError
    try:
        if args.contributors or args.out:
            from swarmgrad.peer.cli.monitor import print_contributors
            return run_swarm_command("status", lambda: print_contributors(
                peers, args.run_id, args.manifest, args.json, args.timeout, args.out, run=args.run), peers)
        return run_swarm_command("status", lambda: print_status(peers, args.run_id, args.manifest, args.json,
                                                                 args.timeout, run=args.run), peers)
    except PublicRunError as e:
        print(f"swarmgrad status: {e}", file=sys.stderr)
        return 1


def cmd_monitor(args: argparse.Namespace) -> int:
    if not args.run and not args.manifest:
        print("swarmgrad monitor: give --run NAME (or --manifest PATH)", file=sys.stderr)
        return 2
    from swarmgrad.peer.cli.monitor import cmd_monitor as run_monitor
    return run_monitor(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from swarmgrad.peer.cli.demo import run_demo
    return run_demo(manifest_path=Path(args.manifest), rounds=args.rounds, replicas=args.replicas,
                    workdir=Path(args.workdir) if args.workdir else None, round_seconds=args.round_seconds)


def cmd_simulate(args: argparse.Namespace) -> int:
    from swarmgrad.peer.sim.report import run_cli
    return run_cli(peers=args.peers, hours=args.hours, seed=args.seed, policy=args.policy, as_json=args.json,
                   plot=args.plot, link_mbit=args.link_mbit, hosted_link_mbit=args.hosted_link_mbit,
                   pinned_share=args.pinned_share, pinned_stage=args.pinned_stage, claims=args.claims,
                   claims_stage_share=args.claims_stage_share, forged_records=args.forged_records,
                   forged_stage=args.forged_stage)


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    from swarmgrad.peer.cli.tokenizer import train_tokenizer
    return train_tokenizer(args.files, args.vocab_size, Path(args.out), args.source, args.text_field)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarmgrad", description="Decentralized low-bandwidth pipeline training.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("peer", help="run a peer: join (or start) a swarm and serve one stage")
    p.add_argument("--manifest", default=None, help="run manifest (TOML); a private run's comes from its coordinator")
    p.add_argument("--run", default=None, metavar="NAME[@FINGERPRINT]",
                   help="join a public run by name: its owner-signed manifest (and tokenizer file) is fetched from "
                        "the swarm, verified and cached (docs/public-runs.md)")
    p.add_argument("--owner-key", default=None, metavar="KEY",
                   help="start (or rejoin) the public run of --manifest as its owner: the manifest is signed with "
                        "this key from `swarmgrad keygen`, and the run is NAME@FINGERPRINT")
    p.add_argument("--voucher", default=None, metavar="FILE",
                   help="the run owner's voucher for this peer (from `swarmgrad vouch`; give --identity, the key it "
                        "names): this peer is an anchor of the public run, with a voice from the start")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="where --run caches verified manifests and tokenizer files (default $SWARMGRAD_CACHE/runs, "
                        "~/.cache/swarmgrad/runs)")
    p.add_argument("--join", default=None, metavar="INVITATION",
                   help="join a private run with an invitation from `swarmgrad invite`")
    p.add_argument("--coordinator", default=None, type=address_arg, metavar="HOST:PORT",
                   help="rejoin a private run with the certificate saved beside --identity at an earlier --join")
    add_initial_peer_flags(p, "multiaddrs of peers already in the swarm; none starts a new swarm")
    p.add_argument("--bootstrap-wait", type=nonneg_float, default=BOOTSTRAP_WAIT_S, metavar="SECONDS",
                   help="keep trying --initial-peers this long while none answers (peers launched together "
                        f"come up in any order; default {BOOTSTRAP_WAIT_S:.0f})")
    p.add_argument("--stage", default="auto", type=stage_arg,
                   help="stage to serve: auto (the placement rule picks the stage serving least, within memory) or an index")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--compute-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="what the forwards compute in: auto (the manifest's model.dtype on CUDA, float32 on "
                        "the CPU), float32 or bfloat16 (autocast; weights and optimiser state stay fp32)")
    p.add_argument("--host-maddrs", nargs="*", default=["/ip4/0.0.0.0/tcp/0"], metavar="MADDR",
                   help="where to listen (default: every interface, a free port; it announces the interfaces' "
                        "addresses, never 0.0.0.0)")
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
    p.add_argument("--data-seed", type=int, default=None, help="seed of this driver's random windows (unused with data.shards: drivers lease shards)")
    p.add_argument("--max-rounds", type=nonneg_int, default=None,
                   help="stop after this many rounds (overrides manifest; 0: until stopped)")
    p.add_argument("--slowdown", type=slowdown_arg, default=1.0, metavar="F",
                   help="TESTING AID: make this peer's compute F times slower (a sleep of (F-1) x each measured "
                        "forward/backward), to emulate unequal devices on one machine")
    p.add_argument("--rate-clock", choices=("wall", "cpu"), default="wall",
                   help="TESTING AID: cpu measures the announced rate in the compute thread's CPU time, so that "
                        "peers sharing one machine's cores (tests, benchmarks) measure themselves, not their "
                        "neighbours (needs OMP_NUM_THREADS=1, as LocalSwarm sets)")
    p.add_argument("--byzantine", choices=("scale", "random"), default=None,
                   help="TESTING AID: send hostile pseudo-gradients (scale: 100 x the honest one; random: noise "
                        "of 10 x its RMS), to measure robust averaging (benchmarks/byzantine.py)")
    p.add_argument("--max-memory", type=memory_arg, default=None, metavar="SIZE",
                   help="memory this peer offers for a stage, e.g. 8G (default: what the device has)")
    p.add_argument("--rebalance", choices=("auto", "on", "off"), default="auto",
                   help="move to another stage when the placement policy says it pays (auto: only with --stage auto)")
    p.add_argument("--linger", type=nonneg_float, default=60.0,
                   help="seconds a non-driver keeps serving after its last round while drivers evaluate")
    p.add_argument("--metrics-port", type=port_arg, default=None, metavar="PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (0: a free port, in the started event)")
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="address the metrics server listens on (default 127.0.0.1)")
    p.add_argument("--no-status-line", action="store_true",
                   help="plain log lines even on a terminal (default: a live status line under the log when "
                        "stdout is a terminal)")
    p.set_defaults(fn=cmd_peer)

    rl = sub.add_parser("relay", help="run a public peer that trains nothing and relays for peers behind NAT")
    add_initial_peer_flags(rl, "multiaddrs of peers in the swarm; none starts a new swarm")
    rl.add_argument("--host-maddrs", nargs="*", default=["/ip4/0.0.0.0/tcp/0"], metavar="MADDR")
    rl.add_argument("--announce-maddrs", nargs="*", default=[], metavar="MADDR")
    rl.add_argument("--identity", default=None, help="Ed25519 key file for a stable peer id")
    rl.add_argument("--timeout", type=nonneg_float, default=60.0, help="seconds to start and join")
    rl.add_argument("--bootstrap-wait", type=nonneg_float, default=BOOTSTRAP_WAIT_S, metavar="SECONDS",
                    help="keep trying --initial-peers this long while none answers")
    rl.set_defaults(fn=cmd_relay)

    s = sub.add_parser("status", help="print the swarm as the DHT sees it")
    add_initial_peer_flags(s, "multiaddrs of peers in the swarm")
    group = s.add_mutually_exclusive_group(required=True)
    group.add_argument("--run-id", default=None)
    group.add_argument("--manifest", default=None, help="take the run id and stage count from this manifest")
    group.add_argument("--run", default=None, metavar="NAME[@FINGERPRINT]",
                       help="a public run: its owner-signed manifest, read from the swarm and verified")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.add_argument("--timeout", type=float, default=15.0)
    s.add_argument("--contributors", action="store_true",
                   help="print the contributors' credit (samples, tokens, rounds) for the completed rounds the DHT "
                        "still holds, counted from the rounds' votes")
    s.add_argument("--out", default=None, metavar="FILE", help="with --contributors: also write its JSON here")
    s.set_defaults(fn=cmd_status)

    ru = sub.add_parser("runs", help="list the public runs a swarm hosts, each as NAME@FINGERPRINT")
    add_initial_peer_flags(ru, "multiaddrs of peers in the swarm")
    ru.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ru.add_argument("--timeout", type=positive_float, default=15.0, metavar="SECONDS",
                    help="deadline of each DHT read (and of joining the swarm)")
    ru.set_defaults(fn=cmd_runs)

    mo = sub.add_parser("monitor", help="serve the dashboard of a run with no coordinator (a public run), read "
                                        "from the DHT")
    add_initial_peer_flags(mo, "multiaddrs of peers in the swarm")
    mo.add_argument("--run", default=None, metavar="NAME[@FINGERPRINT]",
                    help="the run: a public run's name (its verified manifest is read from the swarm), or any "
                         "run's run_id")
    mo.add_argument("--manifest", default=None,
                    help="the run's manifest: its stage count, tokens per sample and the rounds' capacity")
    mo.add_argument("--http", default="127.0.0.1:8080", type=address_arg, metavar="HOST:PORT",
                    help="serve the dashboard here (default 127.0.0.1:8080)")
    mo.add_argument("--http-allow-host", action="append", default=[], metavar="NAME",
                    help="a host name the dashboard answers to, besides localhost and IP addresses (repeatable; "
                         "other Host headers get 403: DNS rebinding)")
    mo.add_argument("--ledger", default=None, metavar="FILE",
                    help="keep the contributors' credit in this file, so a restarted monitor goes on counting")
    mo.add_argument("--interval", type=positive_float, default=5.0, metavar="SECONDS",
                    help="seconds between two reads of the swarm (default 5)")
    mo.add_argument("--timeout", type=positive_float, default=15.0, help="seconds to join the DHT and per read")
    mo.set_defaults(fn=cmd_monitor)

    d = sub.add_parser("demo", help="train the built-in tiny Llama (a BPE of the stdlib's sources) on a local swarm of 4 peers "
                                           "and summarise")
    d.add_argument("--manifest", default=str(DEFAULT_MANIFEST))
    d.add_argument("--rounds", type=positive_int, default=14)
    d.add_argument("--replicas", type=positive_int, default=2, help="replicas per stage")
    d.add_argument("--round-seconds", type=positive_float, default=None, help="override rounds.round_seconds")
    d.add_argument("--workdir", default=None, help="keep logs and events here (default: a temp dir)")
    d.set_defaults(fn=cmd_demo)

    m = sub.add_parser("simulate", help="play the placement policy over a simulated swarm with churn")
    m.add_argument("--peers", type=positive_int, default=1000, help="mean number of peers")
    m.add_argument("--hours", type=nonneg_float, default=3.0, help="simulated hours")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--policy", choices=["full", "no-margin"], default="full",
                   help="no-margin: move on any improvement, at once (the ablation)")
    m.add_argument("--link-mbit", type=nonneg_float, default=100.0,
                   help="median link of a peer, Mbit/s (log-normal; state downloads and backups)")
    m.add_argument("--hosted-link-mbit", type=nonneg_float, default=1000.0,
                   help="median link of the data-centre GPUs (T4, V100, A10, A100, H100); 0: as --link-mbit")
    m.add_argument("--pinned-share", type=fraction_arg, default=0.0, metavar="F",
                   help="share of peers that never move (--stage N, NAT clients): what pinning costs")
    m.add_argument("--pinned-stage", type=nonneg_int, default=None, metavar="N",
                   help="the stage pinned peers serve (default: a newcomer's choice on arrival; 0: NAT clients)")
    m.add_argument("--claims", choices=("trusted", "record", "stage"), default="trusted",
                   help="how placement counts records: as they come, the daemon's bound per record, or also "
                        "per stage (docs/trust.md, \"Placement capacity\")")
    m.add_argument("--claims-stage-share", type=nonneg_float, default=0.0, metavar="K",
                   help="with --claims stage: unproven records of a stage count together for at most "
                        "max(one top replica, K x its proven capacity); the daemon's is 0")
    m.add_argument("--forged-records", type=nonneg_int, default=0, metavar="N",
                   help="an attack: N fresh ids with ONLINE records claiming 100x the fastest rate")
    m.add_argument("--forged-stage", type=nonneg_int, default=0, metavar="S", help="the stage they write under")
    m.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    m.add_argument("--plot", default=None, metavar="PNG", help="write throughput and optimum over time here")
    m.set_defaults(fn=cmd_simulate)

    k = sub.add_parser("keygen", help="create an Ed25519 key (a coordinator's, or a stable peer identity)")
    k.add_argument("--out", required=True, metavar="KEY")
    k.set_defaults(fn=cmd_keygen)

    v = sub.add_parser("vouch", help="vouch for a peer of your public run with its owner key: an anchor, with a "
                                     "voice from the start (docs/public-runs.md)")
    v.add_argument("--owner-key", required=True, metavar="KEY", help="the run's owner key (`swarmgrad keygen`)")
    who = v.add_mutually_exclusive_group(required=True)
    who.add_argument("--peer-id", default=None, metavar="ID", help="the peer id to vouch for")
    who.add_argument("--identity", default=None, metavar="FILE", help="the peer's key file (`swarmgrad peer --identity`)")
    run = v.add_mutually_exclusive_group(required=True)
    run.add_argument("--run", default=None, metavar="NAME[@FINGERPRINT]", help="the run (any manifest of it)")
    run.add_argument("--manifest", default=None, metavar="PATH", help="the run's manifest (this manifest only)")
    v.add_argument("--days", type=float, default=VOUCHER_DAYS, metavar="N",
                   help=f"how long the voucher holds (default {VOUCHER_DAYS:g})")
    v.add_argument("--out", required=True, metavar="FILE", help="where to write the voucher")
    v.set_defaults(fn=cmd_vouch)

    i = sub.add_parser("invite", help="print a single-use invitation to a private run")
    i.add_argument("--key", required=True, metavar="KEY", help="the coordinator's key")
    i.add_argument("--coordinator", required=True, type=address_arg, metavar="HOST:PORT",
                   help="where peers reach the coordinator (written into the invitation)")
    i.add_argument("--expires", type=duration_arg, default=7 * 86400.0, metavar="DURATION",
                   help="e.g. 7d, 12h, 30m (default 7d)")
    i.add_argument("--stage", type=nonneg_int, default=None, help="the stage the invited peer serves")
    i.add_argument("--run-id", default=None, help="the run id, if the coordinator is not running (default: ask it)")
    i.set_defaults(fn=cmd_invite)

    r = sub.add_parser("revoke", help="revoke a peer of a private run: every peer refuses it within a heartbeat")
    r.add_argument("--key", required=True, metavar="KEY", help="the coordinator's key")
    r.add_argument("--coordinator", default="127.0.0.1:7000", type=address_arg, metavar="HOST:PORT")
    r.add_argument("peer_id")
    r.set_defaults(fn=cmd_revoke)

    c = sub.add_parser("coordinator", help="host a private run: admission, checkpoints, dashboard")
    c.add_argument("--manifest", required=True)
    c.add_argument("--key", required=True, metavar="KEY", help="from `swarmgrad keygen`")
    c.add_argument("--listen", default="0.0.0.0:7000", type=address_arg, metavar="HOST:PORT", help="gRPC service")
    c.add_argument("--http", default=None, type=address_arg, metavar="HOST:PORT", help="serve the dashboard here")
    c.add_argument("--http-allow-host", action="append", default=[], metavar="NAME",
                   help="a host name the dashboard answers to, besides localhost and IP addresses (repeatable; "
                        "other Host headers get 403: DNS rebinding)")
    c.add_argument("--state-dir", default="coordinator-state", metavar="DIR",
                   help="admitted peers, revocations, checkpoints (recovered on restart)")
    c.add_argument("--checkpoint-every", type=positive_int, default=5, metavar="N", help="rounds between checkpoints")
    c.add_argument("--keep-checkpoints", type=positive_int, default=3, metavar="K")
    c.add_argument("--certificate-ttl", type=duration_arg, default=12 * 3600.0, metavar="DURATION",
                   help="how long a certificate lives; peers renew at half of it (default 12h)")
    c.add_argument("--host-maddrs", nargs="*", default=["/ip4/0.0.0.0/tcp/0"], metavar="MADDR",
                   help="where the coordinator's DHT node listens")
    c.add_argument("--announce-maddrs", nargs="*", default=[], metavar="MADDR")
    c.add_argument("--initial-peers", nargs="*", default=[], metavar="MADDR",
                   help="peers of the run already running (a restarted coordinator rejoins its swarm)")
    c.add_argument("--events", default=None, metavar="PATH", help="append JSON-lines events here")
    c.add_argument("--metrics-port", type=port_arg, default=None, metavar="PORT",
                   help="serve Prometheus metrics on this port")
    c.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="address the metrics server listens on (default 127.0.0.1; 0.0.0.0 for a remote Prometheus)")
    c.set_defaults(fn=cmd_coordinator)

    t = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer for a run (docs/data.md)")
    tsub = t.add_subparsers(dest="tokenizer_command", required=True)
    tt = tsub.add_parser("train", help="train a byte-level BPE on text and print the manifest lines that pin it")
    tt.add_argument("--files", nargs="+", required=True, metavar="GLOB",
                    help="text files, folders or globs (** recursive), read in sorted order")
    tt.add_argument("--vocab-size", type=positive_int, required=True, metavar="N",
                    help="tokens in the vocabulary, with the 256 bytes and the special tokens")
    tt.add_argument("--out", required=True, metavar="FILE", help="where to write the tokenizer (JSON)")
    tt.add_argument("--source", choices=("files", "jsonl", "parquet", "hf-disk"), default="files",
                    help="how to read --files: as text (default) or documents of a row source, as data.source")
    tt.add_argument("--text-field", default="text", help="the JSON key or column of the text (row sources)")
    tt.set_defaults(fn=cmd_tokenizer_train)

    e = sub.add_parser("export", help="write the whole model of a private run's newest checkpoint to one file, "
                                      "or (--format hf) a llama run's model as a Hugging Face folder")
    e.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                   help="safetensors: one file, names stage{s}.*; hf: config.json, model.safetensors, tokenizer")
    e.add_argument("--state-dir", default=None, metavar="DIR", help="a coordinator's state dir")
    e.add_argument("--save-dir", nargs="+", default=None, metavar="DIR",
                   help="peers' --save-dir folders (hf only; one per stage or one holding all)")
    e.add_argument("--manifest", default=None, metavar="PATH",
                   help="the run's manifest (needed with --save-dir; default with --state-dir: the checkpoint's)")
    e.add_argument("--tokenizer", default=None, metavar="PATH", help="hf: the run's tokenizer.json, if not the "
                                                                      "manifest's data.tokenizer")
    e.add_argument("--out", required=True, metavar="PATH", help="the file (safetensors) or folder (hf)")
    e.add_argument("--round", type=nonneg_int, default=None, help="a checkpoint other than the newest")
    e.set_defaults(fn=cmd_export)

    g = sub.add_parser("generate", help="continue a prompt with an exported model (needs swarmgrad[hf])")
    g.add_argument("--model", required=True, metavar="DIR", help="a folder `export --format hf` wrote")
    g.add_argument("--prompt", required=True, metavar="TEXT")
    g.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    g.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0: greedy")
    g.add_argument("--seed", type=int, default=0, help="sampling seed")
    g.set_defaults(fn=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
