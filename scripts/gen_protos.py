"""Regenerate the Python stubs (with .pyi) from protos/quillcache/v1/*.proto.

Usage: python scripts/gen_protos.py [--check]
  --check  regenerate into a temp dir and fail if the committed stubs differ.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PACKAGE_DIR = PROTO_ROOT / "quillcache" / "v1"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_root: Path) -> list[Path]:
    from grpc_tools import protoc

    protos = sorted(PACKAGE_DIR.glob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {PACKAGE_DIR}")
    include = Path(protoc.__file__).resolve().parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    generated = out_root / "quillcache" / "v1"
    return sorted(p for p in generated.iterdir() if p.name.endswith(SUFFIXES))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if committed stubs differ")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        produced = generate(Path(tmp))
        if args.check:
            committed = sorted(p.name for p in PACKAGE_DIR.iterdir() if p.name.endswith(SUFFIXES))
            names = [p.name for p in produced]
            if names != committed:
                print(f"stub set differs: generated {names}, committed {committed}")
                return 1
            stale = [
                p.name for p in produced if not filecmp.cmp(p, PACKAGE_DIR / p.name, shallow=False)
            ]
            if stale:
                print("generated stubs are out of date, run scripts/gen_protos.py:", *stale)
                return 1
            print(f"protos: {len(names)} generated files match")
            return 0
        for old in PACKAGE_DIR.iterdir():
            if old.name.endswith(SUFFIXES):
                old.unlink()
        for path in produced:
            shutil.copy(path, PACKAGE_DIR / path.name)
        print(f"wrote {len(produced)} files to {PACKAGE_DIR.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
