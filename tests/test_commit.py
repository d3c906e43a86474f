"""Commit on acknowledgement, in one event loop (a driver, two replicas of the last stage, a
loopback RPC): a microbatch whose answer is lost and that the driver re-sends elsewhere is trained
once, not twice; held gradients equal what a plain backward would have added."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from swarmgrad.compression import parse_codec_spec
from swarmgrad.peer.clock import RoundClock
from swarmgrad.peer.pipeline.driver import Driver
from swarmgrad.peer.model import from_manifest
from swarmgrad.peer.pipeline.stage_server import Downstream, StageServer
from swarmgrad.peer.pipeline.routing import BanList
from swarmgrad.peer.net.rpc import RPCFailed, stage_namespace
from swarmgrad.peer.compute.schedule import TrainingProgress
from swarmgrad.peer.records import ONLINE, PeerRecord
from swarmgrad.peer.compute.worker import StageWorker
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.framing import ProtocolError
from swarmgrad.protocol.validation import RunIdentity, StageContract

from conftest import small_manifest
from support.until import until

pytestmark = pytest.mark.timeout(60)

DRIVER, A, B = "QmDriver0", "QmReplicaA", "QmReplicaB"


class Net:
    """Loopback calls to in-process servers; `lose_answer` names a peer whose next answer to a
    forward is computed and then lost on the way back (the caller sees a failed call)."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.servers: dict[str, StageServer] = {}
        self.lose_answer: set[str] = set()
        self.calls: list[tuple[str, str]] = []

    async def call(self, peer: str, method: str, request: Any, response_type: type, timeout: float,
                   timing: Any = None) -> Any:
        self.calls.append((peer, method))
        server = self.servers[peer]
        handler = server.handle if method == "forward" else server.commit
        wire = type(request).FromString(request.SerializeToString())
        try:
            response = await handler(wire, DRIVER)
        except ProtocolError as e:
            response = response_type(status=e.status, reason=e.reason)
        if method == "forward" and peer in self.lose_answer:
            self.lose_answer.discard(peer)
            raise RPCFailed(f"forward to {peer}: stream reset")
        return response_type.FromString(response.SerializeToString())


class Swarm:
    async def stage_records(self, stage: int) -> list[PeerRecord]:
        # A looks much faster: the first attempt goes to it
        return [PeerRecord(peer_id=p, stage=stage, state=ONLINE, throughput=t, round=0, applied_rounds=0,
                           digest="d", manifest_hash="h", driver=False) for p, t in ((A, 1e5), (B, 1e-3))]


def _worker(module, m, loss_fn, clock) -> StageWorker:
    return StageWorker(module, m.inner, torch.device("cpu"), loss_fn, clock, TrainingProgress(m.schedule),
                       commit_timeout=0.3)


def _setup():
    m = small_manifest(inner={"microbatches_per_step": 4}, timeouts={"commit": 0.3})
    model = from_manifest(m)
    identity = RunIdentity(m.run_id, m.hash)
    clocks = {p: RoundClock(m.rounds, counts_steps=p == DRIVER, max_rounds=0, epoch=None) for p in (DRIVER, A, B)}
    torch.manual_seed(0)
    stage1 = model.build_stage(1)
    workers = {DRIVER: _worker(model.build_stage(0), m, None, clocks[DRIVER])}
    for p in (A, B):
        module = model.build_stage(1)
        module.load_state_dict(stage1.state_dict())
        workers[p] = _worker(module, m, model.loss_fn, clocks[p])
    contract = StageContract(stage=1, n_stages=2, max_batch=m.inner.microbatch_size,
                             input_spec=lambda b: model.input_spec(1, b), targets_spec=model.targets_spec,
                             vocab_size=m.model.vocab_size)
    net = Net(stage_namespace(m.run_id, 1))
    for p in (A, B):
        net.servers[p] = StageServer(identity, contract, workers[p], None, parse_codec_spec("fp32"), 1 << 24,
                                     clocks[p], max_deadline_s=30.0)
    downstream = Downstream(identity, net, Swarm(), BanList(5.0, 60.0), parse_codec_spec("fp32"), 1 << 24, seed=0)
    driver = Driver(m, workers[DRIVER], downstream, DRIVER, 2, iter(()), lambda *a, **k: None, clocks[DRIVER])
    batch = torch.randint(0, 256, (m.inner.microbatch_size, m.model.seq_len + 1))
    return net, workers, driver, batch[:, :-1], batch[:, 1:]


def test_a_lost_answer_is_trained_once() -> None:
    async def main() -> None:
        net, workers, driver, inputs, targets = _setup()
        net.lose_answer.add(A)
        loss = await driver.train_microbatch(inputs, targets)
        assert loss is not None and driver.stats.retries == 1
        assert [c for c in net.calls if c[1] == "forward"] == [(A, "forward"), (B, "forward")]
        await driver.flush_commits()
        assert workers[B].tally.accumulated == 1 and workers[B].held == 0  # committed by the driver
        assert workers[A].tally.accumulated == 0 and workers[A].held == 1  # computed, answer lost: held
        await until(lambda: workers[A].held == 0, "A drops its held microbatch once timeouts.commit passed")
        assert workers[A].held == 0 and workers[A].uncommitted == 1 and workers[A].tally.accumulated == 0
        assert all(p.grad is None for p in workers[A].module.parameters())
        assert workers[DRIVER].tally.accumulated == 1  # the driver's own stage: once
        for w in workers.values():
            w.close()
    asyncio.run(main())


def test_held_gradients_equal_a_plain_backward() -> None:
    async def main() -> None:
        net, workers, driver, inputs, targets = _setup()
        reference = workers[B]
        # the last stage's input is the first stage's output
        _, h = await workers[DRIVER].forward(inputs, train=False)
        await reference.forward_loss(h, targets, True)  # plain: adds to .grad
        plain = [p.grad.clone() for p in reference.module.parameters()]
        other = workers[A]
        loss, _ = await other.forward_loss_held((DRIVER, 1, 0), h, targets)
        assert other.held == 1 and all(p.grad is None for p in other.module.parameters())
        assert await other.commit([(DRIVER, 1, 0), (DRIVER, 99, 0)]) == 1  # unknown keys are skipped
        for g, p in zip(plain, other.module.parameters()):
            torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-7)
        assert other.tally.accumulated == 1 and other.losses == [loss]
        # what round events report (the chaos soak counts duplicates by id): the one committed, once
        assert other.take_committed() == [f"{DRIVER[-8:]}:1"] and other.take_committed() == []
        for w in workers.values():
            w.close()
    asyncio.run(main())


def test_only_the_driver_commits_and_a_step_waits_for_held() -> None:
    async def main() -> None:
        net, workers, driver, inputs, targets = _setup()
        _, h = await workers[DRIVER].forward(inputs, train=False)
        w = workers[A]
        await w.forward_loss_held((DRIVER, 5, 0), h, targets)
        server = net.servers[A]
        request = pb.CommitRequest(envelope=pb.Envelope(run_id=server.identity.run_id,
                                                        manifest_hash=server.identity.manifest_hash, stage=1),
                                   microbatch_ids=[5], attempts=[0])
        stranger = await server.commit(request, "QmSomebodyElse")
        assert stranger.committed == 0 and w.held == 1  # keyed by the caller: not the driver's microbatch
        # a forced step (the round boundary) waits for the held microbatch to be committed or dropped
        pause = asyncio.create_task(w.pause())
        await asyncio.sleep(0.05)
        assert not pause.done()
        assert (await server.commit(request, DRIVER)).committed == 1
        await asyncio.wait_for(pause, 2.0)
        assert w.inner_steps == 1 and w.tally.accumulated == 0
        for worker in workers.values():
            worker.close()
    asyncio.run(main())


def test_only_a_listed_driver_moves_a_replica_a_round_ahead() -> None:
    from swarmgrad.compression import get_codec
    from swarmgrad.protocol.validation import encoded_to_proto, envelope, raw_from_tensor
    from hivemind.utils import get_dht_time

    async def main() -> None:
        net, workers, driver, inputs, targets = _setup()
        server = net.servers[A]
        listed = {DRIVER}

        async def is_driver(peer_id: str) -> bool:
            return peer_id in listed

        server.drivers = is_driver
        _, h = await workers[DRIVER].forward(inputs, train=False)

        def request(driver_id: str) -> pb.ForwardRequest:
            return pb.ForwardRequest(envelope=envelope(server.identity, 1), microbatch_id=1, driver=driver_id,
                                     activations=encoded_to_proto(get_codec("fp32").encode(h)),
                                     targets=raw_from_tensor(targets), deadline=get_dht_time() + 30, eval_only=True,
                                     round=server.clock.current + 1)

        with pytest.raises(ProtocolError) as refused:
            await server.handle(request("QmNotADriver"), "QmNotADriver")
        assert refused.value.status == pb.WRONG_ROUND and "not a driver" in refused.value.reason
        assert server.clock.seen <= server.clock.current  # our round was not cut short
        answer = await server.handle(request(DRIVER), DRIVER)
        assert answer.status == pb.NOT_READY and server.clock.seen == server.clock.current + 1
        for w in workers.values():
            w.close()
    asyncio.run(main())


def test_a_request_of_the_next_round_is_held_until_the_round_is_over() -> None:
    """timeouts.between_rounds: a replica that ends its round because a microbatch of the next one
    arrived serves that microbatch once it has resumed, instead of refusing it (the driver would
    send its activations again); without a resume within the hold, it is refused NOT_READY."""
    import time

    from hivemind.utils import get_dht_time

    from swarmgrad.compression import get_codec
    from swarmgrad.protocol.validation import encoded_to_proto, envelope, raw_from_tensor

    async def main() -> None:
        net, workers, driver, inputs, targets = _setup()
        server, w = net.servers[A], workers[A]
        server.hold_s = 10.0
        _, h = await workers[DRIVER].forward(inputs, train=False)

        def request(microbatch: int, ahead: int = 1) -> pb.ForwardRequest:
            return pb.ForwardRequest(envelope=envelope(server.identity, 1), microbatch_id=microbatch, driver=DRIVER,
                                     activations=encoded_to_proto(get_codec("fp32").encode(h)),
                                     targets=raw_from_tensor(targets), deadline=get_dht_time() + 30,
                                     round=server.clock.current + ahead)

        answer = asyncio.create_task(server.handle(request(1), DRIVER))
        await until(lambda: server.clock.seen == server.clock.current + 1, "the server saw the next round")
        assert not answer.done() and server.clock.seen == server.clock.current + 1  # held; our round ends
        await w.pause()  # what the round runner does: pause, average, advance, resume
        # a late one of the round being ended is refused at once: its driver must get on to its own boundary
        late = await asyncio.wait_for(server.handle(request(9, ahead=0), DRIVER), 1.0)
        assert late.status == pb.NOT_READY and server.refused == 1
        server.clock.advance(server.clock.current + 1)
        await asyncio.sleep(0.1)
        assert not answer.done() and w.held == 0  # still paused: nothing computed
        await w.resume()
        served = await asyncio.wait_for(answer, 10)
        assert served.status == pb.OK and w.held == 1 and server.refused == 1

        server.hold_s = 0.3  # the next round's request, and this time the round does not end in time
        started = time.monotonic()
        refused = await server.handle(request(2), DRIVER)
        assert refused.status == pb.NOT_READY and time.monotonic() - started >= 0.3 and server.refused == 2
        assert w.held + w.uncommitted == 1  # the first (dropped uncommitted after 0.3 s), none of the refused one

        server.hold_s = 10.0  # a replica that will not resume (it moves away, or stops) holds nothing
        held = asyncio.create_task(server.handle(request(3), DRIVER))
        await asyncio.sleep(0.1)
        assert not held.done()
        await w.leave()
        assert (await asyncio.wait_for(held, 1.0)).status == pb.NOT_READY
        assert (await asyncio.wait_for(server.handle(request(4), DRIVER), 1.0)).status == pb.NOT_READY
        for worker in workers.values():
            worker.close()
    asyncio.run(main())


def test_a_peer_never_routes_to_itself() -> None:
    """A peer moving from stage 0 to stage 1 serves both for a while; its driver must not pick its
    own stage-1 replica (libp2p refuses to dial itself), whatever its announced rate."""
    async def main() -> None:
        downstream = Downstream(RunIdentity("r", "h"), None, Swarm(), BanList(5.0, 60.0), parse_codec_spec("fp32"),
                                1 << 24, seed=0, self_id=A)
        assert [c.peer_id for c in await downstream.candidates(1)] == [B]
        plain = Downstream(RunIdentity("r", "h"), None, Swarm(), BanList(5.0, 60.0), parse_codec_spec("fp32"),
                           1 << 24, seed=0)
        assert sorted(c.peer_id for c in await plain.candidates(1)) == sorted([A, B])
    asyncio.run(main())
