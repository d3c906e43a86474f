"""The chaos soak's pure figures (benchmarks/chaos.py), computed from events without a swarm."""
from __future__ import annotations

from benchmarks.chaos import duplicated, find_stalls


def test_duplicated_counts_every_extra_commit_of_an_id() -> None:
    # two stage-1 replicas: "d1:7" trained on both (a re-sent microbatch committed twice), "d2:7" is
    # another driver's microbatch 7 (not a duplicate), "d1:8" three times over two round events
    rounds = [["d1:7", "d1:8"], ["d1:7", "d2:7", "d1:8"], ["d1:8"]]
    assert duplicated(rounds) == (3, 3)
    assert duplicated([["a:1"], ["a:2"]]) == (0, 2)
    assert duplicated([]) == (0, 0)


def test_find_stalls_counts_the_gap_to_the_end() -> None:
    assert find_stalls([0.0, 4.0, 8.0], 30.0, 12.0) == [(8.0, 22.0)]
    assert find_stalls([0.0, 20.0, 24.0], 25.0, 12.0) == [(0.0, 20.0)]
