"""Benchmark rows as manifest overrides: ``NAME:KEY=VALUE,KEY=VALUE,...`` on the command line, so
that a new manifest option becomes a new row without a code change.

- ``KEY`` is a dotted path into the manifest: ``pipeline.lookahead``, ``inner.lr``, ``seed``.
- ``VALUE`` is read as a TOML value where it is one (``true``, ``4``, ``1e-3``, ``[2, 8, 8]``,
  ``"a,b"``) and as a bare string otherwise (``fp32``, ``hadamard:bits=4``).
- Overrides are separated by commas outside brackets and quotes. A piece whose key is not dotted
  (and is not ``run_id`` or ``seed``) belongs to the value before it, so a codec spec with
  commas needs no quotes: ``pipeline.gradient_codec=hadamard:bits=4,stochastic=true``.
- ``NAME:`` (nothing after the colon) is the manifest as it is.

`apply` builds the manifest through `swarmgrad.peer.manifest.from_dict`, which validates every
field and the cross-field checks: an unknown key or a bad value is an `OverrideError` naming the
row and the key, before anything starts.
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass
from typing import Any

from swarmgrad.peer.manifest import Manifest, ManifestError, from_dict, to_dict

TOP_LEVEL = ("run_id", "seed")
"""The manifest's keys outside any section."""


class OverrideError(ValueError):
    """A row that cannot be parsed or whose manifest does not load: the message names the row and key."""


@dataclass(frozen=True)
class Row:
    """A benchmark row: a name and the overrides, in the order given."""
    name: str
    overrides: tuple[tuple[str, Any], ...] = ()

    def spec(self) -> str:
        """The row as it would be written on the command line (round-trips through `parse_row`)."""
        return f"{self.name}:" + ",".join(f"{k}={_show(v)}" for k, v in self.overrides)


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if _value(value) == value and "," not in value else '"' + value.replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) if not isinstance(v, str) else f'"{v}"' for v in value) + "]"
    return repr(value)


def _split(text: str) -> list[str]:
    """Split at commas outside [] and quotes."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            if ch == quote and text[i - 1] != "\\":
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _is_key(piece: str) -> bool:
    key = piece.split("=", 1)[0].strip()
    return "=" in piece and ("." in key or key in TOP_LEVEL) and all(part.isidentifier() for part in key.split("."))


def _value(text: str) -> Any:
    """A TOML value if `text` is one, else `text` itself (a bare string)."""
    text = text.strip()
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_row(text: str) -> Row:
    """``NAME:KEY=VALUE,...`` -> Row. Raises OverrideError on a missing name or a piece without a key."""
    name, sep, rest = text.partition(":")
    name = name.strip()
    if not sep or not name or not all(c.isalnum() or c in "-_." for c in name):
        raise OverrideError(f"row {text!r}: write NAME:KEY=VALUE,... (NAME of letters, digits, '-', '_', '.'; "
                            f"'NAME:' for the manifest as it is)")
    pieces: list[str] = []
    for piece in _split(rest) if rest.strip() else []:
        if _is_key(piece):
            pieces.append(piece)
        elif pieces:  # a comma inside an unquoted value (a codec spec's options)
            pieces[-1] += "," + piece
        else:
            raise OverrideError(f"row {name!r}: {piece!r} is not KEY=VALUE with a dotted KEY "
                                f"(e.g. pipeline.lookahead=true)")
    overrides = []
    for piece in pieces:
        key, _, value = piece.partition("=")
        overrides.append((key.strip(), _value(value)))
    keys = [k for k, _ in overrides]
    if len(set(keys)) != len(keys):
        raise OverrideError(f"row {name!r}: a key is given twice ({', '.join(sorted({k for k in keys if keys.count(k) > 1}))})")
    return Row(name, tuple(overrides))


def parse_rows(texts: list[str]) -> list[Row]:
    rows = [parse_row(t) for t in texts]
    names = [r.name for r in rows]
    if len(set(names)) != len(names):
        raise OverrideError(f"rows: a name is used twice ({', '.join(sorted({n for n in names if names.count(n) > 1}))})")
    return rows


def apply(m: Manifest, row: Row) -> Manifest:
    """`m` with the row's overrides, loaded and validated as a manifest file would be."""
    data = to_dict(m)
    for key, value in row.overrides:
        *path, leaf = key.split(".")
        node = data
        for i, part in enumerate(path):
            if not isinstance(node.get(part, {}), dict):
                raise OverrideError(f"row {row.name!r}: {key}: {'.'.join(path[:i + 1])} is a value, not a section")
            node = node.setdefault(part, {})
        node[leaf] = value
    try:
        return from_dict(data)
    except ManifestError as e:
        raise OverrideError(f"row {row.name!r}: {e}") from None
