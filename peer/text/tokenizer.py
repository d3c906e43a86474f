"""Tokenizers: the byte-level one every run had (256 ids, no file) and trained byte-level BPEs
(Hugging Face `tokenizers`), one JSON file a manifest names and pins by its sha256.

A trained tokenizer has the special tokens of `SPECIAL_TOKENS` at the first ids: ``<|endoftext|>``
(id 0) ends every document (the packer puts it between documents; a Llama export uses it as its
bos and eos token) and ``<|pad|>`` (id 1) pads a batch in generation. Training is deterministic:
the same files in the same order and the same vocabulary size give the same file, byte for byte,
so every peer that trains it itself gets the hash the manifest pins.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Protocol, Sequence

__all__ = ["EOD_TOKEN", "PAD_TOKEN", "SPECIAL_TOKENS", "BPETokenizer", "ByteTokenizer", "TextTokenizer",
           "TokenizerMismatch", "file_sha256", "load_tokenizer", "train_bpe", "verify_tokenizer"]

EOD_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOD_TOKEN, PAD_TOKEN)
"""In id order from 0."""

TRAIN_CHUNK_CHARS = 1 << 20
"""Training reads a file in pieces of about this many characters (cut at line ends), so a large file
is never one string in memory."""


class TokenizerMismatch(ValueError):
    """The tokenizer file is missing, differs from the one the manifest pins, or does not fit the model.
    The message is one line, naming the file, both hashes (or sizes) and the fix."""


class TextTokenizer(Protocol):
    """What the data path needs of a tokenizer."""

    vocab_size: int
    eod_id: int
    """The id put between documents."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_bytes(self) -> list[int]:
        """The UTF-8 bytes of text each id stands for (0 for special tokens): what bits per byte counts."""
        ...


class ByteTokenizer:
    """Bytes as tokens: what the byte-level GPT reads. There is no id to spare for an end of document,
    so documents are separated by a newline (``\\n``), as the byte corpus joins files."""

    vocab_size = 256
    eod_id = 10

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self) -> list[int]:
        return [1] * 256


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in of each byte (what a byte-level BPE's vocabulary is written in)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


class BPETokenizer:
    """A `tokenizers.Tokenizer` loaded from its JSON file."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer
        self.path = Path(path)
        self._tok = Tokenizer.from_file(str(self.path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # a document that quotes "<|endoftext|>" is text, not the end of a document
        self._tok.encode_special_tokens = True
        eod = self._tok.token_to_id(EOD_TOKEN)
        if eod is None:
            raise TokenizerMismatch(f"tokenizer: {self.path} has no {EOD_TOKEN} token to end documents with; "
                                    "train it with `swarmgrad tokenizer train`")
        self.eod_id = eod

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Several documents at once (the library spreads them over its threads)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self) -> list[int]:
        alphabet = _byte_alphabet()
        special = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        out = [0] * self.vocab_size
        for token, i in self._tok.get_vocab(with_added_tokens=True).items():
            if token in special:
                continue
            if all(c in alphabet for c in token):
                out[i] = len(token)
            else:  # not a byte-level vocabulary: what the id decodes to
                out[i] = len(self._tok.decode([i]).encode("utf-8"))
        return out


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _text_chunks(path: Path) -> Iterator[str]:
    """A text file in pieces cut after a newline, each about TRAIN_CHUNK_CHARS (memory stays bounded)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        buf: list[str] = []
        size = 0
        for line in f:
            buf.append(line)
            size += len(line)
            if size >= TRAIN_CHUNK_CHARS:
                yield "".join(buf)
                buf, size = [], 0
        if buf:
            yield "".join(buf)


@dataclass(frozen=True)
class TrainedTokenizer:
    path: Path
    vocab_size: int
    sha256: str

    def manifest_lines(self, relative_to: Path | None = None) -> str:
        """The `[data]` and `[model]` lines that name this tokenizer in a manifest."""
        shown = self.path
        if relative_to is not None:
            try:
                shown = self.path.absolute().relative_to(relative_to.absolute())
            except ValueError:
                pass
        return (f'[data]\ntokenizer = "{shown.as_posix()}"\ntokenizer_sha256 = "{self.sha256}"\n\n'
                f"[model]\nvocab_size = {self.vocab_size}")


def train_bpe(texts: Iterable[str], vocab_size: int, out: str | Path, min_frequency: int = 2) -> TrainedTokenizer:
    """Train a byte-level BPE on `texts` (documents or pieces of them, in a fixed order) and save it.

    The vocabulary holds the special tokens (ids 0, 1), the 256 bytes (so any text encodes), and
    merges up to `vocab_size` (fewer when the text has too few pairs to merge).

    Raises:
        ValueError: `vocab_size` below 256 + the special tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    floor = 256 + len(SPECIAL_TOKENS)
    if vocab_size < floor:
        raise ValueError(f"--vocab-size must be at least {floor} (the 256 bytes and {len(SPECIAL_TOKENS)} "
                         f"special tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out), pretty=False)
    return TrainedTokenizer(out, tok.get_vocab_size(with_added_tokens=True), file_sha256(out))


def train_bpe_on_files(paths: Sequence[Path], vocab_size: int, out: str | Path) -> TrainedTokenizer:
    """`train_bpe` over text files, in the order given, read in bounded pieces."""
    return train_bpe((chunk for p in paths for chunk in _text_chunks(Path(p))), vocab_size, out)


def load_tokenizer(path: str | Path | None) -> TextTokenizer:
    """The tokenizer a manifest's ``data.tokenizer`` names; bytes when it names none."""
    return BPETokenizer(path) if path else ByteTokenizer()


def verify_tokenizer(path: str, pinned_sha256: str, model_vocab_size: int | None) -> TextTokenizer:
    """The run's tokenizer, after checking that the file is the one the manifest pins and that the
    model's vocabulary covers it (``model_vocab_size`` None: not checked, an entry-point model).

    Raises:
        TokenizerMismatch: one line naming the file, what differs and the fix.
    """
    if not path:
        tok: TextTokenizer = ByteTokenizer()
    else:
        if not Path(path).is_file():
            raise TokenizerMismatch(f"tokenizer: data.tokenizer names {path}, which does not exist; copy the run's "
                                    "tokenizer file there (the manifest pins its sha256)")
        actual = file_sha256(path)
        if actual != pinned_sha256:
            raise TokenizerMismatch(f"tokenizer: {path} has sha256 {actual} but the manifest pins "
                                    f"data.tokenizer_sha256 = {pinned_sha256}: this peer's tokenizer differs from "
                                    "the run's; use the run's tokenizer file")
        tok = BPETokenizer(path)
    if model_vocab_size is not None and tok.vocab_size > model_vocab_size:
        raise TokenizerMismatch(f"tokenizer: {path or 'bytes'} has {tok.vocab_size} tokens but model.vocab_size is "
                                f"{model_vocab_size}: set model.vocab_size to at least {tok.vocab_size}")
    return tok
