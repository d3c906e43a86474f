"""Drivers train disjoint data (peer/shards/): the byte corpus cut into shards, the pure lease
rules over a snapshot of records, and the leaser over the in-memory DHT under the real SwarmView:
drivers lease disjoint shards, a killed driver's shard is taken over after its lease expires, a
graceful leave releases at once, epochs roll over, a saved position resumes. Every scenario counts
the windows handed out: none twice in an epoch."""
from __future__ import annotations

import asyncio
from collections import Counter
from typing import Iterator

import pytest
import torch

from swarmgrad.peer.data import ByteCorpus
from swarmgrad.peer.manifest import ManifestError
from swarmgrad.peer.shards.leaser import LeaseSettings, LeasedStream, ShardLeaser
from swarmgrad.peer.shards.leases import (DataPosition, DriverRecord, Lease, choose_shard, lease_winner,
                                          live_leases, merge_position, parse_record)
from swarmgrad.peer.shards.source import ByteShards, ShardSource

from conftest import small_manifest
from support.dht import MemoryDHT, swarm_view
from support.swarm import peer_ids

pytestmark = pytest.mark.timeout(60)

A, B, C = sorted(peer_ids(3, "shards"))


class TaggedShards:
    """`n` shards of `per` windows each; window i of shard k is [k, i, 0]: a test reads which
    window it got."""

    def __init__(self, n: int, per: int) -> None:
        self.n, self.per = n, per

    def shard_ids(self) -> list[str]:
        return [f"s{k}" for k in range(self.n)]

    def windows(self, shard_id: str, start: int = 0, epoch: int = 0) -> Iterator[torch.Tensor]:
        k = int(shard_id[1:])
        for i in range(max(0, start), self.per):
            yield torch.tensor([k, i, 0])


def settings(lease: float = 30.0, settle: float = 0.02, block: int = 4) -> LeaseSettings:
    return LeaseSettings(lease_seconds=lease, settle=settle, claim_block=block)


# the byte corpus cut into shards ------------------------------------------------------------------
def test_byte_shards_cover_every_window_once_in_a_fixed_order() -> None:
    corpus = ByteCorpus.from_bytes(bytes(range(256)) * 4)
    shards = ByteShards(corpus, n_shards=5, seq_len=8, seed=3)
    assert isinstance(shards, ShardSource)
    ids = shards.shard_ids()
    assert len(ids) == 5 and len(set(ids)) == 5
    firsts = [int(w[0]) + 256 * 0 for sid in ids for w in shards.windows(sid)]
    starts = sorted(torch.cat([torch.stack(list(shards.windows(sid)))[:, :1] for sid in ids]).flatten().tolist())
    assert len(firsts) == shards.n_windows == (len(corpus) - 1) // 8
    # window i starts at byte 8 i; every one is there once (bytes repeat every 256: compare positions)
    assert starts == [(8 * i) % 256 for i in range(shards.n_windows)] or sorted(starts) == sorted(
        (8 * i) % 256 for i in range(shards.n_windows))
    again = ByteShards(corpus, n_shards=5, seq_len=8, seed=3)
    for sid in ids:
        whole = list(shards.windows(sid))
        assert all(torch.equal(a, b) for a, b in zip(whole, again.windows(sid)))
        assert all(torch.equal(a, b) for a, b in zip(whole[3:], shards.windows(sid, 3)))
        assert all(w.dtype == torch.int64 and w.shape == (9,) for w in whole)
    with pytest.raises(ValueError, match="data.shards"):
        ByteShards(corpus, n_shards=1000, seq_len=8)


def test_the_manifest_checks_the_lease_fields() -> None:
    m = small_manifest(data={"shards": 8, "lease_seconds": 2.0, "lease_settle": 0.1}, timeouts={"dht": 1.0})
    assert (m.data.shards, m.data.lease_seconds, m.data.lease_settle) == (8, 2.0, 0.1)
    with pytest.raises(ManifestError, match="data.lease_seconds"):
        small_manifest(data={"shards": 8, "lease_seconds": 2.0, "lease_settle": 0.1}, timeouts={"dht": 5.0})
    with pytest.raises(ManifestError, match="data.shards"):
        small_manifest(data={"shards": 10**6})
    with pytest.raises(ManifestError, match="data.lease_settle"):
        small_manifest(data={"shards": 8, "lease_seconds": 30.0, "lease_settle": 20.0})


# the pure rules -------------------------------------------------------------------------------------
def test_a_record_round_trips_and_malformed_ones_are_dropped() -> None:
    position = DataPosition(20, epoch=2, done=frozenset({0, 7, 19}), offsets={3: 12})
    record = DriverRecord(A, position, Lease(A, 5, since=100.0, until=130.0, claimed=8))
    assert parse_record(A, record.to_value(), 20) == record
    assert parse_record(A, record.to_value(), 21) is None  # another corpus
    bad = [None, 3, {**record.to_value(), "done": b"\x00"}, {**record.to_value(), "held": 99},
           {**record.to_value(), "offsets": [[1]]}, {**record.to_value(), "epoch": -1},
           {**record.to_value(), "until": float("nan")}, {**record.to_value(), "v": 2}]
    assert all(parse_record(A, value, 20) is None for value in bad)
    assert DataPosition.from_json(position.to_json(), 20) == position
    with pytest.raises(ValueError, match="shards"):
        DataPosition.from_json(position.to_json(), 21)


def test_the_position_merges_to_the_latest_epoch_union_and_highest_claims() -> None:
    mine = DataPosition(6, epoch=0, done=frozenset({0}), offsets={1: 4})
    records = [DriverRecord(A, DataPosition(6, 0, frozenset({2}), {1: 8, 3: 2}), Lease(A, 4, 1.0, 2.0, 12)),
               DriverRecord(B, DataPosition(6, 0, frozenset({3})), None)]
    merged = merge_position(mine, records)
    assert merged == DataPosition(6, 0, frozenset({0, 2, 3}), {1: 8, 4: 12})
    later = DriverRecord(C, DataPosition(6, 1, frozenset({5})), None)
    assert merge_position(mine, [*records, later]) == DataPosition(6, 1, frozenset({5}), {})


def test_choosing_a_shard_skips_done_and_leased_ones_and_takes_begun_ones_first() -> None:
    position = DataPosition(6, 0, frozenset({0}), {4: 3})
    leases = [Lease(B, 1, 1.0, 50.0, 4), Lease(C, 2, 1.0, 50.0, 4)]
    assert choose_shard(position, leases, A) == 4
    assert choose_shard(DataPosition(6, 0, frozenset({0, 4})), leases, A) in (3, 5)
    assert choose_shard(DataPosition(3, 0, frozenset({0})), leases, A) is None
    # drivers starting together rank the untouched shards differently
    firsts = {choose_shard(DataPosition(64), [], p) for p in peer_ids(8, "rank")}
    assert len(firsts) >= 5
    assert live_leases([DriverRecord(B, position, leases[0])], 0, now=60.0) == []
    assert lease_winner([Lease(B, 1, 2.0, 9.0, 4), Lease(C, 1, 1.0, 9.0, 4)], 1) == C
    assert lease_winner([Lease(C, 1, 1.0, 9.0, 4), Lease(B, 1, 1.0, 9.0, 4)], 1) == min(B, C)


# the leaser over the in-memory DHT -------------------------------------------------------------------
def manifest():
    return small_manifest(data={"shards": 1})


class Driver:
    """A driver's consumer: takes windows one microbatch at a time, counting them by epoch."""

    def __init__(self, leaser: ShardLeaser) -> None:
        self.leaser = leaser
        self.got: list[tuple[int, int, int]] = []  # (epoch, shard, window)
        self.events: list[dict] = []
        leaser.emit = lambda event, **fields: self.events.append({"event": event, **fields})
        self.tasks = [asyncio.create_task(leaser.run()), asyncio.create_task(self._consume())]

    async def _consume(self) -> None:
        while True:
            for w in await self.leaser.take(1):  # one at a time: a microbatch may span an epoch's end
                self.got.append((self.leaser.lease_epoch, int(w[0]), int(w[1])))
            await asyncio.sleep(0.002)

    async def kill(self) -> None:
        """SIGKILL: stop at once, nothing released (the record stays until it expires)."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def leave(self) -> bool:
        await self.kill()
        return await self.leaser.release(timeout=1.0)


def leaser(dht: MemoryDHT, peer: str, source: ShardSource, s: LeaseSettings, m=None, **kw) -> ShardLeaser:
    return ShardLeaser(source, swarm_view(dht, peer, m or manifest()), s, **kw)


async def until(predicate, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def epoch_windows(drivers: list[Driver], epoch: int) -> Counter:
    return Counter((k, i) for d in drivers for e, k, i in d.got if e == epoch)


def test_three_drivers_lease_disjoint_shards_and_train_each_window_once(inprocess) -> None:
    async def scenario() -> None:
        dht, source = MemoryDHT(), TaggedShards(9, 10)
        drivers = [Driver(leaser(dht, p, source, settings())) for p in (A, B, C)]
        await until(lambda: all(d.leaser.position.epoch >= 1 for d in drivers))
        for d in drivers:
            await d.kill()
        counts = epoch_windows(drivers, 0)
        assert set(counts) == {(k, i) for k in range(9) for i in range(10)}  # every window...
        assert max(counts.values()) == 1  # ...once
        assert all(d.leaser.shards_done >= 1 for d in drivers)  # each trained some shards
        shards_by = [{k for e, k, _ in d.got if e == 0} for d in drivers]
        assert not (shards_by[0] & shards_by[1] or shards_by[0] & shards_by[2] or shards_by[1] & shards_by[2])
    inprocess(scenario)


def test_a_killed_drivers_shard_is_taken_over_after_its_lease_expires_at_its_claim(inprocess) -> None:
    async def scenario() -> None:
        dht, source, s = MemoryDHT(), TaggedShards(6, 40), settings(lease=0.6, block=4)
        a = Driver(leaser(dht, A, source, s))
        await until(lambda: len(a.got) >= 6)
        await a.kill()
        held = a.leaser.lease
        assert held is not None
        claimed, taken = held.claimed, {i for _, k, i in a.got if k == held.shard}
        others = [Driver(leaser(dht, p, source, s)) for p in (B, C)]
        # before the lease expires, nobody touches the killed driver's shard
        await asyncio.sleep(0.3)
        assert not any(k == held.shard for d in others for _, k, _ in d.got)
        await until(lambda: all(d.leaser.position.epoch >= 1 for d in others))
        for d in others:
            await d.kill()
        counts = epoch_windows([a, *others], 0)
        assert max(counts.values()) == 1, "a window was trained twice"
        takeover = sorted(i for d in others for _, k, i in d.got if k == held.shard)
        assert takeover and takeover[0] == claimed  # resumed at the published claim
        skipped = {(k, i) for k in range(6) for i in range(40)} - set(counts)
        assert skipped == {(held.shard, i) for i in range(claimed) if i not in taken}
        assert len(skipped) <= s.claim_block * 3 // 2  # claims go a block ahead when half a block is left
    inprocess(scenario)


def test_a_graceful_leave_releases_its_shard_at_once(inprocess) -> None:
    async def scenario() -> None:
        dht, source = MemoryDHT(), TaggedShards(2, 30)
        s = settings(lease=30.0, block=4)  # far longer than the test: only a release frees the shard
        a = Driver(leaser(dht, A, source, s))
        await until(lambda: len(a.got) >= 4)
        b = Driver(leaser(dht, B, source, s))
        await until(lambda: b.leaser.lease is not None)
        assert b.leaser.lease.shard != a.leaser.lease.shard
        a_shard = a.leaser.lease.shard
        assert await a.leave()
        assert a.events[-1]["event"] == "shard_released"
        await until(lambda: any(k == a_shard for _, k, _ in b.got), timeout=5.0)
        await until(lambda: b.leaser.position.epoch >= 1, timeout=10.0)
        await b.kill()
        counts = epoch_windows([a, b], 0)
        assert max(counts.values()) == 1
        assert len(counts) >= 2 * 30 - s.claim_block * 3 // 2  # at most the claimed, undrawn windows
    inprocess(scenario)


def test_two_drivers_reaching_for_the_same_shard_at_once_one_backs_off(inprocess) -> None:
    async def scenario() -> None:
        dht, source = MemoryDHT(), TaggedShards(1, 400)
        a, b = (leaser(dht, p, source, settings(settle=0.05)) for p in (A, B))
        events: list[tuple[str, str]] = []
        for lsr in (a, b):
            lsr.emit = lambda event, me=lsr.me, **f: events.append((me, event))
            # the first read of each is stale (the DHT is not read-after-write across nodes): both
            # see the shard free and take it
            fresh = lsr.swarm.data_records
            stale = [True]

            async def read(fresh=fresh, stale=stale):
                if stale[0]:
                    stale[0] = False
                    return []
                return await fresh()
            lsr.swarm.data_records = read
        tasks = [asyncio.create_task(lsr.run()) for lsr in (a, b)]
        await until(lambda: any(e == "lease_contested" for _, e in events))
        await asyncio.sleep(0.2)
        assert (a.lease is None) != (b.lease is None), "exactly one driver holds the shard"
        holder = a if a.lease is not None else b
        assert [me for me, e in events if e == "lease_contested"] == [({a.me, b.me} - {holder.me}).pop()]
        assert holder.lease.claimed > 0 and holder.position.offsets == {0: holder.lease.claimed}
        # the driver's lanes wait for `ready` before they are admitted: set only where windows wait
        loser = b if holder is a else a
        assert holder.ready.is_set() and not loser.ready.is_set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    inprocess(scenario)


def test_epochs_roll_over_and_a_saved_position_resumes(inprocess) -> None:
    async def scenario() -> None:
        dht, source = MemoryDHT(), TaggedShards(3, 5)
        a = Driver(leaser(dht, A, source, settings(block=2)))
        await until(lambda: a.leaser.position.epoch >= 2)
        await a.kill()
        for epoch in (0, 1):
            counts = epoch_windows([a], epoch)
            assert set(counts) == {(k, i) for k in range(3) for i in range(5)} and max(counts.values()) == 1
        assert [e["epoch"] for e in a.events if e["event"] == "data_epoch"][:2] == [1, 2]
        # a position saved mid-epoch (checkpoint, --save-dir) resumes in a fresh swarm
        saved = DataPosition(3, epoch=4, done=frozenset({0}), offsets={2: 3}).to_json()
        b = Driver(leaser(MemoryDHT(), B, source, settings(block=2),
                          position=DataPosition.from_json(saved, 3)))
        await until(lambda: b.leaser.position.epoch >= 5)
        await b.kill()
        assert sorted((k, i) for e, k, i in b.got if e == 4) == [(1, i) for i in range(5)] + [(2, 3), (2, 4)]
    inprocess(scenario)


def test_the_leased_stream_makes_shifted_microbatches(inprocess) -> None:
    async def scenario() -> None:
        corpus = ByteCorpus.from_bytes(bytes(range(200)))
        lsr = leaser(MemoryDHT(), A, ByteShards(corpus, 2, seq_len=9), settings())
        task = asyncio.create_task(lsr.run())
        x, y = await LeasedStream(lsr).take(3)
        assert x.shape == y.shape == (3, 9) and torch.equal(x[:, 1:], y[:, :-1]) and x.dtype == torch.int64
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    inprocess(scenario)


def test_status_shows_the_data_position_and_the_live_leases() -> None:
    from swarmgrad.peer.cli.status import data_line
    from swarmgrad.peer.shards.leases import swarm_data
    records = [(A, DriverRecord(A, DataPosition(8, 1, frozenset({0, 1}), {2: 5}), Lease(A, 2, 10.0, 50.0, 9)).to_value()),
               (B, DriverRecord(B, DataPosition(8, 1, frozenset({3})), Lease(B, 4, 10.0, 20.0, 4)).to_value()),
               (C, {"garbage": True})]
    data = swarm_data(records, None, now=30.0)
    # begun: A's shard 2 (claimed to 9) and B's expired lease of shard 4: whoever takes it starts at 4
    assert data is not None and (data["epoch"], data["shards"], data["done"], data["begun"]) == (1, 8, 3, 2)
    assert [(lease["peer_id"], lease["shard"]) for lease in data["leases"]] == [(A, 2)]  # B's expired
    assert data_line(data) == f"data: epoch 1, 3 of 8 shards done, 2 begun; leased: {A[-8:]} shard 2 (to window 9)"
    assert swarm_data([], None, 0.0) is None and swarm_data(records, 9, 30.0) is None


def test_a_save_dir_holds_the_position_and_several_files_merge(tmp_path) -> None:
    from swarmgrad.peer.shards.saved import load_position, save_position
    assert load_position(tmp_path, 6) is None and load_position(None, 6) is None
    save_position(tmp_path, A, DataPosition(6, 2, frozenset({0}), {1: 4}))
    save_position(tmp_path, B, DataPosition(6, 2, frozenset({3}), {1: 6}))
    save_position(tmp_path, C, DataPosition(6, 1, frozenset({5})))  # an older epoch: superseded
    (tmp_path / "data-position-broken.json").write_text("{not json")
    assert load_position(tmp_path, 6) == DataPosition(6, 2, frozenset({0, 3}), {1: 6})
    assert load_position(tmp_path, 7) is None  # another data.shards: nothing to resume


def test_a_swarm_restarted_from_a_checkpoint_goes_on_from_its_data_position(inprocess, tmp_path) -> None:
    """The coordinator publishes its newest checkpoint's position (Coordinator._resume_data, run
    here on a stand-in holding what it reads); a driver of a fresh swarm continues from it."""
    from types import SimpleNamespace

    from swarmgrad.peer.coordinator.coordinator import Coordinator
    from swarmgrad.peer.coordinator.store import StateDir

    async def scenario() -> None:
        m = small_manifest(data={"shards": 3, "lease_seconds": 30.0, "lease_settle": 0.02})
        store = StateDir(tmp_path, m.run_id)
        info = {"round": 7, "applied_rounds": 7, "trained_samples": 9, "digest": "d"}
        saved = DataPosition(3, epoch=2, done=frozenset({1}), offsets={0: 3})
        store.write_checkpoint(7, {0: (b"s0", info)}, "run_id = 'test-run'", 1, data_position=saved.to_json())
        dht = MemoryDHT()
        coordinator = SimpleNamespace(m=m, store=store, swarm=swarm_view(dht, C, m), peer_id=C,
                                      _data_published=float("-inf"))
        await Coordinator._resume_data(coordinator)
        a = Driver(leaser(dht, A, TaggedShards(3, 5), settings(block=2), m))
        await until(lambda: a.leaser.position.epoch >= 3)
        await a.kill()
        assert sorted((k, i) for e, k, i in a.got if e == 2) == [(0, 3), (0, 4)] + [(2, i) for i in range(5)]
    inprocess(scenario)


def test_a_leave_while_taking_a_shard_withdraws_the_unconfirmed_lease(inprocess) -> None:
    async def scenario() -> None:
        dht = MemoryDHT()
        lsr = leaser(dht, A, TaggedShards(2, 5), settings(settle=5.0))  # stuck before its read-back
        task = asyncio.create_task(lsr.run())
        view = swarm_view(dht, B, manifest())
        await until(lambda: A in dht.entries(view.data_key))
        assert lsr.lease is None  # not confirmed yet, but stored
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert await lsr.release(timeout=1.0)
        [(peer, value)] = await view.data_records()
        assert parse_record(peer, value, 2).lease is None
    inprocess(scenario)


def test_drivers_lease_the_streaming_paths_shards_and_read_each_window_once(inprocess, tmp_path) -> None:
    """The text pipeline's corpus (peer/text/) as a shard source: two drivers lease its shards,
    and every training window of the corpus comes out once in the epoch."""
    import json

    from swarmgrad.peer.shards.source import TextShards
    from swarmgrad.peer.text.corpus import TokenCorpus, TokenStream
    from swarmgrad.peer.text.sources import TextSource
    from swarmgrad.peer.text.tokenizer import ByteTokenizer

    docs = [f"document {i}: " + "some words of text " * (3 + i % 7) for i in range(60)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    corpus = TokenCorpus(TextSource("jsonl", ["a.jsonl"], tmp_path, shard_bytes=600), ByteTokenizer(), 16, 0.1)
    source = TextShards(corpus, TokenStream(corpus, 4, seed=0, shuffle=4))
    assert len(source.shard_ids()) >= 4
    every = Counter(tuple(w.tolist()) for sid in source.shard_ids() for w in source.windows(sid))
    three = list(source.windows(source.shard_ids()[0]))[3:]
    assert [w.tolist() for w in source.windows(source.shard_ids()[0], 3)] == [w.tolist() for w in three]

    async def scenario() -> None:
        dht, got = MemoryDHT(), Counter()
        lsrs = [leaser(dht, p, source, settings(block=3)) for p in (A, B)]
        tasks = [asyncio.create_task(lsr.run()) for lsr in lsrs]

        async def consume(lsr: ShardLeaser) -> None:
            while True:
                [w] = await lsr.take(1)
                if lsr.lease_epoch == 0:
                    got[tuple(w.tolist())] += 1
        tasks += [asyncio.create_task(consume(lsr)) for lsr in lsrs]
        await until(lambda: all(lsr.position.epoch >= 1 for lsr in lsrs))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert got == every  # each window as often as the corpus holds it: none twice
        assert all(lsr.shards_done for lsr in lsrs)
    inprocess(scenario)
