"""How a peer is reached: the `--reachability` choice and the libp2p options it means.

A volunteer behind NAT (or a firewall that drops inbound connections) can dial out but cannot be
dialled. libp2p keeps any connection open in both directions, so a peer the volunteer dialled can
call it back over that connection; a third peer cannot. What was measured in network namespaces
(docs/nat.md, tests/test_nat.py) with p2pd as hivemind 1.1.12 ships it:

- without a relay, a peer the NATed one never dialled fails every call to it ("all dials failed"),
  so a driver cannot send it microbatches and a replica cannot send it its averaging part;
- with `use_auto_relay` on the NATed peer, p2pd reserves a slot on a relay (by default its
  bootstrap peers, `trusted_relays`), the caller reaches it through the relay, and libp2p's hole
  punching (DCUtR) then replaces the relayed connection with a direct one where the NAT allows;
  where it does not (symmetric NAT), traffic stays on the relay;
- every public p2pd already offers relay hop (`-relayService`, on by default; 16 circuits, 4 GiB
  and 30 min per relayed connection): no swarmgrad flag is needed for a public peer to relay.

This module is the pure decision: a `NetworkPlan` from the flag and the listen/announce addresses.
The CLI passes `plan.dht_kwargs` to `hivemind.DHT` (which hands them to `P2P.create`).
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any, Sequence

MODES = ("auto", "public", "relay", "client")


@dataclass(frozen=True, kw_only=True)
class NetworkPlan:
    """What `--reachability` resolved to.

    mode: "public", "relay", "client", or "auto" where libp2p decides at run time (AutoNAT).
    serves: False for a client: it drives (stage 0) and serves nothing others must dial.
    dht_kwargs: passed to `hivemind.DHT(...)`.
    reason: why `auto` chose this mode (for the log and the `started` event).
    """
    mode: str
    serves: bool
    dht_kwargs: dict[str, Any] = field(default_factory=dict)
    reason: str = ""


def _host_of(maddr: str) -> str | None:
    parts = maddr.strip("/").split("/")
    return parts[1] if len(parts) >= 2 and parts[0] in ("ip4", "ip6") else None


def _loopback_only(host_maddrs: Sequence[str]) -> bool:
    hosts = [_host_of(m) for m in host_maddrs]
    try:
        return bool(hosts) and all(h is not None and ipaddress.ip_address(h).is_loopback for h in hosts)
    except ValueError:
        return False


def plan(reachability: str, host_maddrs: Sequence[str], announce_maddrs: Sequence[str]) -> NetworkPlan:
    """Resolve `--reachability` into libp2p options.

    - public: dialable as announced. `force_reachability="public"` so p2pd's relay service runs
      from the start instead of after AutoNAT agrees (AutoNAT never dials private addresses back,
      so on a LAN it would never agree).
    - relay: behind NAT but serving. p2pd reserves a relay slot on its bootstrap peers at once
      (`use_auto_relay` with reachability forced private); callers reach it through the relay, and
      hole punching upgrades the connection where the NAT allows. Its hivemind DHT runs in client mode so
      other peers do not route DHT lookups through its relay.
    - client: behind NAT, serves nothing: a DHT client that relays nothing and reserves nothing; it
      drives stage 0 and is reached only back over connections it opened.
    - auto: public when the peer listens on loopback only (a local swarm) or announces an address
      (the operator said where it is dialled); otherwise libp2p decides at run time: AutoNAT probes
      the peer's reachability and auto-relay reserves a slot only if it comes out private.

    Raises ValueError naming the flag for an unknown mode or a contradiction.
    """
    if reachability not in MODES:
        raise ValueError(f"--reachability must be one of {', '.join(MODES)} (got {reachability!r})")
    if reachability in ("relay", "client") and announce_maddrs:
        raise ValueError(f"--reachability {reachability} with --announce-maddrs: a peer that announces a dialable "
                         "address is public; drop one of them")
    if reachability == "public":
        return NetworkPlan(mode="public", serves=True, reason="--reachability public",
                           dht_kwargs=dict(use_relay=True, use_auto_relay=False, force_reachability="public"))
    if reachability == "relay":
        return NetworkPlan(mode="relay", serves=True, reason="--reachability relay",
                           dht_kwargs=dict(use_relay=True, use_auto_relay=True, force_reachability="private",
                                           client_mode=True))
    if reachability == "client":
        return NetworkPlan(mode="client", serves=False, reason="--reachability client",
                           dht_kwargs=dict(use_relay=True, use_auto_relay=False, force_reachability="private",
                                           client_mode=True))
    if announce_maddrs:
        return NetworkPlan(mode="public", serves=True, reason="auto: --announce-maddrs given",
                           dht_kwargs=dict(use_relay=True, use_auto_relay=False, force_reachability="public"))
    if _loopback_only(host_maddrs):
        return NetworkPlan(mode="public", serves=True, reason="auto: listening on loopback only",
                           dht_kwargs=dict(use_relay=True, use_auto_relay=False))
    return NetworkPlan(mode="auto", serves=True, reason="auto: libp2p AutoNAT decides; auto-relay if private",
                       dht_kwargs=dict(use_relay=True, use_auto_relay=True))


async def _visible_or_none(dht: Any, node: Any) -> list[str]:
    """Runs inside the DHT process (`DHT.run_coroutine`): catching the ValueError there keeps
    hivemind from logging it as an error with a traceback."""
    try:
        return [str(a) for a in await node.get_visible_maddrs()]
    except ValueError:
        return []


def visible_maddrs(dht: Any) -> tuple[str, ...]:
    """The addresses the DHT's p2p daemon announces, or () where it announces none: a peer whose
    reachability is private removes its public addresses until a relay gives it a relayed one
    (hivemind's `get_visible_maddrs` raises ValueError then; measured with --reachability relay on
    a public address, docs/nat.md)."""
    return tuple(dht.run_coroutine(_visible_or_none))
