"""Generate the Python gRPC stubs from proto/ (run by the package build and by `make proto`).

proto/areal_k8s/api/v1/x.proto -> services/areal_k8s/api/v1/x_pb2.py, importable as areal_k8s.api.v1.x_pb2.
The generated files are build outputs: never edited, never committed.
"""

import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
STUB_DIR = ROOT / "services" / "areal_k8s" / "api" / "v1"


def generate_stubs() -> list[Path]:
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "areal_k8s" / "api" / "v1").glob("*.proto"))
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as out:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            *protos,
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed for {protos}")
        written = []
        for generated in sorted((Path(out) / "areal_k8s" / "api" / "v1").iterdir()):
            target = STUB_DIR / generated.name
            shutil.copyfile(generated, target)
            written.append(target)
    return written


if __name__ == "__main__":
    for path in generate_stubs():
        print(path.relative_to(ROOT), file=sys.stderr)
