"""The checked-in stubs must be what scripts/gen_protos.py makes from the .proto files today."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_generated_stubs_match_the_protos(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    fresh = {p.name: p.read_bytes() for p in gen.generate(tmp_path)}
    checked_in = {p.name: p.read_bytes() for p in (ROOT / "protos").glob("*_pb2*.py*")}
    assert sorted(fresh) == sorted(checked_in), "stub files differ: run python scripts/gen_protos.py"
    stale = [name for name in fresh if fresh[name] != checked_in[name]]
    assert not stale, f"stale stubs {stale}: run python scripts/gen_protos.py"
