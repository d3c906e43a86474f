"""The contributors' leaderboard as a watcher of the swarm keeps it: the coordinator, `swarmgrad
monitor` and `swarmgrad status --contributors` (peer/averaging/credit.py counts; this module reads
the DHT for it, keeps the ledger on disk and builds the /api/contributors document).

A watcher credits what it saw: rounds whose entries it read while the DHT held them (4 ×
`timeouts.announce_ttl`), and uptime between its looks. A one-shot reader (`status`) sees only the
rounds still in the DHT; a long-running one (coordinator, monitor with `--ledger FILE`) counts the
whole run from its start.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Mapping

from swarmgrad.peer.averaging.credit import Ledger, RoundBounds, RoundEvidence, scan_rounds
from swarmgrad.peer.coordinator.store import atomic_write
from swarmgrad.peer.records import ONLINE, PeerRecord

logger = logging.getLogger(__name__)

SAVE_EVERY_S = 30.0
"""A look that credited nothing (only uptime changed) saves the ledger at most this often."""
LOOKBACK_ROUNDS = 4
"""Rounds below each stage's latest that a periodic look reads: a round's votes land within its
vote timeout after the boundary, so a round read once too early is read again at the next look."""


class Contributors:
    """A ledger fed from the stage records and the rounds' entries, saved to `path` (if given)
    after every look that credited a round (and every SAVE_EVERY_S for uptime alone). One owner calls `look`; `document` may be called from other
    threads (it returns the copy built by the last look)."""

    def __init__(self, run_id: str, bounds: RoundBounds, tokens_per_sample: int | None,
                 path: Path | None = None, lookback: int = LOOKBACK_ROUNDS):
        self.run_id = run_id
        self.bounds = bounds
        self.lookback = lookback
        self.path = path
        self.ledger = Ledger(tokens_per_sample)
        self.since = time.time()
        self._saved = 0.0
        if path is not None and path.is_file():
            try:
                saved = json.loads(path.read_text())
                self.ledger = Ledger.from_json(saved["ledger"])
                self.ledger.tokens_per_sample = tokens_per_sample
                self.since = float(saved.get("since", self.since))
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}: not a contributors ledger ({type(e).__name__}: {e})") from e
        self._document = self._build(self.since)

    async def look(self, board: RoundEvidence, view: Mapping[int, list[PeerRecord]], now: float | None = None) -> int:
        """Credit the completed rounds in the window below each stage's latest round and the uptime
        of the ONLINE replicas; returns how many groups were credited. Raises only what the board
        raises beyond the network's failures (a bug)."""
        now = time.time() if now is None else now
        current = {s: max(r.round for r in records) for s, records in view.items() if records}
        added = await scan_rounds(board, self.ledger, current, self.lookback, self.bounds)
        self.ledger.seen([r.peer_id for records in view.values() for r in records if r.state == ONLINE], now)
        self._document = self._build(now)
        if self.path is not None and (added or now - self._saved >= SAVE_EVERY_S):
            self._saved = now
            atomic_write(self.path, json.dumps({"since": self.since, "ledger": self.ledger.to_json()}).encode())
        return added

    def _build(self, now: float) -> dict[str, Any]:
        return {"run_id": self.run_id, "time": now, "since": self.since,
                "tokens_per_sample": self.ledger.tokens_per_sample, "totals": self.ledger.totals(),
                "contributors": self.ledger.rows()}

    def document(self) -> dict[str, Any]:
        """The /api/contributors JSON (peer/coordinator/web.py documents it)."""
        return self._document
