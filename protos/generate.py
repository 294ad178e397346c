"""Regenerate the Python code for protos/pdserve/rpc/*.proto.

    python protos/generate.py            # in place, beside the .proto files
    python protos/generate.py OUT_DIR    # into OUT_DIR/pdserve/rpc (the test compares)

Run from anywhere; uses grpc_tools.protoc with -I protos so the generated imports
read `from pdserve.rpc import router_pb2`.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
RPC_DIR = PROTO_ROOT / "pdserve" / "rpc"


def proto_files() -> list[Path]:
    return sorted(RPC_DIR.glob("*.proto"))


def generate(out_dir: Path | str = PROTO_ROOT) -> list[Path]:
    from grpc_tools import protoc

    out = Path(out_dir)
    (out / "pdserve" / "rpc").mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).resolve().parent / "_proto"
    rel = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *rel,
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}: {' '.join(args)}")
    return sorted(p for p in (out / "pdserve" / "rpc").iterdir() if p.suffix in (".py", ".pyi"))


if __name__ == "__main__":
    for path in generate(sys.argv[1] if len(sys.argv) > 1 else PROTO_ROOT):
        print(path)
