"""Run a test as on a machine without an optional package (matplotlib, say)."""
from __future__ import annotations

import builtins

import pytest


def hide_package(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """Make `import package` and `import package.sub` raise ImportError until the test ends."""
    real_import = builtins.__import__

    def without(name: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name == package or name.startswith(package + "."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without)
