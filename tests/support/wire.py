"""An encoded tensor as a receiver rebuilds it: through the wire form and the live parser
(protocol/validation.py), so codec tests check what a peer really decodes."""
from __future__ import annotations

from swarmgrad.compression import Encoded
from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.validation import encoded_from_proto, encoded_to_proto


def rebuilt(enc: Encoded, max_bytes: int = 1 << 40) -> Encoded:
    return encoded_from_proto(pb.EncodedTensor.FromString(encoded_to_proto(enc).SerializeToString()), max_bytes)
