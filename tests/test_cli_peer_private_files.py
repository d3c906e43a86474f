"""A private joiner's own copy of the manifest says where the run's files are on its machine."""
from __future__ import annotations

import dataclasses

import pytest

from swarmgrad.peer.cli.peer import with_local_files
from swarmgrad.peer.manifest import Manifest


def _manifest(tokenizer: str, base_dir: str, lr: float = 1e-3) -> Manifest:
    m = Manifest(run_id="private-files")
    return dataclasses.replace(m, inner=dataclasses.replace(m.inner, lr=lr),
                               data=dataclasses.replace(m.data, tokenizer=tokenizer, base_dir=base_dir,
                                                        tokenizer_sha256="ab" * 32))


def test_the_local_copy_gives_the_paths_and_the_signed_manifest_the_rest() -> None:
    signed = _manifest("/coordinator/tok.json", "/coordinator/data")
    local = _manifest("/home/me/tok.json", "/home/me/data")
    out = with_local_files(signed, local)
    assert out.data.tokenizer == "/home/me/tok.json" and out.data.base_dir == "/home/me/data"
    assert out.hash == signed.hash and out.data.tokenizer_sha256 == signed.data.tokenizer_sha256


def test_another_runs_manifest_is_refused_naming_both_hashes() -> None:
    signed = _manifest("/coordinator/tok.json", "")
    other = _manifest("/home/me/tok.json", "", lr=2e-3)
    with pytest.raises(ValueError, match=f"signed {signed.hash[:12]}, this one is {other.hash[:12]}"):
        with_local_files(signed, other)
