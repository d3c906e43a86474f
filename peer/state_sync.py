"""State sync: serving a stage's committed θ_global and outer momentum, and fetching it from a
replica. The receiver validates names and shapes against its own stage and recomputes the
digest, so a truncated, tampered or mismatched state is refused rather than trained on."""
from __future__ import annotations

from swarmgrad.compression import get_codec
from swarmgrad.peer.rpc import FramedRPC
from swarmgrad.peer.state import StateSnapshot, state_digest
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.framing import ProtocolError
from swarmgrad.protocol.validation import RunIdentity, decode_named, encoded_to_proto, envelope


def state_response(snapshot: StateSnapshot) -> pb.StateResponse:
    """The snapshot in full precision (fp32): state sync is the one place parameters travel whole."""
    fp32 = get_codec("fp32")

    def named(tensors: dict) -> list[pb.NamedTensor]:
        return [pb.NamedTensor(name=n, tensor=encoded_to_proto(fp32.encode(t))) for n, t in tensors.items()]

    return pb.StateResponse(status=pb.OK, round=snapshot.round, state_digest=snapshot.digest,
                            applied_rounds=snapshot.applied_rounds, params=named(snapshot.params),
                            momentum=named(snapshot.momentum))


async def fetch_state(rpc: FramedRPC, peer: str, identity: RunIdentity, stage: int,
                      shapes: dict[str, tuple[int, ...]], max_numel: int, timeout: float) -> StateSnapshot:
    """Download and check a replica's state. Raises RPCFailed or ProtocolError (with the reason)."""
    resp = await rpc.call(peer, "state", pb.StateRequest(envelope=envelope(identity, stage)), pb.StateResponse,
                          timeout=timeout)
    if resp.status != pb.OK:
        raise ProtocolError(resp.status, resp.reason)
    params = decode_named(resp.params, shapes, max_numel, "state params")
    momentum = decode_named(resp.momentum, shapes, max_numel, "state momentum") if len(resp.momentum) else {}
    digest = state_digest(params, momentum)
    if digest != resp.state_digest:
        raise ProtocolError(pb.BAD_REQUEST, "state does not match its declared digest")
    return StateSnapshot(params, momentum, resp.round, resp.applied_rounds, digest)
