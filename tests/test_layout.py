"""The import order of `peer/` (docs/architecture.md, "Layout"): a module imports only from its own
layer or a lower one, so each subsystem can be read, tested and replaced with only what is below it.

Type-only imports count too: a subsystem that needs another's type to be written down depends on it.
"""
from __future__ import annotations

import ast
from pathlib import Path

PEER = Path(__file__).resolve().parent.parent / "peer"

LAYERS: list[set[str]] = [
    {"records", "events", "manifest", "manifest_checks", "model", "data", "text", "decisions", "evidence"},
    {"net"},
    {"shards"},  # the data leases: read and write the DHT through net's SwarmView; the driver uses them
    {"clock"},
    {"compute"},
    {"averaging"},
    {"state"},
    {"placement"},
    {"pipeline"},
    {"rounds"},
    {"private"},
    {"public"},
    {"node"},
    {"coordinator"},
    {"sim"},
    {"cli"},
]
"""Lowest first. A unit is a subpackage of `peer/` or one of its top-level modules."""


def layer_of(unit: str) -> int:
    for i, layer in enumerate(LAYERS):
        if unit in layer:
            return i
    raise AssertionError(f"peer/{unit} is in no layer of tests/test_layout.py: give it one (and a row in "
                         "docs/architecture.md)")


def imported_units(path: Path) -> list[tuple[str, int]]:
    """(unit, line) for every `swarmgrad.peer` import in the file, at any depth (late imports too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("swarmgrad.peer"):
            parts = node.module.split(".")[2:]
            if parts:
                found.append((parts[0], node.lineno))
            else:
                found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[:2] == ["swarmgrad", "peer"] and len(parts) > 2:
                    found.append((parts[2], node.lineno))
    return found


def unit_of(path: Path) -> str:
    rel = path.relative_to(PEER)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def test_every_unit_has_a_layer() -> None:
    units = {unit_of(p) for p in PEER.rglob("*.py") if p.name != "__init__.py" or p.parent != PEER}
    for unit in units:
        layer_of(unit)


def test_imports_point_down() -> None:
    back_edges = []
    for path in sorted(PEER.rglob("*.py")):
        if path.parent == PEER and path.name == "__init__.py":
            continue
        me = unit_of(path)
        for unit, line in imported_units(path):
            if unit != me and layer_of(unit) > layer_of(me):
                back_edges.append(f"{path.relative_to(PEER.parent)}:{line} ({me}) imports {unit}")
    assert not back_edges, "imports against the layer order:\n" + "\n".join(back_edges)


def test_peer_is_imported_by_nothing_below_it() -> None:
    for folder in ("protocol", "compression"):
        for path in (PEER.parent / folder).rglob("*.py"):
            assert "swarmgrad.peer" not in path.read_text(), f"{path} imports swarmgrad.peer"
