"""Hostile actors against an in-process swarm (tests/support/swarm.py): ids that never trained
write what any peer can write — stage records, round registrations, outcome votes, each signed by
its own (fresh) id as the real DHT requires — and one of them serves a state of its own making.
What a stranger with a modified peer can do over the wire, without running a replica."""
from __future__ import annotations

import asyncio
from typing import Any

import torch

from swarmgrad.peer.averaging.group import group_hash
from swarmgrad.peer.averaging.outcome import vote
from swarmgrad.peer.model import from_manifest
from swarmgrad.peer.net.dht_view import SwarmView
from swarmgrad.peer.net.rpc import FramedRPC, Traffic, stage_namespace
from swarmgrad.peer.pipeline.stage_server import refusal
from swarmgrad.peer.records import ONLINE, PeerRecord
from swarmgrad.peer.state.stage_state import StageState
from swarmgrad.peer.state.sync import state_response
from swarmgrad.protocol import wire_pb2 as pb

from support.dht import swarm_view
from support.swarm import InProcessSwarm, peer_ids


def forged_state(swarm: InProcessSwarm, stage: int, applied_rounds: int, round_no: int, seed: int = 666) -> StageState:
    """A state of `stage`'s shapes that nobody trained: random weights, a claimed position."""
    state = StageState(from_manifest(swarm.manifest).build_stage(stage), swarm.manifest.outer)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in state.params.values():
            p.copy_(torch.randn(p.shape, generator=g))
    state.applied_rounds = applied_rounds
    state.trained_samples = 10 ** 9
    state.commit(round_no)
    return state


class Forgers:
    """`n` fresh ids (none ever ran a replica) writing into `swarm`'s DHT."""

    def __init__(self, swarm: InProcessSwarm, n: int, seed: str = "sybil"):
        self.swarm = swarm
        self.ids = peer_ids(n, seed)
        self.views: dict[str, SwarmView] = {p: swarm_view(swarm.dht, p, swarm.manifest) for p in self.ids}
        self._servers: list[FramedRPC] = []

    async def announce(self, stage: int, *, applied_rounds: int, digest: str, round_no: int, driver: bool = False,
                       throughput: float = 1e6) -> None:
        for p, view in self.views.items():
            await view.announce(PeerRecord(peer_id=p, stage=stage, state=ONLINE, throughput=throughput,
                                           round=round_no, applied_rounds=applied_rounds, digest=digest,
                                           manifest_hash=self.swarm.manifest.hash, driver=driver))

    async def register(self, stage: int, rounds: range, *, applied_rounds: int, digest: str,
                       weight: float = 1e9, ids: list[str] | None = None) -> None:
        """Registrations for every round of `rounds`, and votes among the forgers for each (a
        "completed round" of their own: every forger votes the same group hash and digest)."""
        ids = self.ids if ids is None else ids
        own_hash = group_hash(tuple(sorted(ids)))
        for r in rounds:
            for p in ids:
                view = self.views[p]
                await view.register_round(stage, r, p, {"digest": digest, "applied_rounds": applied_rounds,
                                                        "weight": weight})
                await view.post_check(stage, r, p, vote(own_hash, "f" * 24))

    async def serve_state(self, stage: int, state: StageState, peer: str | None = None) -> str:
        """One forger answers `state` requests for `stage` with `state`'s snapshot; its id."""
        peer = peer or self.ids[0]
        rpc = FramedRPC(self.swarm.net.node(peer), stage_namespace(self.swarm.manifest.run_id, stage), Traffic(),
                        max_message_bytes=64 << 20)
        snap = state.snapshot
        assert snap is not None

        async def handle(request: pb.StateRequest, caller: Any) -> pb.StateResponse:
            return state_response(snap, list(request.names) or None)

        await rpc.add_handler("state", pb.StateRequest, handle, refusal(pb.StateResponse))
        self._servers.append(rpc)
        return peer

    async def close(self) -> None:
        await asyncio.gather(*(s.remove_handlers() for s in self._servers), return_exceptions=True)
