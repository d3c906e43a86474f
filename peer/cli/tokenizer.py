"""`swarmgrad tokenizer train`: a byte-level BPE from the user's text, and the manifest lines that
name and pin it."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator, Sequence


def train_tokenizer(patterns: Sequence[str], vocab_size: int, out: Path, source: str = "files",
                    text_field: str = "text") -> int:
    from swarmgrad.peer.text.sources import TextSource, expand_paths
    from swarmgrad.peer.text.tokenizer import train_bpe, train_bpe_on_files
    try:
        if source == "files":
            files = expand_paths(patterns, Path.cwd())
            what = f"{len(files)} file(s), {sum(f.stat().st_size for f in files) / 1e6:.1f} MB"
            trained = train_bpe_on_files(files, vocab_size, out)
        else:
            src = TextSource(source, patterns, Path.cwd(), text_field)

            def texts() -> Iterator[str]:
                for shard in src.shards:
                    yield from (d.text for d in src.documents(shard))
            what = f"{len(src.shards)} shard(s), {sum(s.size for s in src.shards) / 1e6:.1f} MB on disk"
            trained = train_bpe(texts(), vocab_size, out)
    except ValueError as e:
        print(f"swarmgrad tokenizer train: {e}", file=sys.stderr)
        return 2
    print(f"trained a byte-level BPE on {what}: vocab size {trained.vocab_size}"
          + ("" if trained.vocab_size == vocab_size else f" (asked {vocab_size}: the text has no more pairs to merge)"))
    print(f"wrote {out} (sha256 {trained.sha256})")
    print("\nput these lines into the run's manifest (data.tokenizer is relative to the manifest's folder; "
          "every peer needs this file):\n")
    print(trained.manifest_lines(relative_to=Path.cwd()))
    return 0
