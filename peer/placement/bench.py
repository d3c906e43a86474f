"""A newcomer's rate on every stage, measured: a short forward+backward benchmark of each stage's
module on this device, cached per device, manifest and slowdown (a peer that restarts does not
pay for it again). Placement needs a rate per stage before the peer has served any."""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch

from swarmgrad.peer.manifest import Manifest
from swarmgrad.peer.model import StagedModel

logger = logging.getLogger(__name__)

WARMUP_ITERS = 1
TIMED_ITERS = 3


def cache_dir() -> Path:
    return Path(os.environ.get("SWARMGRAD_CACHE", Path.home() / ".cache" / "swarmgrad"))


def _synthetic(spec: tuple[tuple[int, ...], torch.dtype], device: torch.device, vocab: int) -> torch.Tensor:
    shape, dtype = spec
    if dtype.is_floating_point:
        return torch.randn(shape, device=device, dtype=dtype)
    return torch.randint(0, vocab, shape, device=device, dtype=dtype)


def bench_stage(model: StagedModel, stage: int, batch: int, device: torch.device, vocab: int) -> float:
    """Samples/s of one stage's forward+backward on `device` (synthetic inputs)."""
    module = model.build_stage(stage).to(device)
    x = _synthetic(model.input_spec(stage, batch), device, vocab)
    last = stage == model.n_stages - 1
    targets = _synthetic(model.targets_spec(batch), device, vocab)
    if stage > 0 and model.token_carry is not None:
        x = model.token_carry.stage_input(x, targets.to(device))
    if x.is_floating_point():
        x.requires_grad_(True)

    def once() -> None:
        y = module(x)
        loss = model.loss_fn(y, targets) if last else y.float().square().mean()
        loss.backward()
        module.zero_grad(set_to_none=True)

    for _ in range(WARMUP_ITERS):
        once()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(TIMED_ITERS):
        once()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return TIMED_ITERS * batch / max(1e-9, time.perf_counter() - started)


def _cache_key(manifest: Manifest, device: str) -> str:
    """The whole-device entry's key; a pinned peer's one-stage entry adds ``|stage N``."""
    return f"{manifest.hash}|{device}|{torch.__version__}"


def _read_cache(path: Path) -> dict[str, list[float]]:
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return cached if isinstance(cached, dict) else {}


def _write_cache(path: Path, key: str, rates: list[float]) -> None:
    try:
        cached = _read_cache(path)
        cached[key] = rates
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached))
        os.replace(tmp, path)
    except OSError as e:
        logger.info("could not cache stage rates: %s", e)


def _valid(rates: object, n: int) -> bool:
    return isinstance(rates, list) and len(rates) == n and all(isinstance(r, float) for r in rates)


def stage_rates(manifest: Manifest, model: StagedModel, device: str, slowdown: float = 1.0,
                use_cache: bool = True) -> tuple[float, ...]:
    """Samples/s on every stage for this device (divided by --slowdown), from the cache if there."""
    key, path = _cache_key(manifest, device), cache_dir() / "stage-rates.json"
    rates = _read_cache(path).get(key) if use_cache else None
    if not _valid(rates, model.n_stages):
        vocab = manifest.model.vocab_size
        rates = [bench_stage(model, s, manifest.inner.microbatch_size, torch.device(device), vocab)
                 for s in range(model.n_stages)]
        logger.info("stage benchmark on %s: %s samples/s", device, ", ".join(f"{r:.1f}" for r in rates))
        if use_cache:
            _write_cache(path, key, rates)
    return tuple(r / slowdown for r in rates)


def stage_rate(manifest: Manifest, model: StagedModel, device: str, stage: int, slowdown: float = 1.0,
               use_cache: bool = True) -> float:
    """Samples/s on one stage, for a peer pinned to it: it never weighs the others, but the swarm
    reads its announced rate before its first round (0 there reads as a stage with no capacity
    and draws other peers to it). From the whole-device cache entry if there, else one stage's
    benchmark, cached on its own."""
    key, path = _cache_key(manifest, device), cache_dir() / "stage-rates.json"
    cached = _read_cache(path) if use_cache else {}
    if _valid(cached.get(key), model.n_stages):
        return cached[key][stage] / slowdown
    own = cached.get(f"{key}|stage {stage}")
    if not _valid(own, 1):
        own = [bench_stage(model, stage, manifest.inner.microbatch_size, torch.device(device),
                           manifest.model.vocab_size)]
        logger.info("stage benchmark on %s: stage %d %.1f samples/s", device, stage, own[0])
        if use_cache:
            _write_cache(path, f"{key}|stage {stage}", own)
    return own[0] / slowdown


def device_memory(device: str) -> int:
    """Bytes the device has (CPU: the machine's RAM)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    import psutil
    return int(psutil.virtual_memory().total)
