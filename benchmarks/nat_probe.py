"""Who can call whom behind NAT: bare hivemind DHT peers in network namespaces (docs/nat.md).

`--public N` public peers (the first is everyone's bootstrap) and two peers behind the tc NAT of
benchmarks/netns.py (`drop_inbound_connections`): `nat`, which only ever calls the bootstrap peer,
and `probe`, which calls `nat` every 3 s (it never receives a connection from `nat`, so only a relay
or a connection `nat` opened could carry the call). `--probe-public` puts `probe` outside the NAT.
Prints each call's outcome and path (a direct address or `/p2p-circuit`) and a summary line:

    python benchmarks/nat_probe.py --public 1 --seconds 40                 # no relay: every call fails
    python benchmarks/nat_probe.py --public 4 --seconds 60 --relay         # relay reserved in ~13 s
    python benchmarks/nat_probe.py --public 1 --seconds 230 --relay        # reserved after 180 s
    python benchmarks/nat_probe.py --public 1 --seconds 230 --relay --prefix 10.77   # never: private

`--relay`: the NATed peers run as `--reachability relay` does (auto-relay, reachability forced
private, DHT client mode) and the public ones as `public`. Needs root and iproute2 (else it says why
and exits 0). Not a test: it takes minutes and its outcome is what docs/nat.md reports.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import netns  # noqa: E402

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
    why = netns.why_unavailable()
    if why:
        print(f"SKIP: {why}")
        return 0
    netns.remove_stale()
    out = Path(f"/tmp/nat-probe-{os.getpid()}")
    out.mkdir()
    natted = dict(use_auto_relay=True, force_reachability="private", client_mode=True) if args.relay else {}
    public = dict(force_reachability="public") if args.relay else {}
    procs: list[subprocess.Popen] = []
    n = args.public + 2
    with netns.WanNet("np", n, subnet=250, prefix=args.prefix) as net:
        net.drop_inbound_connections(n - 2)
        if not args.probe_public:
            net.drop_inbound_connections(n - 1)
        boot = None

        def start(role: str, index: int, opts: dict) -> None:
            ep = net.endpoints[index]
            cmd = [*ep.exec_prefix(), sys.executable, __file__, "--node", role, ep.address, str(out),
                   json.dumps(opts), str(args.seconds)]
            procs.append(subprocess.Popen(cmd, stdout=open(out / f"{role}.log", "w"), stderr=subprocess.STDOUT,
                                          start_new_session=True))

        try:
            start("public0", 0, dict(public))
            while not (out / "public0.id").exists():
                time.sleep(0.2)
            boot = [f"/ip4/{net.endpoints[0].address}/tcp/{PORT}/p2p/{(out / 'public0.id').read_text()}"]
            for i in range(1, args.public):
                start(f"public{i}", i, dict(public, initial_peers=boot))
            start("nat", n - 2, dict(natted, initial_peers=boot, target="public0"))
            start("probe", n - 1, dict(public if args.probe_public else natted, initial_peers=boot, target="nat"))
            for p in procs:
                p.wait(args.seconds + 90)
        finally:
            for p in procs:
                try:
                    os.killpg(p.pid, 9)
                except ProcessLookupError:
                    pass
    calls = [json.loads(line) for line in (out / "probe.log").read_text().splitlines() if line.startswith("{")]
    for c in calls:
        print(c)
    ok = [c for c in calls if c["ok"]]
    relayed = [c for c in ok if any("p2p-circuit" in a for a in c["via"])]
    print(f"probe -> nat: {len(ok)}/{len(calls)} calls ok, {len(relayed)} through a relay, first ok at "
          f"{ok[0]['t'] if ok else None} s (public peers {args.public}, relay {args.relay}, prefix {args.prefix}); "
          f"logs in {out}")
    return 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--node":
        role, addr, out, opts, seconds = sys.argv[2:7]
        node(role, addr, Path(out), json.loads(opts), float(seconds))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--public", type=int, default=1, help="public peers (relay candidates)")
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--relay", action="store_true", help="NATed peers as --reachability relay, public as public")
    parser.add_argument("--probe-public", action="store_true", help="the calling peer is public")
    parser.add_argument("--prefix", default="11.77", help="first two octets (10.77: private addresses)")
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
