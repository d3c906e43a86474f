"""Helpers shared by several test modules, imported as ``support.NAME`` (pytest puts tests/ on
sys.path, as for ``conftest``): one module per subject, e.g. `support.state` for stage states and
their donors."""
