"""Issue 43, attacks 2, 4 and 6 (docs/trust.md: "Backups", "Join hold", "Round boundaries"), each as
a stranger's (or one admitted peer's) probe of real code: the wire where a live replica is needed
(tests/support/swarm.py: real peers in one event loop, a stranger's client over the loopback
transport), the handler or the pure decision where that shows it."""
from __future__ import annotations

import asyncio

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.utils import get_dht_time

from swarmgrad.compression import get_codec
from swarmgrad.peer.net.rpc import FramedRPC, Traffic, stage_namespace
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.validation import encoded_to_proto, raw_from_tensor

from support.swarm import InProcessSwarm, step_manifest

pytestmark = pytest.mark.timeout(120)


# --- 6: rounds end on the driver's signature, never on the `driver` field -----------------------
def test_a_request_naming_a_driver_does_not_end_a_later_stages_round(inprocess) -> None:
    """A stranger sends stage 1 a forward request that names the run's listed driver and the next
    round. Before: the replica ended its round on it (one request per round and the stage runs ahead
    of its drivers, training without averaging). Now it is refused WRONG_ROUND unless the request
    carries the driver's signature of that round; a genuine ticket moves it one round, and the same
    ticket cannot move it a second time."""
    m = step_manifest(10_000)  # one long round: nothing but the probes may end it

    def sign(key: Ed25519PrivateKey, round_no: int) -> bytes:
        from swarmgrad.peer.net.round_tickets import RoundSigner  # here: the probe without one runs on any code
        return RoundSigner(key, m.run_id, m.hash).ticket(round_no)

    def request(driver: str, round_no: int, ticket: bytes = b"") -> pb.ForwardRequest:
        batch, seq = 2, m.model.seq_len
        x, y = torch.randn(batch, seq, m.model.d_model), torch.randint(0, 256, (batch, seq))
        req = pb.ForwardRequest(envelope=pb.Envelope(run_id=m.run_id, manifest_hash=m.hash, stage=1),
                                microbatch_id=7, driver=driver,
                                activations=encoded_to_proto(get_codec(m.pipeline.activation_codec).encode(x)),
                                targets=raw_from_tensor(y), deadline=get_dht_time() + 2.0, eval_only=True,
                                round=round_no)
        if ticket:
            req.round_ticket = ticket
        return req

    async def scenario() -> None:
        async with InProcessSwarm(m) as swarm:
            driver, stage1 = swarm.start(0), swarm.start(1)
            await swarm.wait_for(stage1, lambda e: e["event"] == "online", 30, "stage 1 online")
            await swarm.wait_for(driver, lambda e: e["event"] == "online", 30, "the driver online")
            clock = stage1.peer.replicas[0].clock
            now = clock.current
            rpc = FramedRPC(swarm.client("intruder"), stage_namespace(m.run_id, 1), Traffic(),
                            max_message_bytes=1 << 24)
            for ticket in (lambda: b"", lambda: sign(Ed25519PrivateKey.generate(), now + 1), lambda: b"\0" * 64):
                answer = await rpc.call(stage1.peer_id, "forward", request(driver.peer_id, now + 1, ticket()),
                                        pb.ForwardResponse, timeout=20)
                assert clock.seen <= now and clock.current == now, f"a stranger ended stage 1's round: {answer}"
                assert answer.status == pb.WRONG_ROUND and "ticket" in answer.reason, answer
            assert driver.alive and stage1.alive

            # the driver's own ticket of the next round does end it (what the driver's requests carry)
            genuine = sign(driver.key, now + 1)
            await rpc.call(stage1.peer_id, "forward", request(driver.peer_id, now + 1, genuine), pb.ForwardResponse,
                           timeout=20)
            assert clock.seen == now + 1
            await swarm.until(lambda: clock.current == now + 1, 30, "stage 1 in the next round")
            # replayed for the round after: it signs round now + 1 only
            answer = await rpc.call(stage1.peer_id, "forward", request(driver.peer_id, now + 2, genuine),
                                    pb.ForwardResponse, timeout=20)
            assert answer.status == pb.WRONG_ROUND and "ticket" in answer.reason, answer
            assert clock.seen == now + 1 and clock.current == now + 1

    inprocess(scenario)
