"""A member's check of one part's answer under averaging.verify (docs/trust.md, "Reducers").

The reducer of a part forwards the members' signed parts with its answer (peer/averaging/reducer.py);
the member (peer/averaging/averager.py) checks them here before it counts the part: every signature
(peer/averaging/signed_parts.py), then the aggregate recomputed with the reducer's own code. Pure:
it reads the answer and the round's context, and says what the part is worth, or that the reducer
answered something its members did not send (`Forged`: the member votes failed and blames it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from swarmgrad.compression import Codec
from swarmgrad.peer.averaging.aggregate import reduce_part
from swarmgrad.peer.averaging.gather import gathers, group_total
from swarmgrad.peer.averaging.group import Group
from swarmgrad.peer.averaging.signed_parts import part_refusal
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.responses import AverageResult, validate_average_response, validate_gather_response
from swarmgrad.protocol.validation import Codecs, RunIdentity, encoded_to_proto


@dataclass(frozen=True)
class Forged:
    """A reducer's answer that is not what its members sent."""
    why: str


@dataclass(frozen=True)
class PartChecker:
    """What a member needs to check the answers of its round's reducers (one per Averager)."""
    identity: RunIdentity
    stage: int
    me: str
    max_numel: int
    part_codecs: Codecs
    """The members' codecs (their forwarded parts)."""
    mean_codecs: Codecs
    """The reduce codec's names (a mean)."""
    reduce_codec: Codec
    """What a reducer encodes a mean with: deterministic (the manifest checks refuse anything else)."""
    gather_up_to: int
    robust_min_members: int
    max_weight_ratio: float

    def check(self, res: pb.AverageResponse, expected: Mapping[str, tuple[int, ...]], group: Group, round_no: int,
              part: int, weights: Mapping[str, float], registered: Mapping[str, float],
              mine: tuple[float, Mapping[str, torch.Tensor]]) -> AverageResult | Forged:
        """Part `part`'s answer `res`, checked against the signed parts it forwards.

        Every other member's part must carry that member's signature for this round, group and
        part. The aggregate of those parts and ours (`mine`: our weight and decoded Δ), computed as
        the reducer computes it (aggregate.reduce_part at the bounded `weights`, in sorted member
        order), is the part's value in the gather exchange; in the reduce-scatter, encoded with the
        reduce codec, it must be the mean's bytes exactly. `registered`: what each member
        registered (a signed weight may not claim more). A malformed answer raises ProtocolError
        as validate_gather_response does; a refusal comes back as a not-ok AverageResult."""
        what = f"part {part}"
        reduces = not gathers(len(group.members), self.gather_up_to)
        if reduces and group.members[part] == self.me:  # our own mean: we computed it
            return validate_average_response(res, dict(expected), group.members, self.max_numel, self.mean_codecs,
                                             what=f"mean of {what}")
        got = validate_gather_response(res, expected, group.members, self.me, registered, self.max_numel,
                                       self.part_codecs, what=what, with_mean=reduces)
        if not got.ok:
            return AverageResult(got.status, got.reason)
        for c in res.others:
            refusal = part_refusal(c.member, c.signature, self.identity.run_id, self.identity.manifest_hash,
                                   self.stage, round_no, group.hash, part, c.weight, c.tensors)
            if refusal is not None:
                return Forged(refusal)
        # counted as the reducer counts them: at most the bounded weight (a part sent early carries
        # the weight its member had before the group bounded it)
        members = sorted([(p, min(w, weights.get(p, 0.0)), t) for p, w, t in got.others]
                         + [(self.me, mine[0], {n: mine[1][n] for n in expected})], key=lambda e: e[0])
        total = group_total(w for _, w, _ in members)
        if total != got.total_weight:
            return Forged(f"its total weight {got.total_weight} is not the sum of the signed parts' ({total})")
        aggregate = reduce_part([(w, t) for _, w, t in members], self.robust_min_members, self.max_weight_ratio)
        if not reduces:
            return AverageResult(pb.OK, "", aggregate, got.contributors, total)
        means = {named.name: named.tensor for named in res.tensors}
        if sorted(means) != sorted(expected):
            return Forged(f"its mean names {sorted(means)[:4]}, not the part's tensors")
        for name in sorted(expected):
            if encoded_to_proto(self.reduce_codec.encode(aggregate[name])) != means[name]:
                return Forged(f"its mean of {name} is not the aggregate of the members' signed parts")
        return validate_average_response(res, dict(expected), group.members, self.max_numel, self.mean_codecs,
                                         what=f"mean of {what}")
