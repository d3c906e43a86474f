"""The wire: protobuf messages (wire.proto -> wire_pb2), framing, and validation of incoming messages."""
