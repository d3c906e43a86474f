"""Public runs in the DHT: which runs a swarm hosts, their signed manifests, a run's summary.

Keys (every subkey is its writer's peer id and every value is signed by it: net/record_signing.py):
  swarmgrad/runs                 subkey peer id -> {"run": "NAME@FINGERPRINT"}: the runs this peer serves
  {NAME@FINGERPRINT}/manifest    subkey peer id -> the owner-signed manifest (signed_manifest.py)

Every peer of a public run (`Publisher`, owned by `swarmgrad peer`) stores both every
REPUBLISH_S with an expiry of PUBLISH_TTL, so the manifest outlives any one peer, the owner's
included, for as long as one peer of the run runs (and PUBLISH_TTL after the last one stops).

Anyone can write an entry under either key, so nothing read here is believed: a listed run id
that is not a public run id is skipped, and a run counts only once one of its manifest entries
verifies against the run's own fingerprint (a stranger's entry under someone else's run is
refused: its signature is not the owner's). At most MAX_LISTED_RUNS distinct run ids are looked
at, so a flood of made-up names costs a reader a bounded number of reads.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

from hivemind.utils import get_dht_time

from swarmgrad.peer.net.deadline import within
from swarmgrad.peer.net.dht_view import SwarmView, agreed_epoch, signed_entries
from swarmgrad.peer.net.errors import BestEffort, dht_call
from swarmgrad.peer.net.record_signing import MAX_RECORD_TTL
from swarmgrad.peer.public.run_name import RunName, is_public_run_id, parse
from swarmgrad.peer.public.signed_manifest import ManifestRefused, PublishedManifest, verify
from swarmgrad.peer.records import JOINING, ONLINE

logger = logging.getLogger(__name__)

RUNS_KEY = "swarmgrad/runs"
PUBLISH_TTL = MAX_RECORD_TTL
"""Expiry of both entries: the longest any peer accepts (600 s)."""
REPUBLISH_S = 120.0
"""How often a peer stores them again: five chances within one PUBLISH_TTL."""
MAX_LISTED_RUNS = 64
MAX_SUMMARY_STAGES = 64
"""Stages whose records a summary reads: anyone can sign a manifest of a million stages."""


def manifest_key(run_id: str) -> str:
    return f"{run_id}/manifest"


@dataclass(frozen=True)
class Found:
    """What the DHT holds for one run: its verified manifest (the latest signed), or None with why
    every entry was refused."""
    run_id: str
    published: PublishedManifest | None
    refusals: tuple[str, ...] = ()


@dataclass(frozen=True)
class RunSummary:
    """One row of `swarmgrad runs`."""
    run: str
    name: str
    fingerprint: str
    model: str
    params: int | None
    stages: int
    peers_online: int
    samples_trained: int
    last_round: int | None
    age_s: float | None
    manifest_hash: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class RunDirectory:
    """Reads and writes of the keys above over one DHT (hivemind's, or tests/support/dht.py's), each
    with the deadline `timeout` and raising SwarmUnavailable when the network fails it."""

    def __init__(self, dht: Any, timeout: float):
        self.dht = dht
        self.timeout = timeout

    async def _store(self, key: str, value: Any) -> bool:
        subkey = str(self.dht.peer_id)
        return bool(await dht_call(f"storing {key}", lambda: self.dht.store(
            key, value, get_dht_time() + PUBLISH_TTL, subkey=subkey, return_future=True), self.timeout))

    async def _entries(self, key: str) -> list[tuple[str, Any]]:
        found = await dht_call(f"reading {key}", lambda: self.dht.get(key, latest=True, return_future=True),
                               self.timeout)
        return signed_entries(None if found is None else found.value, PUBLISH_TTL, key)

    async def publish(self, published: PublishedManifest) -> bool:
        """Store our entries for the run (both; True if both were stored)."""
        listed, stored = await asyncio.gather(self._store(RUNS_KEY, {"run": published.run_id}),
                                              self._store(manifest_key(published.run_id), published.blob))
        return listed and stored

    async def run_ids(self) -> list[str]:
        """The public run ids peers list, most listed first (at most MAX_LISTED_RUNS)."""
        counts: dict[str, int] = {}
        for _, value in await self._entries(RUNS_KEY):
            run = value.get("run") if isinstance(value, dict) else None
            if isinstance(run, str) and is_public_run_id(run):
                counts[run] = counts.get(run, 0) + 1
        return sorted(counts, key=lambda r: (-counts[r], r))[:MAX_LISTED_RUNS]

    async def manifest(self, run_id: str) -> Found:
        """The run's manifest: the latest-signed entry that verifies against the run's name and
        fingerprint; the others are refusals (forged, altered, malformed)."""
        expected = parse(run_id)
        best: PublishedManifest | None = None
        refusals: list[str] = []
        for peer_id, blob in await self._entries(manifest_key(run_id)):
            try:
                published = verify(blob, expected)
            except ManifestRefused as e:
                logger.debug("refused the manifest entry of %s under %s: %s", peer_id[-8:], run_id, e)
                refusals.append(str(e))
                continue
            if best is None or published.issued_at > best.issued_at:
                best = published
        return Found(run_id, best, tuple(dict.fromkeys(refusals)))

    async def publishers(self, run_id: str) -> list[str]:
        """The peer ids that store an entry under the run's manifest key (whatever it holds)."""
        return [peer_id for peer_id, _ in await self._entries(manifest_key(run_id))]

    async def find(self, name: RunName) -> list[Found]:
        """The runs `name` may mean: NAME@FINGERPRINT itself, or every listed run called NAME."""
        if name.fingerprint is not None:
            return [await self.manifest(name.full)]
        ids = [r for r in await self.run_ids() if parse(r).name == name.name]
        return list(await asyncio.gather(*(self.manifest(r) for r in ids)))

    async def runs(self) -> list[Found]:
        """Every listed run whose manifest verifies."""
        found = await asyncio.gather(*(self.manifest(r) for r in await self.run_ids()))
        return [f for f in found if f.published is not None]

    async def summary(self, published: PublishedManifest, now: float | None = None) -> RunSummary:
        """The run as its peers announce it: records of its manifest only (SwarmView drops others)."""
        m = published.manifest
        view = SwarmView(self.dht, m.run_id, m.hash, min(m.stages.count, MAX_SUMMARY_STAGES), self.timeout,
                         ttl=m.timeouts.announce_ttl)
        swarm, epochs = await asyncio.gather(view.swarm(), view.epochs())
        live = [r for recs in swarm.values() for r in recs if r.state in (ONLINE, JOINING)]
        rounds = [r.round for r in live]
        epoch = agreed_epoch(epochs.values())
        now = time.time() if now is None else now
        return RunSummary(
            run=published.run_id, name=published.name, fingerprint=published.fingerprint,
            model=describe_model(m), params=parameter_count(m), stages=m.stages.count,
            peers_online=len({r.peer_id for r in live}),
            # a sample is trained once per stage: the drivers' own counts, as they announce them
            samples_trained=sum(int((r.stats or {}).get("samples") or 0) for r in swarm.get(0, [])),
            last_round=max(rounds) if rounds else None,
            age_s=max(0.0, now - (epoch if epoch is not None else published.issued_at)),
            manifest_hash=m.hash)


def describe_model(m: Any) -> str:
    md = m.model
    if md.kind == "entry_point":
        return md.entry_point
    return f"{md.kind} d{md.d_model} L{md.n_layers}"


def parameter_count(m: Any) -> int | None:
    """The built-in GPT's or llama kind's parameters (placement/cost.py); None where only the model could say."""
    from swarmgrad.peer.placement.cost import gpt_stage_params, llama_stage_params
    count = {"gpt": gpt_stage_params, "llama": llama_stage_params}.get(m.model.kind)
    if count is None:
        return None
    return sum(count(m, s) for s in range(m.stages.count))


class Publisher:
    """A peer's part in keeping its public run findable: its entries stored at start and every
    `every` seconds until `stop` is set. A failed store is logged once (BestEffort) and tried
    again at the next period; the peer trains on regardless."""

    def __init__(self, directory: RunDirectory, published: PublishedManifest, every: float = REPUBLISH_S):
        self.directory = directory
        self.published = published
        self.every = every
        self._attempt = BestEffort(f"publishing the manifest of {published.run_id}", logger)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with self._attempt:
                if not await self.directory.publish(self.published):
                    logger.debug("the DHT did not store every entry of %s; trying again in %.0fs",
                                 self.published.run_id, self.every)
            try:
                await within(stop.wait(), self.every)
            except asyncio.TimeoutError:
                pass
