"""Regenerate the committed protobuf code: ``python -m dataparallel.control.generate [OUT_DIR]``.

Needs ``grpcio-tools``. Writes ``dataparallel/control/v1/control_pb2.py``
(and ``.pyi``) under OUT_DIR, by default the source tree.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "protos"
PROTOS = ["dataparallel/control/v1/control.proto"]


def generate(out_dir: Path = ROOT) -> list[Path]:
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *PROTOS,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted(out_dir.glob("dataparallel/control/v1/*_pb2*.py*"))


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT):
        print(path)
