"""The process tests on one pytest-xdist worker, one at a time (`make test`, `--dist loadgroup`).

tests/conftest.py marks every test of a process tier with `xdist_group("processes")`, but
pytest-xdist 3.8 names a test's group by appending `@GROUP` to its node id, which pytest 9.2's
structured node ids ignore (pytest-dev/pytest-xdist#1386): the groups silently vanish and every
test is scheduled on its own, so two swarms would share the cores. So each worker writes the ids
of the process tests it collected to a folder the main process gave it (`workerinput`), before it
reports its collection, and the main process's scheduler reads them: a test listed there (or one
whose id carries xdist's own `@processes`, on a pytest where that still works) is in the group.

Only xdist's documented hooks are used (`pytest_configure_node`, `pytest_xdist_make_scheduler`)
and its loadgroup scheduler, of which only the grouping of a node id changes."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

GROUPS_KEY = "swarmgrad_process_tests"
"""The `workerinput` key of the folder in which each worker lists its process tests."""


def write_process_tests(folder: str, worker_id: str, nodeids: Iterable[str]) -> None:
    """Called on a worker once its collection is final: one node id a line, in WORKER.txt,
    written whole (a temporary name, then renamed) before the worker reports its collection."""
    path = Path(folder) / f"{worker_id}.txt"
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{nodeid}\n" for nodeid in nodeids))
    os.replace(tmp, path)


def read_process_tests(folder: str) -> set[str]:
    """The node ids that any worker listed (all workers collect the same tests)."""
    ids: set[str] = set()
    for path in Path(folder).glob("*.txt"):
        ids.update(line for line in path.read_text().splitlines() if line)
    return ids


def process_group_scheduler(config: Any, log: Any, folder: str, group: str) -> Any:
    """pytest-xdist's loadgroup scheduling in which the tests that the workers listed in `folder`
    form the work unit `group` (one worker runs them in collection order), every other test a unit
    of its own; units are handed out largest first, so the group starts at once."""
    from xdist.scheduler import LoadGroupScheduling

    class ProcessGroupScheduling(LoadGroupScheduling):
        _listed: set[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._listed is None:  # read once: scheduling begins after every worker collected
                self._listed = read_process_tests(folder)
            return group if nodeid in self._listed else super()._split_scope(nodeid)

    return ProcessGroupScheduling(config, log)
