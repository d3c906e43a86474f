"""The gather exchange of a small group's outer round (manifest averaging.gather_up_to).

In the reduce-scatter (peer/averaging/averager.py) the reducer of a part decodes every member's
contribution, aggregates them and *encodes the aggregate again* for the answer. With a 1-2 bit
codec that second encode is the larger loss: a mean of two members' signs is 0 wherever they
disagree, and a 1-bit code has no zero (measured in docs/averaging-codecs.md: most of the gap to
fp32 pseudo-gradients). In the gather exchange the reducer answers each member with the *other*
members' parts exactly as they encoded them; every member decodes the same bytes, adds its own
decoded part and aggregates in sorted member order with the reducer's own code
(peer.aggregate.reduce_part), so θ_global stays bit-identical and nothing is encoded twice.

Bytes: a member sends its part j to reducer j and gets back the (n - 1) other parts j, so over a
round it sends (n - 1) x its contribution, which is what the reduce-scatter with a mean in the
members' codec costs for n = 2 ((contribution + mean) / 2 x 2) and more from n = 3 on. The robust
aggregate (3+ members) then runs on every member instead of on the reducer: same inputs, same
code, same order; the digest cross-check of groups larger than 2 fails a round in which members
computed different means all the same.

Pure functions: the Averager gathers the parts and acts on what these return.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from swarmgrad.peer.averaging.aggregate import reduce_part
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.responses import GatherResult

__all__ = ["gathers", "gather_answer", "aggregate_gathered", "group_total"]


def gathers(group_size: int, gather_up_to: int) -> bool:
    """Whether a group of this size uses the gather exchange (0: never)."""
    return 2 <= group_size <= gather_up_to


def group_total(weights: Sequence[float]) -> float:
    """The round's total weight, summed in sorted member order (every member sums the same floats
    in the same order, so totals compare exactly)."""
    total = 0.0
    for w in weights:
        total += float(w)
    return total


def gather_answer(order: Sequence[str], weights: Mapping[str, float], parts: Mapping[str, Sequence[pb.NamedTensor]],
                  caller: str, signed: Mapping[str, tuple[float, bytes]] | None = None) -> pb.AverageResponse:
    """The reducer's answer to `caller`: every other member's encoded part, sorted by member.

    `order`: the group's members, sorted; `weights` and `parts`: each member's counted weight and
    encoded tensors for this reducer's part (the caller's own are left out: it has them).
    `signed` (averaging.verify): each member's weight as it signed it and its signature; the parts
    then carry those, and the caller bounds the weights itself (peer/averaging/signed_parts.py)."""
    others = [pb.Contribution(member=p, weight=float(signed[p][0] if signed else weights[p]), tensors=list(parts[p]),
                              signature=signed[p][1] if signed else b"")
              for p in order if p != caller]
    return pb.AverageResponse(status=pb.OK, contributors=list(order), others=others,
                              total_weight=group_total(weights[p] for p in order))


def aggregate_gathered(result: GatherResult, me: str, my_weight: float, mine: dict[str, torch.Tensor],
                       robust_min_members: int, max_weight_ratio: float) -> tuple[dict[str, torch.Tensor], float]:
    """(the part's aggregate, the group's total weight) from the other members' decoded parts and
    our own (`mine`: decoded from the bytes we sent, as everyone else decodes them).

    Raises:
        ValueError: the reducer's total weight is not the sum of the weights it sent with ours
            (it reports one thing and sends another).
    """
    members = sorted([(p, w, t) for p, w, t in result.others] + [(me, float(my_weight), mine)], key=lambda e: e[0])
    total = group_total(w for _, w, _ in members)
    if total != result.total_weight:
        raise ValueError(f"the reducer's total weight {result.total_weight} is not the sum of the parts' ({total})")
    return reduce_part([(w, t) for _, w, t in members], robust_min_members, max_weight_ratio), total
