"""Who can call whom behind NAT: bare hivemind DHT peers in network namespaces (docs/nat.md).

`--public N` public peers (the first is everyone's bootstrap) and two peers behind the tc NAT of
benchmarks/harness/netns.py (`drop_inbound_connections`): `nat`, which only ever calls the bootstrap peer,
and `probe`, which calls `nat` every 3 s (it never receives a connection from `nat`, so only a relay
or a connection `nat` opened could carry the call). `--probe-public` puts `probe` outside the NAT.
Prints each call's outcome and path (a direct address or `/p2p-circuit`) and a summary line:

    python -m benchmarks.nat_probe --public 1 --seconds 40                 # no relay: every call fails
    python -m benchmarks.nat_probe --public 4 --seconds 60 --relay         # relay reserved in ~13 s
    python -m benchmarks.nat_probe --public 1 --seconds 230 --relay        # reserved after 180 s
    python -m benchmarks.nat_probe --public 1 --seconds 230 --relay --prefix 10.77   # never: private

`--relay`: the NATed peers run as `--reachability relay` does (auto-relay, reachability forced
private, DHT client mode) and the public ones as `public`. Needs root and iproute2 (else it says why
and exits 0). Not a test: it takes minutes and its outcome is what docs/nat.md reports. `--quick`:
20 s; `--out DIR`: report.md and results.json (every call); nothing here is random (`--seed` is
accepted for the common flags and changes nothing).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.harness import module_command, module_env, netns
from benchmarks.harness.report import Report, add_common_args
from swarmgrad.peer.cli.launcher import LocalSwarm

PORT = 31331


def node(role: str, addr: str, out: Path, opts: dict, seconds: float) -> None:
    """One peer: a DHT with a `ping` handler; `target` (a role) is called every 3 s."""
    from hivemind import DHT
    from hivemind.p2p import P2PContext, PeerID
    from hivemind.proto import runtime_pb2

    target = opts.pop("target", None)
    dht = DHT(start=True, host_maddrs=[f"/ip4/{addr}/tcp/{PORT}"], **opts)
    (out / f"{role}.id.tmp").write_text(str(dht.peer_id))
    os.replace(out / f"{role}.id.tmp", out / f"{role}.id")

    async def ping(_: runtime_pb2.ExpertUID, ctx: P2PContext) -> runtime_pb2.ExpertUID:
        return runtime_pb2.ExpertUID(uid=role)

    async def main() -> None:
        p2p = await dht.replicate_p2p()
        await p2p.add_protobuf_handler("ping", ping, runtime_pb2.ExpertUID)
        t0 = time.time()
        while time.time() - t0 < seconds:
            await asyncio.sleep(3)
            if target is None or not (out / f"{target}.id").exists():
                continue
            peer = PeerID.from_base58((out / f"{target}.id").read_text())
            try:
                await asyncio.wait_for(p2p.call_protobuf_handler(peer, "ping", runtime_pb2.ExpertUID(uid=""),
                                                                 runtime_pb2.ExpertUID), 8)
                via = [str(a) for info in await p2p.list_peers() if info.peer_id == peer for a in info.addrs]
                line = dict(ok=True, via=via)
            except Exception as e:
                line = dict(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
            print(json.dumps(dict(t=round(time.time() - t0, 1), role=role, to=target, **line)), flush=True)

    asyncio.run(main())
    dht.shutdown()


def run(args: argparse.Namespace) -> int:
    seconds = 20.0 if args.quick and args.seconds is None else (args.seconds or 40.0)
    why = netns.why_unavailable()
    if why:
        print(f"SKIP: {why}")
        return 0
    netns.remove_stale()
    out = Path(f"/tmp/nat-probe-{os.getpid()}")
    out.mkdir()
    natted = dict(use_auto_relay=True, force_reachability="private", client_mode=True) if args.relay else {}
    public = dict(force_reachability="public") if args.relay else {}
    n = args.public + 2
    # the nodes are processes of a LocalSwarm (bare DHT nodes, not peers, so no manifest is read):
    # it stops every one's process group, p2pd included, whatever happens here
    with netns.WanNet("np", n, subnet=250, prefix=args.prefix) as net, \
            LocalSwarm(out / "no-manifest.toml", out, env={"PYTHONPATH": module_env()["PYTHONPATH"]}) as nodes:
        net.drop_inbound_connections(n - 2)
        if not args.probe_public:
            net.drop_inbound_connections(n - 1)

        def start(role: str, index: int, opts: dict) -> None:
            ep = net.endpoints[index]
            nodes.spawn(role, [*ep.exec_prefix(), *module_command("nat_probe"), "--node", role, ep.address, str(out),
                               json.dumps(opts), str(seconds)])

        start("public0", 0, dict(public))
        while not (out / "public0.id").exists():
            if not nodes.peers[0].alive:
                raise RuntimeError(f"public0 exited before it wrote its id:\n{nodes.peers[0].log_tail()}")
            time.sleep(0.2)
        boot = [f"/ip4/{net.endpoints[0].address}/tcp/{PORT}/p2p/{(out / 'public0.id').read_text()}"]
        for i in range(1, args.public):
            start(f"public{i}", i, dict(public, initial_peers=boot))
        start("nat", n - 2, dict(natted, initial_peers=boot, target="public0"))
        start("probe", n - 1, dict(public if args.probe_public else natted, initial_peers=boot, target="nat"))
        nodes.wait_exit(seconds + 90)
    calls = [json.loads(line) for line in (out / "probe.log").read_text().splitlines() if line.startswith("{")]
    report = Report("Who can call whom behind NAT", args.out)
    for c in calls:
        report.print(str(c))
    ok = [c for c in calls if c["ok"]]
    relayed = [c for c in ok if any("p2p-circuit" in a for a in c["via"])]
    report.print(f"probe -> nat: {len(ok)}/{len(calls)} calls ok, {len(relayed)} through a relay, first ok at "
                 f"{ok[0]['t'] if ok else None} s (public peers {args.public}, relay {args.relay}, prefix {args.prefix}); "
                 f"logs in {out}")
    report.results = {"public": args.public, "relay": args.relay, "prefix": args.prefix, "seconds": seconds,
                      "probe_public": args.probe_public, "calls": calls}
    report.finish()
    return 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--node":
        role, addr, out, opts, seconds = sys.argv[2:7]
        node(role, addr, Path(out), json.loads(opts), float(seconds))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, quick="20 s of calls", seed="nothing: no random choice here")
    parser.add_argument("--public", type=int, default=1, help="public peers (relay candidates)")
    parser.add_argument("--seconds", type=float, default=None, help="default 40 (20 with --quick)")
    parser.add_argument("--relay", action="store_true", help="NATed peers as --reachability relay, public as public")
    parser.add_argument("--probe-public", action="store_true", help="the calling peer is public")
    parser.add_argument("--prefix", default="11.77", help="first two octets (10.77: private addresses)")
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
