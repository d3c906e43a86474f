"""A tokenized run end to end, in one event loop (tests/support/swarm.py): a BPE tokenizer trained
in the test on JSON-lines documents the test writes, a 2-stage GPT reading them through the
streaming path (peer/text/), and its evaluations in every unit: events, the replica's record,
metrics, `swarmgrad status`'s line and the coordinator's history."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

pytest.importorskip("tokenizers", reason="the BPE tokenizer needs the tokenizers library")

from support.swarm import InProcessSwarm, step_manifest
from swarmgrad.peer.cli.status import eval_line
from swarmgrad.peer.events import EventLog
from swarmgrad.peer.node.metrics import PeerMetrics
from swarmgrad.peer.text.tokenizer import train_bpe

pytestmark = pytest.mark.timeout(120)

WORDS = "the a swarm of peers trains one model over slow links and every stage averages its own part".split()


def _documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))) + "." for _ in range(n)]


def test_a_tokenized_run_trains_and_reports_every_unit(tmp_path: Path, inprocess) -> None:
    docs = _documents(400)
    with open(tmp_path / "corpus.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    trained = train_bpe(docs, 300, tmp_path / "tok.json")
    manifest = step_manifest(
        4, model={"vocab_size": trained.vocab_size},
        data={"source": "jsonl", "paths": [str(tmp_path / "corpus.jsonl")], "tokenizer": str(trained.path),
              "tokenizer_sha256": trained.sha256, "max_bytes": 0, "val_fraction": 0.1, "shard_mb": 0.005})

    async def scenario() -> None:
        async with InProcessSwarm(manifest) as swarm:
            driver = swarm.start(0, max_rounds=4, linger=60.0)
            swarm.start(1, max_rounds=4, linger=60.0)
            await swarm.wait_exit(60)
            evals = sorted((e for e in driver.events("eval") if e["val_loss"] is not None), key=lambda e: e["time"])
            assert len(evals) >= 2, swarm.history()
            for e in evals:
                assert e["val_bpb"] == e["val_loss"]  # val_loss stays bits per byte
                assert e["val_ppl"] == pytest.approx(math.exp(e["val_nats"]))
                assert e["val_bpb"] == pytest.approx(e["val_nats"] * e["val_tokens"] / e["val_bytes"] / math.log(2))
                assert e["val_tokens"] == 2 * 4 * 32 and e["val_bytes"] > 2 * e["val_tokens"]  # merges: >2 bytes/token
            assert evals[0]["val_nats"] > math.log(trained.vocab_size) - 1.0  # untrained: about uniform
            assert evals[-1]["final"] and evals[-1]["val_nats"] < evals[0]["val_nats"] - 1.0, evals

    inprocess(scenario)


def test_units_reach_metrics_and_status() -> None:
    events = EventLog(None, stage=0)
    metrics = PeerMetrics()
    events.sink = metrics.observe
    events.emit("eval", round=3, val_loss=1.5, val_nats=2.0, val_ppl=math.exp(2.0), val_bpb=1.5, val_tokens=10,
                val_bytes=40)
    get = lambda name: metrics.registry.get_sample_value(name, {"stage": "0"})  # noqa: E731
    assert get("swarmgrad_val_loss") == 1.5 and get("swarmgrad_val_nats_per_token") == 2.0
    assert get("swarmgrad_val_perplexity") == pytest.approx(math.exp(2.0))
    assert eval_line({"val_loss": 1.5, "val_nats": 2.0, "val_ppl": 7.389}) == \
        "validation 1.5000 bits/byte, 2.0000 nats/token, perplexity 7.39"
    assert eval_line({"val_loss": None}) is None and eval_line(None) is None


def test_units_reach_the_coordinators_history_and_metrics() -> None:
    from swarmgrad.peer.coordinator.metrics import CoordinatorMetrics
    from swarmgrad.peer.coordinator.watch import History
    from swarmgrad.peer.records import PeerRecord, ReplicaStats

    def view(round_no: int, **stats: float) -> dict[int, list[PeerRecord]]:
        rec = PeerRecord(peer_id="d", stage=0, state="online", throughput=1.0, round=round_no, applied_rounds=round_no,
                         digest="x", manifest_hash="h", driver=True,
                         stats=ReplicaStats(samples=8 * round_no, **stats).to_value())
        return {0: [rec], 1: []}

    history = History()
    history.observe(view(1))  # the first sight of a replica is old news
    history.observe(view(2, val_loss=1.5, val_nats=2.0, val_ppl=math.exp(2.0)))
    row = history.to_json(view(2))["loss"][-1]
    assert row["val_loss"] == 1.5 and row["val_nats"] == 2.0 and row["val_ppl"] == pytest.approx(math.exp(2.0))
    metrics = CoordinatorMetrics()
    snapshot = {"latest_round": 2, "swarm_rate": 1.0, "stages": [], "peers": {"admitted": [], "revoked": []},
                "checkpoints": []}
    metrics.update(snapshot, history.to_json(view(2)), {}, {})
    get = metrics.registry.get_sample_value
    assert get("swarmgrad_coordinator_val_bits_per_byte") == 1.5
    assert get("swarmgrad_coordinator_val_nats_per_token") == 2.0
    assert get("swarmgrad_coordinator_val_perplexity") == pytest.approx(math.exp(2.0))
