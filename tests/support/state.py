"""Stage states and donors for the state-sync tests (test_state_parts, test_warm_join, test_join_hold,
test_phase)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from swarmgrad.peer.manifest import OuterOptConfig
from swarmgrad.peer.state.stage_state import StageState
from swarmgrad.peer.state.sync import state_response
from swarmgrad.protocol import wire_pb2 as pb


def trained(seed: int = 0) -> StageState:
    """A small stage state after one outer step (64 samples) committed at round 2; its weights and
    step drawn from `seed`."""
    torch.manual_seed(seed)
    state = StageState(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 8)), OuterOptConfig())
    state.apply_outer({n: torch.randn(s) for n, s in state.shapes.items()}, total_weight=64)
    state.commit(2)
    return state


class Donors:
    """Answers `state` calls from snapshots, as StateSync.handle does; records who got what. The
    donor named `tamper` zeroes the first buffer of its answer."""

    def __init__(self, snaps: dict[str, Any], tamper: str = ""):
        self.snaps, self.tamper, self.asked = snaps, tamper, []

    async def call(self, peer: str, method: str, request: pb.StateRequest, response_type: type, timeout: float):
        self.asked.append((peer, list(request.names)))
        resp = state_response(self.snaps[peer], list(request.names) or None)
        if peer == self.tamper:
            resp.params[0].tensor.buffers[0] = b"\0" * len(resp.params[0].tensor.buffers[0])
        return response_type.FromString(resp.SerializeToString())
