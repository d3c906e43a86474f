"""benchmarks/lm_quality.py's corpus: Debian's fortune files cut into documents, and the demo's rule
for training a tokenizer on the fly (peer/cli/demo.py)."""
from __future__ import annotations

import os
from pathlib import Path

from benchmarks.lm_quality import fortunes
from swarmgrad.peer.cli.demo import wants_stdlib_tokenizer
from swarmgrad.peer.manifest import load

REPO = Path(__file__).resolve().parent.parent


def test_fortunes_are_the_texts_between_percent_lines(tmp_path: Path) -> None:
    (tmp_path / "b").write_text("Second file.\n%\n")
    (tmp_path / "a").write_text("First fortune,\n  two lines.\n%\n%\n   \n%\nThird -- no closing line")
    (tmp_path / "a.dat").write_bytes(b"\x00\x02binary index")
    os.symlink(tmp_path / "a", tmp_path / "a.u8")
    os.symlink(tmp_path / "b", tmp_path / "c")  # Debian's *.u8 are links: a link is never read twice
    assert fortunes(tmp_path) == ["First fortune,\n  two lines.", "Third -- no closing line", "Second file."]


def test_the_demo_trains_a_tokenizer_only_for_a_llama_on_stdlib_without_one() -> None:
    gpt = load(REPO / "peer" / "defaults" / "tiny-gpt.toml")
    assert not wants_stdlib_tokenizer(gpt)  # the byte-level GPT: vocab_size 256
    llama = load(REPO / "examples" / "llama-cpu.toml")
    assert not wants_stdlib_tokenizer(llama)  # bytes: vocab_size 256
    assert wants_stdlib_tokenizer(llama.replace(model={"vocab_size": 2048}))
    assert not wants_stdlib_tokenizer(llama.replace(model={"vocab_size": 2048}, data={"source": "files",
                                                                                      "paths": ["x.txt"]}))
