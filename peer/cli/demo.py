"""`swarmgrad demo`: a local swarm (stages × replicas peers on 127.0.0.1) trains the manifest's
model for a fixed number of rounds, prints progress, then a summary; leaves no process behind."""
from __future__ import annotations

import math
import shutil
import tempfile
import time
from pathlib import Path

from swarmgrad.peer.cli.launcher import LocalSwarm, PeerProcess, stop_on_signals
from swarmgrad.peer.manifest import dumps, load


def run_demo(manifest_path: Path, rounds: int, replicas: int, workdir: Path | None,
             round_seconds: float | None = None) -> int:
    manifest = load(manifest_path)
    if round_seconds is not None:
        manifest = manifest.replace(rounds={"round_seconds": round_seconds})
    n_stages = manifest.stages.count
    own_dir = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="swarmgrad-demo-")) if workdir is None else workdir
    workdir.mkdir(parents=True, exist_ok=True)
    run_manifest = workdir / "manifest.toml"
    run_manifest.write_text(dumps(manifest))
    n_peers = n_stages * replicas
    print(f"swarmgrad demo: run {manifest.run_id}, {n_stages} stages x {replicas} replicas = {n_peers} peers, "
          f"{rounds} rounds of {manifest.rounds.round_seconds:g}s; logs in {workdir}", flush=True)
    started = time.monotonic()
    code = 1
    with stop_on_signals(), LocalSwarm(run_manifest, workdir) as swarm:
        try:
            swarm.start_swarm(n_stages, replicas, "--max-rounds", str(rounds))
            budget = (rounds + 3) * manifest.rounds.round_seconds + 180
            code = _follow(swarm, budget)
        except KeyboardInterrupt as e:
            print(f"{e or 'interrupted'}; stopping the swarm", flush=True)
        finally:
            swarm.close()
    summary_ok = _summary(swarm.peers, time.monotonic() - started)
    if own_dir and code == 0 and summary_ok:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if code == 0 and summary_ok else 1


def _follow(swarm: LocalSwarm, budget: float) -> int:
    seen: dict[str, int] = {}
    deadline = time.monotonic() + budget
    while time.monotonic() < deadline:
        for peer in swarm.peers:
            events = peer.events()
            for e in events[seen.get(peer.name, 0):]:
                line = _progress_line(peer.name, e)
                if line:
                    print(line, flush=True)
            seen[peer.name] = len(events)
        if all(not p.alive for p in swarm.peers):
            failed = [p for p in swarm.peers if p.proc.returncode != 0]
            for p in failed:
                print(f"{p.name} exited with {p.proc.returncode}:\n{p.log_tail()}", flush=True)
            return 1 if failed else 0
        time.sleep(1.0)
    print(f"demo did not finish within {budget:.0f}s", flush=True)
    return 1


def _progress_line(name: str, e: dict) -> str | None:
    kind = e.get("event")
    if kind == "round":
        loss = e.get("train_loss")
        return (f"[{name} stage {e['stage']}] round {e['round']:3d}  loss {loss if loss is None else round(loss, 3)}  "
                f"{(e.get('samples_per_s') or 0):6.1f} samples/s  sent {e['bytes_sent'] / 1e6:6.2f} MB  "
                f"recv {e['bytes_recv'] / 1e6:6.2f} MB  group {e['group_size']} "
                f"{'ok' if e['complete'] else 'INCOMPLETE: ' + e['reason']}")
    if kind == "eval":
        line = f"[{name} stage {e['stage']}] eval at round {e['round']}: validation {e['val_loss']:.3f} bits/byte"
        if e.get("val_tokens") != e.get("val_bytes") and e.get("val_ppl") is not None:  # a tokenized run
            line += f", {e['val_nats']:.3f} nats/token, perplexity {e['val_ppl']:.1f}"
        return line
    if kind in ("retry", "lost", "resynced", "state_loaded"):
        return f"[{name}] {kind}: " + ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("event", "time", "peer"))
    return None


def _summary(peers: list[PeerProcess], wall: float) -> bool:
    drivers = [p for p in peers if p.stage == 0]
    evals = [e for p in drivers for e in p.events("eval") if e.get("val_loss") is not None]
    first = min(evals, key=lambda e: e["time"]) if evals else None
    finals = [e for e in evals if e.get("final")] or ([max(evals, key=lambda e: e["time"])] if evals else [])
    samples = sum(e["samples"] for p in drivers for e in p.events("round"))
    online = [e["time"] for p in peers for e in p.events("online")]
    last = [e["time"] for p in peers for e in p.events("round")]
    train_s = (max(last) - min(online)) if online and last else math.nan
    sent = sum(e["bytes_sent"] for p in peers for e in p.events("stopped"))
    rounds_ok = sum(1 for p in peers for e in p.events("round") if e["complete"])
    rounds_all = sum(1 for p in peers for e in p.events("round"))
    retries = sum(1 for p in drivers for _ in p.events("retry"))
    print("\n=== swarmgrad demo summary ===")
    before = first["val_loss"] if first else math.nan
    after = sum(e["val_loss"] for e in finals) / len(finals) if finals else math.nan
    print(f"validation loss: {before:.3f} -> {after:.3f} bits/byte")
    print(f"samples trained: {samples} in {train_s:.0f}s = {samples / train_s:.1f} samples/s (whole swarm)")
    print(f"bytes sent: {sent / 1e6:.1f} MB in all = {sent / max(1, samples) / 1e3:.1f} kB per sample")
    print(f"rounds complete: {rounds_ok}/{rounds_all} (per replica), driver retries: {retries}, wall {wall:.0f}s")
    return bool(finals) and after < before
