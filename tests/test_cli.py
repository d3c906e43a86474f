"""The command line refuses bad values with one line naming the flag, before anything starts."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiny-gpt.toml"


@pytest.mark.parametrize("flags, word", [
    (["--stage", "foo"], "--stage"),
    (["--stage", "-1"], "--stage"),
    (["--stage", "7"], "--stage 7"),
    (["--max-rounds", "-1"], "--max-rounds"),
    (["--linger", "inf"], "--linger"),
    (["--metrics-port", "70000"], "--metrics-port"),
    (["--metrics-port", "http"], "--metrics-port"),
])
def test_bad_peer_flags_fail_fast(flags: list[str], word: str) -> None:
    out = subprocess.run([sys.executable, "-m", "swarmgrad.peer.cli", "peer", "--manifest", str(EXAMPLE), *flags],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert word in lines[-1], out.stderr
    assert "Traceback" not in out.stderr


def test_bad_manifest_fails_fast(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('run_id = "x"\n[outer]\nlr = inf\n')
    out = subprocess.run([sys.executable, "-m", "swarmgrad.peer.cli", "peer", "--manifest", str(bad)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "outer.lr" in out.stderr and "Traceback" not in out.stderr
