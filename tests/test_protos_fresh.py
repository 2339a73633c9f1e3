"""The checked-in stubs (protos/*_pb2*.py, *.pyi) must be what scripts/gen_protos.py makes from the .proto
files today, and pyproject.toml's floors must admit them.

Compared by what they define, not byte for byte: every grpcio-tools release writes its own version into the
stubs (GRPC_GENERATED_VERSION, the protobuf gencode version), so a byte comparison failed on a fresh clone
whenever a newer grpcio-tools was installed (1.85.4 against stubs made by 1.85.1). Compared: the file
descriptor each *_pb2.py registers (messages, fields, enums, services, methods, options), the RPCs each
*_pb2_grpc.py stub calls against the services of that descriptor, and the names each .pyi declares. A
comment-only edit of a .proto reaches only the docstrings of *_pb2_grpc.py and is not compared.
"""

import ast
import importlib.util
import pathlib
import re
import shutil
import tomllib

import pytest
from google.protobuf import descriptor_pb2
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parent.parent
STREAM_KINDS = {(False, False): "unary_unary", (False, True): "unary_stream", (True, False): "stream_unary",
                (True, True): "stream_stream"}


def _gen_protos():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return gen


def _descriptor(pb2: pathlib.Path) -> descriptor_pb2.FileDescriptorProto:
    """The FileDescriptorProto a *_pb2.py registers (the bytes of its AddSerializedFile call)."""
    for node in ast.walk(ast.parse(pb2.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "AddSerializedFile":
            return descriptor_pb2.FileDescriptorProto.FromString(ast.literal_eval(node.args[0]))
    raise AssertionError(f"{pb2.name}: no AddSerializedFile call")


def _describe(fd: descriptor_pb2.FileDescriptorProto) -> set[str]:
    """One line per message field, enum value and method: what a mismatch names."""
    lines = set()

    def messages(prefix, types):
        for m in types:
            lines.add(f"message {prefix}{m.name}")
            for f in m.field:
                lines.add(f"field {prefix}{m.name}.{f.name} = {f.number} {f.label} {f.type} {f.type_name}")
            messages(f"{prefix}{m.name}.", m.nested_type)
            enums(f"{prefix}{m.name}.", m.enum_type)

    def enums(prefix, types):
        for e in types:
            lines.update(f"enum {prefix}{e.name}.{v.name} = {v.number}" for v in e.value)

    messages("", fd.message_type)
    enums("", fd.enum_type)
    for s in fd.service:
        lines.update(f"rpc {s.name}.{m.name}({'stream ' * m.client_streaming}{m.input_type}) -> "
                     f"{'stream ' * m.server_streaming}{m.output_type}" for m in s.method)
    return lines


def _rpcs_called(pb2_grpc: pathlib.Path) -> set[tuple[str, str, str, str]]:
    """(path, kind, request type, response type) of each `channel.<kind>('/pkg.Service/Method', ...)` call."""
    rpcs = set()
    for node in ast.walk(ast.parse(pb2_grpc.read_text())):
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) in STREAM_KINDS.values()
                and getattr(node.func.value, "id", None) == "channel"):
            types = {k.arg: k.value.value.attr for k in node.keywords if k.arg.endswith("serializer")}
            rpcs.add((node.args[0].value, node.func.attr, types["request_serializer"],
                      types["response_deserializer"]))
    return rpcs


def _rpcs_declared(fd: descriptor_pb2.FileDescriptorProto) -> set[tuple[str, str, str, str]]:
    return {(f"/{fd.package}.{s.name}/{m.name}", STREAM_KINDS[m.client_streaming, m.server_streaming],
             m.input_type.rsplit(".", 1)[-1], m.output_type.rsplit(".", 1)[-1])
            for s in fd.service for m in s.method}


def _pyi_names(pyi: pathlib.Path) -> set[str]:
    """Every class and the names each declares (attributes, methods), and the module's own names."""
    names = set()

    def visit(prefix, body):
        for node in body:
            if isinstance(node, ast.ClassDef):
                names.add(f"class {prefix}{node.name}")
                visit(f"{prefix}{node.name}.", node.body)
            elif isinstance(node, ast.AnnAssign):
                names.add(f"{prefix}{ast.unparse(node.target)}")
            elif isinstance(node, ast.Assign):
                names.update(f"{prefix}{ast.unparse(t)}" for t in node.targets)
            elif isinstance(node, ast.FunctionDef):
                names.add(f"def {prefix}{node.name}")

    visit("", ast.parse(pyi.read_text()).body)
    return names


def _stale(fresh: pathlib.Path, checked_in: pathlib.Path) -> list[str]:
    """What differs between two folders of stubs, by what they define; [] when they agree."""
    names = sorted(p.name for p in fresh.glob("*_pb2*.py*"))
    have = sorted(p.name for p in checked_in.glob("*_pb2*.py*"))
    problems = [] if names == have else [f"stub files differ: {names} made, {have} checked in"]
    for name in names:
        if not (checked_in / name).exists():
            continue
        if name.endswith("_pb2.py"):
            made, have = _descriptor(fresh / name), _descriptor(checked_in / name)
            if made != have:
                problems.append(f"{name}: descriptor differs: {sorted(_describe(made) ^ _describe(have))}")
        elif name.endswith("_pb2_grpc.py"):
            declared = _rpcs_declared(_descriptor(fresh / name.replace("_pb2_grpc.py", "_pb2.py")))
            called = _rpcs_called(checked_in / name)
            if declared != called:
                problems.append(f"{name}: RPCs differ from the .proto's: {sorted(declared ^ called)}")
        elif name.endswith(".pyi"):
            made, have = _pyi_names(fresh / name), _pyi_names(checked_in / name)
            if made != have:
                problems.append(f"{name}: declared names differ: {sorted(made ^ have)}")
    return problems


def test_generated_stubs_match_the_protos(tmp_path):
    """Fails when a .proto changed and `make protos` (python scripts/gen_protos.py) was not run."""
    fresh = _gen_protos().generate(tmp_path)[0].parent
    problems = _stale(fresh, ROOT / "protos")
    assert not problems, "stale stubs: run python scripts/gen_protos.py\n" + "\n".join(problems)


def test_stubs_of_another_grpcio_tools_release_still_match(tmp_path):
    """Only the version text differs between releases' output: it must not count (the byte comparison's
    failure on a fresh clone)."""
    other = tmp_path / "protos"
    other.mkdir()
    for stub in (ROOT / "protos").glob("*_pb2*.py*"):
        text = re.sub(r"GRPC_GENERATED_VERSION = '[^']+'", "GRPC_GENERATED_VERSION = '1.99.7'",
                      stub.read_text())
        text = re.sub(r"# Protobuf Python Version: \S+", "# Protobuf Python Version: 7.99.7", text)
        text = re.sub(r"(Domain\.PUBLIC,\s*)\d+,\s*\d+,\s*\d+,", r"\g<1>7,\n    99,\n    7,", text)
        (other / stub.name).write_text(text)
    assert _versions_needed(other) == (Version("1.99.7"), Version("7.99.7"))  # the rewrite took
    assert _stale(other, ROOT / "protos") == []


EDITS = {
    "a field": ("protos/buffer.proto", "message PutRequest {", "message PutRequest {\n  string note = 7;"),
    "an rpc": ("protos/buffer.proto", "service Buffer {",
               "service Buffer {\n  rpc Drain(AckRequest) returns (AckResponse);"),
    "a field's type": ("protos/buffer.proto", "uint32 accepted = 1;", "uint64 accepted = 1;"),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_proto_edited_without_regenerating_is_caught(tmp_path, monkeypatch, edit):
    """The same check on stubs made from a copy of the .protos with one edit, against the checked-in ones."""
    path, old, new = EDITS[edit]
    source = tmp_path / "src"
    shutil.copytree(ROOT / "protos", source / "protos",
                    ignore=shutil.ignore_patterns("*.py", "*.pyi", "__pycache__"))
    proto = source / path
    assert old in proto.read_text()
    proto.write_text(proto.read_text().replace(old, new, 1))
    gen = _gen_protos()
    monkeypatch.setattr(gen, "ROOT", source)
    fresh = gen.generate(tmp_path / "out")[0].parent
    problems = _stale(fresh, ROOT / "protos")
    assert problems and all(p.startswith("buffer_pb2") for p in problems), problems


def _versions_needed(folder: pathlib.Path) -> tuple[Version, Version]:
    """(grpcio, protobuf): the newest GRPC_GENERATED_VERSION of the *_pb2_grpc.py stubs, the newest gencode
    version of the *_pb2.py ones (ValidateProtobufRuntimeVersion(domain, major, minor, patch, ...) refuses
    older runtimes)."""
    grpc_needs, protobuf_needs = [], []
    for stub in folder.glob("*_pb2_grpc.py"):
        found = re.findall(r"^GRPC_GENERATED_VERSION = '([^']+)'$", stub.read_text(), re.MULTILINE)
        assert len(found) == 1, f"{stub.name}: GRPC_GENERATED_VERSION {found}"
        grpc_needs.append(Version(found[0]))
    for stub in folder.glob("*_pb2.py"):
        calls = [node for node in ast.walk(ast.parse(stub.read_text())) if isinstance(node, ast.Call)
                 and getattr(node.func, "attr", None) == "ValidateProtobufRuntimeVersion"]
        assert len(calls) == 1, f"{stub.name}: {len(calls)} ValidateProtobufRuntimeVersion calls"
        major, minor, patch = (ast.literal_eval(arg) for arg in calls[0].args[1:4])
        protobuf_needs.append(Version(f"{major}.{minor}.{patch}"))
    assert grpc_needs and protobuf_needs, f"no stubs in {folder}"
    return max(grpc_needs), max(protobuf_needs)


def _floor(requirement: str) -> Version | None:
    """The lowest version a requirement string admits, as far as its lower bounds say; None without one."""
    lows = [Version(spec.version.removesuffix(".*")) for spec in Requirement(requirement).specifier
            if spec.operator in (">=", ">", "==", "~=", "===")]
    return max(lows, default=None)


def _floors_below(pyproject: dict, folder: pathlib.Path) -> list[tuple[str, str, Version]]:
    """(list, requirement, version needed) for each requirement of `pyproject` whose floor is below what the
    stubs in `folder` need to import; grpcio-tools (the dev extra) makes the stubs, and a floor below theirs
    would regenerate older ones than those checked in."""
    grpc_needs, protobuf_needs = _versions_needed(folder)
    project = pyproject["project"]
    lists = {"dependencies": (project["dependencies"], {"grpcio": grpc_needs, "protobuf": protobuf_needs}),
             "dev": (project["optional-dependencies"]["dev"], {"grpcio-tools": grpc_needs})}
    low = []
    for where, (requirements, needs) in lists.items():
        by_name = {Requirement(r).name: r for r in requirements}
        for name, version in needs.items():
            floor = _floor(by_name[name]) if name in by_name else None
            if floor is None or floor < version:
                low.append((where, by_name.get(name, name), version))
    return low


def test_the_dependency_floors_admit_the_checked_in_stubs():
    """Every *_pb2_grpc.py raises RuntimeError under a grpcio older than its GRPC_GENERATED_VERSION and every
    *_pb2.py raises VersionError under an older protobuf: pyproject.toml's floors must not allow those."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    low = _floors_below(pyproject, ROOT / "protos")
    assert not low, "raise these floors in pyproject.toml: " + "; ".join(
        f"{where}: {req!r} admits versions below {version}, which the stubs need"
        for where, req, version in low)


def test_floors_below_the_stubs_are_caught():
    """The floors this project had before (grpcio>=1.66, protobuf>=5.28, grpcio-tools>=1.66) fail it."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    old = {"grpcio": "grpcio>=1.66", "protobuf": "protobuf>=5.28", "grpcio-tools": "grpcio-tools>=1.66"}
    project = pyproject["project"]
    project["dependencies"] = [old.get(Requirement(r).name, r) for r in project["dependencies"]]
    dev = project["optional-dependencies"]["dev"]
    project["optional-dependencies"]["dev"] = [old.get(Requirement(r).name, r) for r in dev]
    low = _floors_below(pyproject, ROOT / "protos")
    assert [(where, req) for where, req, _ in low] == [
        ("dependencies", "grpcio>=1.66"), ("dependencies", "protobuf>=5.28"), ("dev", "grpcio-tools>=1.66")]
