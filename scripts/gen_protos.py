"""Regenerate protos/*_pb2.py, *_pb2_grpc.py and *.pyi from protos/*.proto.

Usage: python scripts/gen_protos.py [--out DIR]   (DIR defaults to the repository root)
"""

import argparse
import pathlib
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent


def generate(out: pathlib.Path) -> list[pathlib.Path]:
    protos = sorted((ROOT / "protos").glob("*.proto"))
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[str(p.relative_to(ROOT)) for p in protos],
    ]
    (out / "protos").mkdir(parents=True, exist_ok=True)
    if protoc.main(args) != 0:
        sys.exit("protoc failed")
    return sorted((out / "protos").glob("*_pb2*.py*"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT)
    for path in generate(parser.parse_args().out):
        print(path)
