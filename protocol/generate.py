"""Regenerate (or check) the committed protobuf code from the .proto files in this folder.

    python -m swarmgrad.protocol.generate          # rewrite the *_pb2.py (and *_pb2_grpc.py) files
    python -m swarmgrad.protocol.generate --check  # exit 1 if any of them is stale

The generated file is committed so that installing swarmgrad needs no protoc; the check keeps
it honest. grpcio-tools is pinned in the `test` extra because protoc's output (and the
protobuf runtime it requires) changes between versions.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTOS = ("wire.proto", "coordinator.proto", "libp2p_key.proto")
GRPC_PROTOS = ("coordinator.proto",)
"""Protos with a gRPC service: their stubs (_pb2_grpc.py) are generated and committed too."""


def generate(proto: str) -> dict[str, str]:
    """{file name: text} of the code protoc writes for `proto`."""
    from grpc_tools import protoc  # test/dev dependency only

    stem = proto.removesuffix(".proto")
    with tempfile.TemporaryDirectory() as out:
        args = ["protoc", f"-I{HERE}", f"--python_out={out}"]
        if proto in GRPC_PROTOS:
            args.append(f"--grpc_python_out={out}")
        rc = protoc.main(args + [str(HERE / proto)])
        if rc != 0:
            raise RuntimeError(f"protoc failed on {proto} (exit {rc})")
        files = {f"{stem}_pb2.py": (Path(out) / f"{stem}_pb2.py").read_text()}
        if proto in GRPC_PROTOS:
            # protoc writes a top-level import; ours live in a package
            text = (Path(out) / f"{stem}_pb2_grpc.py").read_text()
            files[f"{stem}_pb2_grpc.py"] = text.replace(f"import {stem}_pb2 as",
                                                        f"from swarmgrad.protocol import {stem}_pb2 as")
        return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare, do not write")
    args = parser.parse_args(argv)
    stale = []
    for proto in PROTOS:
        for name, fresh in generate(proto).items():
            target = HERE / name
            if target.exists() and target.read_text() == fresh:
                continue
            stale.append(name)
            if not args.check:
                target.write_text(fresh)
    if args.check and stale:
        print(f"stale generated code: {', '.join(stale)}; run python -m swarmgrad.protocol.generate", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
