"""`swarmgrad peer --run NAME[@FINGERPRINT]`: from a run's name to its verified manifest, and the
cache of the manifests a peer joined with.

The cache folder is `--cache-dir`, default `$SWARMGRAD_CACHE/runs` (`~/.cache/swarmgrad/runs`, beside
the stage benchmarks' cache): one file per run, `NAME@FINGERPRINT.manifest`, holding the signed blob
as the DHT served it. It is verified again whenever it is read, so a file edited on disk is refused
like a forged DHT entry. Beside it, for a run with a tokenizer, `NAME@FINGERPRINT.tokenizer.json`
(tokenizer_share.py), used only while its bytes hash to the signed sha256. The DHT's manifest is
preferred; the cached one is used only for a NAME@FINGERPRINT the swarm holds no manifest of (a run
restarted after all its peers stopped).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from swarmgrad.peer.public.directory import Found, RunDirectory
from swarmgrad.peer.public.run_name import RunName
from swarmgrad.peer.public.signed_manifest import ManifestRefused, PublishedManifest, verify


class RunNotFound(LookupError):
    """No run of that name, or more than one: the message is one line (with the candidates)."""


def default_cache_dir() -> Path:
    # the root of placement/bench.py's cache, read alike (not imported: that module loads torch,
    # which `swarmgrad runs` does not need)
    return Path(os.environ.get("SWARMGRAD_CACHE", Path.home() / ".cache" / "swarmgrad")) / "runs"


def cache_file(cache_dir: Path, run_id: str) -> Path:
    return cache_dir / f"{run_id}.manifest"


def save(cache_dir: Path, published: PublishedManifest) -> Path:
    """Write the signed blob atomically (a half-written file is never read)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_file(cache_dir, published.run_id)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(published.blob)
    tmp.replace(path)
    return path


def tokenizer_cache_file(cache_dir: Path, run_id: str) -> Path:
    """Where a run's tokenizer file is cached: beside its manifest (tokenizer_share.py fetches it)."""
    return cache_dir / f"{run_id}.tokenizer.json"


def save_tokenizer(cache_dir: Path, run_id: str, data: bytes) -> Path:
    """Write a verified tokenizer file atomically; its path."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = tokenizer_cache_file(cache_dir, run_id)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    tmp.replace(path)
    return path


def load_cached_tokenizer(cache_dir: Path, run_id: str, sha256: str) -> Path | None:
    """The cached tokenizer file of the run if its bytes hash to `sha256` (the signed digest); None
    if there is none or it differs (then it is fetched again and replaced)."""
    path = tokenizer_cache_file(cache_dir, run_id)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    return path if hashlib.sha256(data).hexdigest() == sha256 else None


def load_cached(cache_dir: Path, name: RunName) -> PublishedManifest | None:
    """The cached manifest of NAME@FINGERPRINT, verified; None if there is none. ManifestRefused
    for a file that does not verify."""
    if name.fingerprint is None:
        return None
    path = cache_file(cache_dir, name.full)
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return verify(blob, name)
    except ManifestRefused as e:
        raise ManifestRefused(f"{path}: {e}") from None


def choose(name: RunName, found: list[Found], cached: PublishedManifest | None) -> PublishedManifest:
    """Pure: which manifest `--run name` means. Raises RunNotFound (none, or several for a bare
    NAME: the message lists them as NAME@FINGERPRINT) or ManifestRefused (the DHT holds entries for
    the run, and every one is refused)."""
    valid = [f.published for f in found if f.published is not None]
    if len(valid) == 1:
        return valid[0]
    if len(valid) > 1:
        listed = ", ".join(sorted(p.run_id for p in valid))
        raise RunNotFound(f"{len(valid)} runs are named {name.name!r}: {listed}; give one as --run NAME@FINGERPRINT")
    if cached is not None:
        return cached
    refusals = [r for f in found for r in f.refusals]
    if refusals:
        raise ManifestRefused(f"refused the manifest of run {name}: {refusals[0]}")
    raise RunNotFound(f"no peer of the swarm serves a public run {name} (see `swarmgrad runs`)")


async def resolve(directory: RunDirectory, name: RunName, cache_dir: Path) -> PublishedManifest:
    """Fetch, verify and cache the manifest `--run name` means (choose)."""
    found = await directory.find(name)
    cached = load_cached(cache_dir, name) if not any(f.published for f in found) else None
    published = choose(name, found, cached)
    save(cache_dir, published)
    return published
