"""The sandbox: limits hold, hostile programs end within the timeout, and the isolation report is true."""

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid

import pytest

from reward import seccomp
from reward.sandbox import SandboxLimits, run_python, sandbox_python

# Hostile programs get a short leash; well-behaved ones a long one, so a loaded machine cannot fail them.
LIMITS = SandboxLimits(timeout_s=1.0, cpu_s=1, memory_mb=512, file_size_mb=4, max_output_bytes=4096)
GENEROUS = LIMITS.model_copy(update={"timeout_s": 30.0})


def processes_with(marker: str) -> list[int]:
    """Pids of live processes whose command line contains `marker`."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:  # the process exited while we looked
                continue
    return found


@pytest.fixture
def listener():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        server.setblocking(False)
        yield server


@pytest.fixture
def open_dir():
    """A world-writable directory outside the sandbox: only the sandbox's own confinement can stop a write."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="relayrl-outside-"))
    path.chmod(0o777)
    yield path
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


def test_isolation_report_matches_what_the_program_can_do(listener, open_dir, monkeypatch):
    monkeypatch.setenv("RELAYRL_TEST_SECRET", "hunter2")
    port = listener.getsockname()[1]
    probe = f"""
import json, os, socket
def attempt(action):
    try:
        action()
        return "ok"
    except OSError as exc:
        return type(exc).__name__
def connect():
    socket.create_connection(("127.0.0.1", {port}), timeout=1).close()
print(json.dumps({{
    "connect": attempt(connect),
    "write_outside": attempt(lambda: open({str(open_dir / 'escape.txt')!r}, "w").write("x")),
    "write_own": attempt(lambda: open("own.txt", "w").write("x")),
    "env": sorted(os.environ), "uid": os.getuid(), "cwd": os.getcwd(),
}}))
"""
    result = run_python({"main.py": probe}, "main.py", GENEROUS)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    report = result.isolation
    assert seen["write_own"] == "ok"
    assert pathlib.Path(seen["cwd"]).name.startswith("relayrl-sbx-")
    assert "RELAYRL_TEST_SECRET" not in seen["env"]
    assert set(seen["env"]) <= {"PATH", "HOME", "TMPDIR", "LANG", "PYTHONDONTWRITEBYTECODE", "LC_CTYPE"}
    # What the report claims is what the program met.
    assert report.get("network_cut", False) == (seen["connect"] != "ok")
    if report.get("network_cut"):
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing got through
    if report.get("readonly_fs"):
        assert seen["write_outside"] != "ok" and not (open_dir / "escape.txt").exists()
    if report.get("uid_drop"):
        assert seen["uid"] not in (0, os.getuid())
    if os.geteuid() == 0 and LIMITS.isolate:
        assert report["uid_drop"] and report["network_cut"] and report["readonly_fs"] and report["pid_namespace"]


@pytest.mark.parametrize("name, program", [
    ("busy loop", "while True: pass"),
    ("sleep", "import time\ntime.sleep(600)"),
    ("fork bomb that retries", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"),
])
def test_endless_program_is_killed_at_the_timeout(name, program):
    start = time.monotonic()
    result = run_python({"main.py": program}, "main.py", LIMITS)
    elapsed = time.monotonic() - start
    assert elapsed < LIMITS.timeout_s + 5, f"{name} ran {elapsed:.1f}s"
    assert result.timed_out or result.returncode != 0, f"{name} ended normally: {result.describe()}"


@pytest.mark.parametrize("name, program, error", [
    ("10 GB", "blob = bytearray(10 * 1024**3)", b"MemoryError"),
    ("fork bomb", "import os\nwhile True:\n    os.fork()", b"BlockingIOError"),
    ("huge file", "open('big', 'wb').write(b'x' * (64 << 20))", b"File too large"),
    ("stdout flood", "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", b"File too large"),
])
def test_a_limit_ends_the_program(name, program, error):
    """Each of these is stopped by its rlimit, not by the clock (which is generous here)."""
    result = run_python({"main.py": program}, "main.py", GENEROUS)
    assert not result.timed_out and result.returncode != 0, f"{name}: {result.describe()}"
    assert error in result.stderr, result.stderr[-300:]
    assert len(result.stdout) <= LIMITS.max_output_bytes


def test_children_that_left_the_process_group_end_with_the_program():
    marker = f"relayrl-orphan-{uuid.uuid4().hex}"
    program = (
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)', {marker!r}], start_new_session=True)\n"
        "print('spawned')\n"
    )
    result = run_python({"main.py": program}, "main.py", GENEROUS)
    assert result.stdout == b"spawned\n", result.stderr
    deadline = time.monotonic() + 5
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = processes_with(marker)
    for pid in survivors:  # only reachable without a PID namespace; clean up by pid before reporting
        os.kill(pid, 9)
    if not result.isolation.get("pid_namespace"):
        pytest.skip(f"no PID namespace on this machine (isolation: {result.isolation})")
    assert not survivors


def test_stdin_and_exit_codes():
    result = run_python({"main.py": "import sys\nprint(sys.stdin.read().upper())\nsys.exit(3)"}, "main.py", GENEROUS,
                        stdin=b"hello")
    assert (result.returncode, result.stdout, result.timed_out) == (3, b"HELLO\n", False)
    assert result.describe() == "exit code 3"
    killed = run_python({"main.py": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)"}, "main.py", GENEROUS)
    assert killed.describe() == "killed by SIGKILL"


def test_limits_are_bounded():
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxLimits(memory_mb=1 << 20)
    with pytest.raises(ValueError, match="timeout_s"):
        SandboxLimits(timeout_s=0)


REPO = pathlib.Path(__file__).resolve().parent.parent
PROTECTIONS = ("network_cut", "mount_namespace", "minimal_root", "readonly_fs", "private_tmpfs", "pid_namespace",
               "private_proc", "caps_dropped", "no_new_privs", "seccomp", "memory_cgroup", "memory_rlimit")
# Run in the sandbox: what the program can reach of the host, as JSON on stdout.
REACH = """
import ctypes, json, os, socket, subprocess, sys, threading
def attempt(action):
    try:
        action()
        return "ok"
    except OSError as exc:
        return type(exc).__name__
def listing(path):
    try:
        return sorted(os.listdir(path))
    except OSError as exc:
        return type(exc).__name__
libc = ctypes.CDLL(None, use_errno=True)
def refused(result):
    if result != 0:
        raise OSError(ctypes.get_errno(), "refused")
def trace_me():  # in a child that exits at once, so that no stop ever reaches its tracer
    child = os.fork()
    if child == 0:
        os._exit(0 if libc.ptrace(0, 0, 0, 0) == 0 else 1)
    if os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) != 0:
        raise PermissionError("ptrace refused")
with open("paths.json") as f:
    paths = json.load(f)
thread = threading.Thread(target=lambda: None)
thread.start()
thread.join()
print(json.dumps({
    "root": sorted(os.listdir("/")),
    "etc": sorted(os.listdir("/etc")),
    "passwd": attempt(lambda: open("/etc/passwd").read()),
    "repo": attempt(lambda: os.listdir(paths["repo"])),
    "repo_file": attempt(lambda: open(paths["repo_file"]).read()),
    "root_home": listing("/root"),
    "home": attempt(lambda: os.listdir(paths["home"])),
    "secret": attempt(lambda: open(paths["secret"]).read()),
    "proc": sorted(name for name in os.listdir("/proc") if name.isdigit()) if os.path.isdir("/proc") else [],
    "inet_socket": attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM)),
    "unix_socketpair": attempt(socket.socketpair),
    "unshare": attempt(lambda: refused(libc.unshare(0x10000000))),
    "ptrace": attempt(trace_me),
    "mount": attempt(lambda: refused(libc.mount(b"none", b"/tmp", b"tmpfs", 0, None))),
    "subprocess": subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True).stdout.decode().strip(),
    "dev_null": attempt(lambda: open("/dev/null", "w").write("x")),
    "write_own": attempt(lambda: open("own.txt", "w").write("x")),
}))
"""


@pytest.fixture
def secret_file():
    """A file any uid may read, outside the allow-list: only the minimal root hides it."""
    directory = pathlib.Path(tempfile.mkdtemp(prefix="relayrl-host-"))
    directory.chmod(0o755)
    path = directory / "secret.txt"
    path.write_text("hunter2")
    path.chmod(0o644)
    yield path
    path.unlink()
    directory.rmdir()


def reach_files(secret: pathlib.Path) -> dict[str, str]:
    """The probe and the host paths it tries: the repository, this process's home, a readable file."""
    paths = {"repo": str(REPO), "repo_file": str(REPO / "pyproject.toml"), "home": os.path.expanduser("~"),
             "secret": str(secret)}
    return {"main.py": REACH, "paths.json": json.dumps(paths)}


def reach(secret: pathlib.Path, limits: SandboxLimits = GENEROUS) -> tuple[dict, dict]:
    result = run_python(reach_files(secret), "main.py", limits)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    return json.loads(result.stdout), result.isolation


def check_allow_list(seen: dict, report: dict) -> None:
    """What a program in the minimal root must (not) reach."""
    assert set(seen["root"]) <= {"usr", "lib", "lib64", "lib32", "libx32", "etc", "dev", "proc", "tmp", "root"}
    assert seen["etc"] == ["ld.so.cache"]
    for key in ("passwd", "repo", "repo_file", "home", "secret"):
        assert seen[key] == "FileNotFoundError", (key, seen[key])
    # /root exists only when the interpreter lives under it, holding just the path down to it.
    python = pathlib.PurePath(os.path.realpath(sandbox_python(GENEROUS)))
    under_root = python.parts[2:3] if python.parts[1:2] == ("root",) else ()
    assert seen["root_home"] in ("FileNotFoundError", list(under_root)), seen["root_home"]
    assert seen["write_own"] == "ok" and seen["dev_null"] == "ok" and seen["subprocess"] == "42"
    if report.get("private_proc"):
        assert 1 <= len(seen["proc"]) <= 4, seen["proc"]  # the sandbox's own processes, nothing of the host
    assert report.get("minimal_root") and report.get("readonly_fs"), report


def check_seccomp(seen: dict, report: dict) -> None:
    assert seen["inet_socket"] == "PermissionError" and seen["unix_socketpair"] == "ok"
    assert seen["unshare"] == "PermissionError" and seen["ptrace"] == "PermissionError"
    assert seen["mount"] == "PermissionError"
    assert report.get("seccomp"), report


def namespaces_allowed() -> bool:
    """Root, or a user namespace may be made (what the minimal root needs), asked of the kernel directly."""
    probe = "import ctypes, sys\nsys.exit(ctypes.CDLL(None).unshare(0x10000000) != 0)"
    return os.geteuid() == 0 or subprocess.run([sys.executable, "-c", probe], check=False).returncode == 0


def seccomp_available() -> bool:
    """The kernel filters syscalls, on an architecture the filter has a table for."""
    status = pathlib.Path("/proc/self/status").read_text()
    return "Seccomp:" in status and os.uname().machine in ("x86_64", "aarch64")


def test_the_program_sees_only_the_allow_list(secret_file):
    if not namespaces_allowed():
        pytest.skip("neither root nor unprivileged user namespaces: no mount namespace for a minimal root")
    seen, report = reach(secret_file)
    check_allow_list(seen, report)


def test_seccomp_refuses_sockets_namespaces_ptrace_and_mounts(secret_file):
    if not seccomp_available():
        pytest.skip(f"no seccomp filter on this machine (kernel without it, or {os.uname().machine})")
    seen, report = reach(secret_file)
    check_seccomp(seen, report)


def test_the_report_lists_every_protection():
    report = run_python({"main.py": "pass"}, "main.py", GENEROUS).isolation
    assert set(PROTECTIONS) <= set(report), report
    assert all(isinstance(report[name], bool) for name in PROTECTIONS), report
    assert report["memory_rlimit"]
    off = run_python({"main.py": "pass"}, "main.py", GENEROUS.model_copy(update={"isolate": False})).isolation
    confined = ("network_cut", "minimal_root", "readonly_fs", "pid_namespace", "seccomp", "memory_cgroup")
    assert not any(off.get(name) for name in confined), off  # isolate=False claims none of them


def test_the_memory_cgroup_bounds_all_processes_together():
    """Four processes of 150 MB each pass RLIMIT_AS (256 MB per process); the cgroup's 256 MB for
    the whole run kills one of them."""
    program = ("import os\npids = []\nfor _ in range(4):\n    pid = os.fork()\n    if pid == 0:\n"
               "        blob = b'x' * (150 << 20)\n        import time\n        time.sleep(2)\n        os._exit(0)\n"
               "    pids.append(pid)\nprint(sorted(os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids))\n")
    from reward.cgroup import find_parent

    if find_parent() is None:
        pytest.skip("no memory cgroup can be made here (a delegated cgroup v2 subtree, or cgroup v1 as root)")
    limits = GENEROUS.model_copy(update={"memory_mb": 256})
    result = run_python({"main.py": program}, "main.py", limits)
    assert result.isolation["memory_cgroup"], result.isolation
    assert result.oom_kills >= 1, (result.describe(), result.stdout, result.stderr[-500:])
    assert "killed at the memory limit" in result.describe()
    if result.returncode == 0:
        assert b"-9" in result.stdout  # a child died of SIGKILL, the parent saw it


def test_without_root_the_user_namespace_path_confines_the_same(secret_file, tmp_path):
    """The sandbox run by an unprivileged uid: user namespace, minimal root, seccomp."""
    if os.geteuid() != 0:
        pytest.skip("already unprivileged: the other tests exercise this path")
    python = shutil.which("python3", path="/usr/bin:/bin:/usr/local/bin")
    site = pathlib.Path(sysconfig.get_paths()["purelib"])  # where pydantic is, for reward.sandbox
    if python is None or not all(p.stat().st_mode & 0o001 for p in (site, *site.parents, REPO, *REPO.parents)):
        pytest.skip("no interpreter an unprivileged uid can run, or this checkout's packages are not readable to it")
    version = subprocess.run([python, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True,
                             check=False)
    if version.stdout.strip() != str(sys.version_info[:2]):
        pytest.skip(f"{python} is not Python {sys.version_info[:2]}: this venv's packages would not load")
    tmp_path.chmod(0o777)
    script = (
        "import json, sys\n"
        f"sys.path[:0] = [{str(REPO)!r}, {str(site)!r}]\n"
        "from reward.sandbox import SandboxLimits, run_python\n"
        "result = run_python(json.load(sys.stdin), 'main.py', SandboxLimits(timeout_s=30))\n"
        "print(json.dumps({'rc': result.returncode, 'out': result.stdout.decode(), 'err': result.stderr.decode(),"
        " 'report': result.isolation}))\n"
    )
    nobody = 65534
    done = subprocess.run([python, "-I", "-c", script], input=json.dumps(reach_files(secret_file)), capture_output=True,
                          text=True, timeout=120, check=False, user=nobody, group=nobody, extra_groups=[], cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path), "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    outcome = json.loads(done.stdout)
    report = outcome["report"]
    assert not report["root"] and not report.get("uid_drop")
    if not report.get("user_namespace"):
        pytest.skip(f"unprivileged user namespaces are off on this machine: {report}")
    assert outcome["rc"] == 0, outcome["err"][-2000:]
    seen = json.loads(outcome["out"])
    check_allow_list(seen, report)
    if report.get("seccomp"):
        check_seccomp(seen, report)
    assert report["network_cut"] and report["pid_namespace"] and report["caps_dropped"]


@pytest.mark.parametrize("machine, header", [("x86_64", "/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
                                             ("aarch64", "/usr/include/asm-generic/unistd.h")])
def test_seccomp_syscall_numbers_match_the_kernel_headers(machine, header):
    if not os.path.exists(header):
        pytest.skip(f"{header} is not installed")
    defined = {}
    for line in pathlib.Path(header).read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "#define" and parts[2].isdigit():
            defined[parts[1].removeprefix("__NR3264_").removeprefix("__NR_")] = int(parts[2])
    table = seccomp.syscall_table(machine)
    assert {name: defined.get(name) for name in table} == table
    assert seccomp.filter_program(machine) is not None and seccomp.filter_program("sparc") is None
