"""The sandbox: limits hold, hostile programs end within the timeout, and the isolation report is true."""

import json
import os
import pathlib
import socket
import tempfile
import time
import uuid

import pytest

from reward.sandbox import SandboxLimits, run_python

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
    assert set(seen["env"]) <= {"PATH", "HOME", "TMPDIR", "LANG", "PYTHONDONTWRITEBYTECODE", "RELAYRL_RESULT_FD",
                                "LC_CTYPE"}
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
