"""Shard leases in a swarm of real peers (in process): two drivers lease disjoint shards, a
killed driver's shard is taken over where its claim ended, a stopped driver gives its shard back
at once and saves the data position in its --save-dir. The window-by-window count is in
tests/test_shards.py; this checks that the driver, the replica's leave and --save-dir use it."""
from __future__ import annotations

import json

import pytest

from hivemind.utils import get_dht_time

from swarmgrad.peer.shards.leases import DataPosition, swarm_data

from support.dht import swarm_view
from support.swarm import InProcessSwarm, step_manifest

pytestmark = [pytest.mark.timeout(120), pytest.mark.inprocess]


def test_drivers_lease_disjoint_shards_take_over_a_killed_ones_and_release_on_leave(inprocess, tmp_path) -> None:
    m = step_manifest(2, data={"shards": 48, "lease_seconds": 1.0, "lease_settle": 0.05, "max_bytes": 20_000},
                      timeouts={"dht": 0.5})

    async def scenario() -> None:
        async with InProcessSwarm(m, tmp_path=tmp_path) as swarm:
            server = swarm.start(1)
            d1, d2 = swarm.start(0, save=True), swarm.start(0)
            await swarm.until(lambda: d1.events("shard_leased") and d2.events("shard_leased"), 30, "both lease")
            assert d1.events("shard_leased")[0]["index"] != d2.events("shard_leased")[0]["index"]
            await swarm.wait_round(server, 30, "a complete round", complete=True)
            lease_events = ("shard_leased", "shard_done", "lease_dropped", "lease_contested")

            def holding() -> bool:
                last = [e for e in d2.events() if e["event"] in lease_events][-1:]
                return bool(last) and last[0]["event"] == "shard_leased"
            await swarm.until(holding, 30, "the second driver holding a shard")
            held = d2.events("shard_leased")[-1]
            await swarm.kill(d2)  # at once: nothing ran since `holding` was true
            done2 = {e["index"] for e in d2.events("shard_done")}
            # d1 takes the killed driver's shard once its lease has expired, where its claim ended
            taken = await swarm.until(lambda: [e for e in d1.events("shard_leased") if e["index"] == held["index"]],
                                      60, "the killed driver's shard taken over")
            assert taken[0]["offset"] >= held["offset"]  # at its claim (= its start if it was killed before claiming)
            done1 = {e["index"] for e in d1.events("shard_done") if e["epoch"] == 0}
            assert not done1 & done2, "a shard was finished by both drivers"
            await swarm.stop(d1)
            # a clean stop gave its shard back: no lease of it is live, though leases last 1 s
            view = swarm_view(swarm.dht, server.peer_id, m)
            data = swarm_data(await view.data_records(), 48, get_dht_time())
            assert data is not None and not [lease for lease in data["leases"] if lease["peer_id"] == d1.peer_id]
            assert all(e["stored"] for e in d1.events("shard_released"))
            saved = [json.loads(p.read_text()) for p in (tmp_path / d1.name).glob("data-position-*.json")]
            assert len(saved) == 1
            position = DataPosition.from_json(saved[0], 48)
            assert done1 | done2 <= position.done and held["index"] in position.done | set(position.offsets)
    inprocess(scenario, timeout=110)
