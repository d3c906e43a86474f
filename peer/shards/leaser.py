"""A driver's shard leases, the daemon's side: gather the drivers' records from the DHT, ask the
pure rules (peer/shards/leases.py), act: lease a shard, claim its windows a block at a time,
renew, hand the driver its windows, release on leave.

One task (`run`, owned by the driving loop's replica: cancelled and awaited by it) does every DHT
access and reads the claimed windows on a thread (a text shard is tokenized as it is read); the
driver's lanes only call `take`, which hands out read windows, all below the published claim, and
waits (touching neither the network nor the corpus) when there are none. Every DHT access goes through the
SwarmView, whose every read and write has the deadline `timeouts.dht`. Records are stored one at a
time (a lock): a node keeps the later-expiring of two that cross.

Timing: a lease lasts `data.lease_seconds` from its last store and is renewed every third of it;
a driver whose lease ran out without a renewal (the DHT unreachable) drops the shard instead of
renewing it, since another driver may have taken it over at its claim. After taking a free shard
a driver waits `data.lease_settle` seconds, reads the records back, and keeps the shard only if
its lease wins (`leases.lease_winner`); a loser backs off and chooses again.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import torch
from hivemind.utils import get_dht_time

from swarmgrad.peer.manifest_checks import MAX_SHARDS
from swarmgrad.peer.net.deadline import within
from swarmgrad.peer.net.dht_view import SwarmView
from swarmgrad.peer.net.errors import SwarmUnavailable
from swarmgrad.peer.net.retry import Backoff
from swarmgrad.peer.shards.leases import (DataPosition, DriverRecord, Lease, choose_shard, epoch_complete,
                                          lease_winner, live_leases, merge_position, parse_record)
from swarmgrad.peer.shards.source import ShardSource, Window

logger = logging.getLogger(__name__)

__all__ = ["LeaseSettings", "LeasedStream", "ShardLeaser"]

RETRY = Backoff(first=0.5, cap=10.0, growth=2.0, jitter=0.5)
"""Waits after a DHT access failed, or after losing a contested shard."""


@dataclass(frozen=True)
class LeaseSettings:
    lease_seconds: float
    """A lease expires this long after its last store (data.lease_seconds)."""
    settle: float
    """Wait before the read-back that confirms a newly taken shard (data.lease_settle)."""
    claim_block: int
    """Windows claimed per store: one inner step's worth, so the lanes rarely wait for a store."""

    @property
    def renew_every(self) -> float:
        return self.lease_seconds / 3


class ShardLeaser:
    """Leases shards of `source` for one driver and hands out their windows (`take`).

    Counters for tests and events: `windows_taken` (windows handed out), `shards_done` (shards
    this driver finished)."""

    def __init__(self, source: ShardSource, swarm: SwarmView, settings: LeaseSettings, *,
                 position: DataPosition | None = None, emit: Callable[..., None] = lambda *a, **k: None,
                 clock: Callable[[], float] = get_dht_time, rng: random.Random | None = None) -> None:
        self.source = source
        self.ids = source.shard_ids()
        if not 0 < len(self.ids) <= MAX_SHARDS:
            raise ValueError(f"the corpus has {len(self.ids)} shards: leases need 1 to {MAX_SHARDS} (a driver's DHT "
                             "record carries the done ones as a bitmap); change data.shard_mb or data.shards")
        self.swarm = swarm
        self.me = swarm.peer_id
        self.s = settings
        self.position = position if position is not None else DataPosition(len(self.ids))
        if self.position.n_shards != len(self.ids):
            raise ValueError(f"a data position of {self.position.n_shards} shards for a corpus of {len(self.ids)}")
        self.emit = emit
        self.clock = clock
        self.rng = rng or random.Random()
        self.lease: Lease | None = None
        """The published lease this driver draws under (its claim is published before it is drawn)."""
        self.lease_epoch = 0
        self._iter: Iterator[Window] | None = None
        self._buffer: deque[Window] = deque()
        """Windows of the held shard read (on a thread: a text shard is tokenized as it is read) and
        not yet taken; all below the published claim."""
        self._ended = False
        """The held shard's windows have all been read (into the buffer or taken)."""
        self.consumed = 0
        """Windows of the held shard handed out, counting the offset it was taken over at."""
        self.windows_taken = 0
        self.shards_done = 0
        self._want = asyncio.Event()
        self._supply = asyncio.Event()
        self.ready = asyncio.Event()
        """Set while a window can be taken without waiting: the driver's lanes wait for it before
        they are admitted, so a lane waiting for data (an epoch's tail) holds no round boundary."""
        self._publishing = asyncio.Lock()
        self._renewed_at = 0.0
        self._waiting_said = False
        self._stored_lease: Lease | None = None
        """The lease in our last stored record (a taken shard not yet confirmed is one too)."""
        self._unpublished = False
        """A shard was done since our last store: say so before anything else (the others wait for
        it at an epoch's end)."""

    # the driver's side ----------------------------------------------------------------------
    async def take(self, n: int) -> list[Window]:
        """`n` windows from the leased shards (several when one ends); waits while none is held
        or none is read yet. Never touches the network, nor reads the corpus."""
        out: list[Window] = []
        while len(out) < n:
            lease = self.lease
            if lease is not None and self._buffer:
                out.append(self._buffer.popleft())
                self.consumed += 1
                self.windows_taken += 1
                if not self._ended and lease.claimed - self.consumed <= self.s.claim_block // 2:
                    self._want.set()
                self._update_ready()
                continue
            if lease is not None and self._ended:
                self._shard_done()
                continue
            self._supply.clear()
            self._update_ready()
            self._want.set()
            await self._supply.wait()
        return out

    def _update_ready(self) -> None:
        if self.lease is not None and self._buffer:
            self.ready.set()
        else:
            self.ready.clear()

    def _supplied(self) -> None:
        self._update_ready()
        self._supply.set()

    def _forget_shard(self) -> None:
        self.lease, self._iter, self._ended = None, None, False
        self._buffer.clear()
        self.ready.clear()

    def _shard_done(self) -> None:
        assert self.lease is not None
        shard = self.lease.shard
        self.position = self.position.with_done(shard)
        self._forget_shard()
        self.shards_done += 1
        self._unpublished = True
        self.emit("shard_done", shard=self.ids[shard], index=shard, epoch=self.position.epoch,
                  windows=self.consumed, done=len(self.position.done), shards=len(self.ids))
        self._want.set()

    # the network's side ---------------------------------------------------------------------
    async def run(self) -> None:
        """Keep a shard leased, claimed ahead and renewed, for ever (the owner cancels it)."""
        failures = 0
        while True:
            try:
                await self._step()
                failures = 0
            except SwarmUnavailable as e:
                failures += 1
                wait = RETRY.wait(failures, self.rng)
                logger.warning("shard leases: %s; trying again in %.1f s", e, wait)
                await asyncio.sleep(wait)

    async def _step(self) -> None:
        if self.lease is not None and self.clock() >= self.lease.until:
            self._drop("expired")  # unrenewed: another driver may have taken it over at our claim
            return
        if self.lease is None:
            await self._acquire()
        elif self._ended and not self._buffer:
            self._shard_done()
        elif not self._ended and self.lease.claimed - self.consumed <= self.s.claim_block // 2:
            await self._renew(extend=True)
        elif not self._ended and self.lease.claimed - self.consumed - len(self._buffer) > 0:
            await self._fill()
        else:
            self._want.clear()
            due = self._renewed_at + self.s.renew_every - time.monotonic()
            if due > 0:
                try:
                    await within(self._want.wait(), due)
                    return
                except asyncio.TimeoutError:
                    pass
            await self._renew(extend=False)

    async def _read(self) -> list[DriverRecord]:
        parsed = (parse_record(p, v, len(self.ids)) for p, v in await self.swarm.data_records())
        records = [r for r in parsed if r is not None]
        self.position = merge_position(self.position, records)
        return records

    async def _publish(self, lease: Lease | None) -> bool:
        async with self._publishing:
            position = self.position if lease is None else self.position.with_claim(lease.shard, lease.claimed)
            finished = self.shards_done
            stored = await self.swarm.publish_data(DriverRecord(self.me, position, lease).to_value())
            if stored:
                # merged, not assigned: a shard may have ended (take) while the store was on its way
                self.position = merge_position(self.position, [DriverRecord(self.me, position, None)])
                self._renewed_at = time.monotonic()
                self._unpublished = self.shards_done != finished
                self._stored_lease = lease
            return stored

    async def _acquire(self) -> None:
        records = await self._read()
        if self._unpublished:
            await self._publish(None)
        if epoch_complete(self.position):
            self.position = self.position.next_epoch()
            self.emit("data_epoch", epoch=self.position.epoch, shards=len(self.ids))
            logger.info("data: every shard of epoch %d is done; epoch %d begins", self.position.epoch - 1,
                        self.position.epoch)
            await self._publish(None)
            return
        now = self.clock()
        shard = choose_shard(self.position, live_leases(records, self.position.epoch, now), self.me)
        if shard is None:
            if not self._waiting_said:
                self._waiting_said = True
                self.emit("data_waiting", epoch=self.position.epoch, done=len(self.position.done))
                logger.info("data: every shard left in epoch %d is leased by another driver; waiting for the "
                            "epoch to end", self.position.epoch)
            if time.monotonic() - self._renewed_at >= self.s.renew_every:
                await self._publish(None)  # keep our copy of the position alive
            self._want.clear()
            try:
                await within(self._want.wait(), min(self.s.renew_every, 1.0 + self.s.settle))
            except asyncio.TimeoutError:
                pass
            return
        self._waiting_said = False
        offset = self.position.offsets.get(shard, 0)
        # claim nothing until the shard is ours: a loser's claim would move the shard's start
        lease = Lease(self.me, shard, since=now, until=now + self.s.lease_seconds, claimed=offset)
        if not await self._publish(lease):
            raise SwarmUnavailable(f"{self.swarm.data_key}: our lease of shard {shard} was not stored")
        if self.s.settle:
            await asyncio.sleep(self.s.settle)
        others = [r for r in await self._read() if r.peer_id != self.me]
        epoch = self.position.epoch
        start = merge_position(DataPosition(len(self.ids), epoch), others).offsets.get(shard, 0)
        winner = lease_winner([*live_leases(others, epoch, self.clock()), lease], shard)
        if winner != self.me or start > offset or shard in self.position.done:
            self.emit("lease_contested", shard=self.ids[shard], index=shard, winner=winner, epoch=epoch)
            logger.info("data: shard %s is %s; choosing another", self.ids[shard],
                        f"{winner[-8:]}'s" if winner and winner != self.me else "further along than we read")
            await self._publish(None)
            await asyncio.sleep(RETRY.wait(1, self.rng))
            return
        self.lease, self.lease_epoch = lease, epoch
        self.consumed = offset
        self._buffer.clear()
        self._ended = False
        self._iter = self.source.windows(self.ids[shard], offset, epoch)
        self.emit("shard_leased", shard=self.ids[shard], index=shard, epoch=epoch, offset=offset,
                  until=lease.until)
        logger.info("data: leased shard %s (epoch %d) from window %d", self.ids[shard], epoch, offset)
        await self._renew(extend=True)  # the first claim: only now may windows be drawn

    async def _renew(self, extend: bool) -> None:
        lease = self.lease
        assert lease is not None
        records = await self._read()
        if self.lease is not lease:  # the shard ended while we read (take)
            return
        others = [r for r in records if r.peer_id != self.me]
        if self.position.epoch != self.lease_epoch or lease.shard in self.position.done \
                or lease_winner([*live_leases(others, self.lease_epoch, self.clock()), lease], lease.shard) != self.me:
            self._drop("lost")
            await self._publish(None)
            return
        now = self.clock()
        renewed = replace(lease, until=now + self.s.lease_seconds,
                          claimed=lease.claimed + (self.s.claim_block if extend else 0))
        if await self._publish(renewed) and self.lease is lease:
            self.lease = renewed
            self._supplied()

    async def _fill(self) -> None:
        """Read the claimed windows not read yet, on a thread (the event loop never tokenizes)."""
        lease, it = self.lease, self._iter
        assert lease is not None and it is not None
        want = lease.claimed - self.consumed - len(self._buffer)
        windows = await asyncio.to_thread(lambda: list(itertools.islice(it, want)))
        if self.lease is not lease:  # only this task replaces the lease: it cannot have moved on
            return
        self._buffer.extend(windows)
        self._ended = len(windows) < want
        self._supplied()

    def _drop(self, why: str) -> None:
        assert self.lease is not None
        shard = self.lease.shard
        self.emit("lease_dropped", shard=self.ids[shard], index=shard, epoch=self.lease_epoch, reason=why,
                  windows=self.consumed)
        logger.warning("data: dropped the lease of shard %s (%s) after window %d", self.ids[shard], why,
                       self.consumed)
        self._forget_shard()

    async def release(self, timeout: float) -> bool:
        """Give the held shard back at once (a graceful leave): store our record without a lease,
        within `timeout` (s). Its claim stays in the position, so whoever takes it goes on there.
        Call after cancelling `run`. True if the release was stored."""
        lease = self.lease or self._stored_lease  # cancelled while taking a shard: its record names it
        if lease is None:
            return True
        self._forget_shard()
        try:
            stored = await within(self._publish(None), timeout)
        except (asyncio.TimeoutError, SwarmUnavailable) as e:
            logger.info("data: could not release shard %s (%r): it is free when the lease expires in %.0f s",
                        self.ids[lease.shard], e, max(0.0, lease.until - self.clock()))
            stored = False
        self.emit("shard_released", shard=self.ids[lease.shard], index=lease.shard, epoch=self.lease_epoch,
                  windows=self.consumed, stored=stored)
        return stored


class LeasedStream:
    """The driver's microbatches from leased shards: `take(size)` -> (inputs, targets), int64
    [size, seq_len] each, targets shifted by one token."""

    def __init__(self, leaser: ShardLeaser) -> None:
        self.leaser = leaser

    async def take(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        windows = torch.stack(await self.leaser.take(size))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
