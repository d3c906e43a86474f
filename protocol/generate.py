"""Regenerate (or check) the committed protobuf code from the .proto files in this folder.

    python -m swarmgrad.protocol.generate          # rewrite wire_pb2.py
    python -m swarmgrad.protocol.generate --check  # exit 1 if wire_pb2.py is stale

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
PROTOS = ("wire.proto",)


def generate(proto: str) -> str:
    from grpc_tools import protoc  # test/dev dependency only

    with tempfile.TemporaryDirectory() as out:
        rc = protoc.main(["protoc", f"-I{HERE}", f"--python_out={out}", str(HERE / proto)])
        if rc != 0:
            raise RuntimeError(f"protoc failed on {proto} (exit {rc})")
        return (Path(out) / proto.replace(".proto", "_pb2.py")).read_text()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare, do not write")
    args = parser.parse_args(argv)
    stale = []
    for proto in PROTOS:
        target = HERE / proto.replace(".proto", "_pb2.py")
        fresh = generate(proto)
        if target.exists() and target.read_text() == fresh:
            continue
        stale.append(target.name)
        if not args.check:
            target.write_text(fresh)
    if args.check and stale:
        print(f"stale generated code: {', '.join(stale)}; run python -m swarmgrad.protocol.generate", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
