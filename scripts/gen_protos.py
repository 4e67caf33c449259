"""Generate the specdec.v1 Python gRPC code from protos/ (the one reproducible step).

    python scripts/gen_protos.py           # write specdec/v1/*_pb2*.py
    python scripts/gen_protos.py --check   # exit 1 when the committed code is stale

The generated modules are committed so that `pip install .` needs no build hook;
CI runs --check so they never drift from the .proto files.
"""
from __future__ import annotations

import argparse
import filecmp
import pathlib
import shutil
import sys
import tempfile

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT_PACKAGE = pathlib.Path("specdec") / "v1"


def generate(out_root: pathlib.Path) -> list[pathlib.Path]:
    protos = sorted(PROTO_ROOT.glob("specdec/v1/*.proto"))
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}",
            f"--python_out={out_root}", f"--pyi_out={out_root}", f"--grpc_python_out={out_root}"]
    args += [str(p.relative_to(PROTO_ROOT)) for p in protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out_root / OUT_PACKAGE).glob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when committed code is stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generated = generate(pathlib.Path(tmp))
        committed_dir = ROOT / OUT_PACKAGE
        if args.check:
            stale = [g.name for g in generated
                     if not (committed_dir / g.name).exists()
                     or not filecmp.cmp(g, committed_dir / g.name, shallow=False)]
            extra = {p.name for p in committed_dir.glob("*_pb2*.py*")} - {g.name for g in generated}
            if stale or extra:
                print(f"generated gRPC code is stale: {sorted(stale + list(extra))}; "
                      "run `make protos` and commit", file=sys.stderr)
                return 1
            print(f"generated gRPC code is up to date ({len(generated)} files)")
            return 0
        for g in generated:
            shutil.copy(g, committed_dir / g.name)
        print(f"wrote {len(generated)} files to {committed_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
