"""`swarmgrad monitor`: the dashboard of a run that has no coordinator (a public run), read from the
DHT as `swarmgrad status` reads it, served by the coordinator's own page and server
(peer/coordinator/web.py, dashboard/) with the coordinator's panels (admitted peers, checkpoints)
left out.

A `Monitor` only reads: its DHT node runs in client mode with the swarm's validator and no key, so
it signs nothing and stores nothing. Every `interval` seconds it reads the stage records, feeds the
history (rounds, loss curve) and the contributors' ledger (credit from completed rounds), and
publishes the three documents the page polls.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from swarmgrad.peer.coordinator.contributors import Contributors
from swarmgrad.peer.coordinator.watch import History, swarm_snapshot
from swarmgrad.peer.net.deadline import within
from swarmgrad.peer.net.dht_view import SwarmView
from swarmgrad.peer.net.errors import LoopSteps
from swarmgrad.peer.records import PeerRecord

logger = logging.getLogger(__name__)

MAX_PROBED_STAGES = 32
"""Without a manifest the run's stage count is unknown: stages 0..this-1 are read, and the view ends
at the last one with a record."""


class Monitor:
    """Looks at one run through `view` and keeps the dashboard's documents.

    `n_stages`: the run's stage count (from its manifest), or None to probe. The documents are
    rebuilt by `look` (one owner: the event loop running `run`) and read by the HTTP threads through
    `documents` (a reference swap: never half-built)."""

    def __init__(self, view: SwarmView, run_id: str, n_stages: int | None, contributors: Contributors,
                 peer_id: str, interval: float):
        self.view = view
        self.run_id = run_id
        self.n_stages = n_stages
        self.contributors = contributors
        self.peer_id = peer_id
        self.interval = interval
        self.history = History()
        self.started = time.time()
        self.records: dict[int, list[PeerRecord]] = {}
        self._published: tuple[dict[str, Any], dict[str, Any]] = (self._snapshot(), self.history.to_json({}))
        self._steps = LoopSteps("monitor", logger)

    async def look(self) -> None:
        """Read the swarm once and rebuild the documents; raises what the view raises."""
        count = self.n_stages or MAX_PROBED_STAGES
        found = await asyncio.gather(*(self.view.stage_records(s) for s in range(count)))
        records = dict(enumerate(found))
        if self.n_stages is None:  # probing: the run's stages are those up to the last announced one
            last = max((s for s, recs in records.items() if recs), default=-1)
            records = {s: recs for s, recs in records.items() if s <= last}
        self.records = records
        self.history.observe(records)
        await self.contributors.look(self.view, records)
        self._published = (self._snapshot(), self.history.to_json(records))

    def _snapshot(self) -> dict[str, Any]:
        return swarm_snapshot(self.run_id, dict(self.records), None, None, None, monitor={
            "peer_id": self.peer_id, "uptime_s": round(time.time() - self.started, 1)})

    def documents(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """(/api/swarm, /api/history, /api/contributors), as of the last look; the swarm's `time`
        and the monitor's uptime are those of the request."""
        swarm, history = self._published
        monitor = dict(swarm.get("monitor") or {}, uptime_s=round(time.time() - self.started, 1))
        return dict(swarm, time=time.time(), monitor=monitor), history, self.contributors.document()

    async def run(self, stop: asyncio.Event) -> None:
        """Look every `interval` seconds until `stop` is set; a failed look is logged (the network's
        failures once per kind, a bug with its traceback) and the next one tries again."""
        while not stop.is_set():
            await self._steps.run("look", self.look)
            try:
                await within(stop.wait(), self.interval)
            except TimeoutError:
                pass
