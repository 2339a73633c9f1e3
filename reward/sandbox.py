"""Run untrusted Python in a confined subprocess: rlimits, wall-clock kill, private dir, no network,
a minimal root filesystem, a seccomp filter and a memory cgroup where the machine allows them.

The confinement itself happens in reward/jail.py (a launcher between this process and the
program); this side prepares the files, the allow-list of the root filesystem (reward/rootfs.py),
the seccomp filter (reward/seccomp.py) and the run's memory cgroup (reward/cgroup.py), starts the
launcher, enforces the wall-clock timeout by killing its whole process group, and collects the
output. `SandboxResult.isolation` says which measures took effect on this machine, so a weaker
sandbox never passes for a strong one. The program shares no descriptor with this process but
its stdin, stdout and stderr files: what it says is plain bytes, for the caller to judge.
"""

import json
import os
import pathlib
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from reward import rootfs, seccomp
from reward.cgroup import MemoryCgroup

JAIL = pathlib.Path(__file__).with_name("jail.py")
_SEARCH_PATH = "/usr/local/bin:/usr/bin:/bin"


class SandboxLimits(BaseModel):
    """Limits of one sandboxed run. The upper bounds keep a request from asking for the machine."""

    model_config = ConfigDict(extra="forbid")

    timeout_s: float = Field(10.0, gt=0, le=300, description="Wall-clock limit; then the process group is killed.")
    cpu_s: int = Field(5, gt=0, le=300, description="RLIMIT_CPU seconds (SIGXCPU, then SIGKILL one second later).")
    memory_mb: int = Field(1024, ge=64, le=16384, description="RLIMIT_AS (address space per process) and, "
                                                               "where a memory cgroup can be made, the memory "
                                                               "of all the run's processes together.")
    file_size_mb: int = Field(16, gt=0, le=1024, description="RLIMIT_FSIZE: largest file (and captured output).")
    workdir_mb: int = Field(64, gt=0, le=4096, description="Size of the private tmpfs working directory (as root).")
    max_processes: int = Field(32, gt=0, le=4096, description="RLIMIT_NPROC (per sandbox when the uid is dropped).")
    max_open_files: int = Field(64, ge=16, le=65536, description="RLIMIT_NOFILE.")
    max_output_bytes: int = Field(1 << 16, gt=0, le=1 << 24, description="stdout/stderr bytes kept.")
    isolate: bool = Field(True, description="As root: namespaces, read-only mounts, unprivileged uid.")
    uid_base: int = Field(1 << 20, ge=1000, le=1 << 30, description="Sandbox uid = uid_base + launcher pid.")
    python: str | None = Field(None, description="Interpreter for the program; None = this one if an "
                                                 "unprivileged uid may run it, else python3 on PATH.")


class SandboxError(RuntimeError):
    """The sandbox itself failed to start (not the program in it)."""


@dataclass
class SandboxResult:
    """What a sandboxed run did."""

    returncode: int | None  # None when killed at the wall-clock limit; -N when killed by signal N
    stdout: bytes
    stderr: bytes
    timed_out: bool
    wall_s: float
    isolation: dict[str, object] = field(default_factory=dict)
    # Processes of the run the kernel killed for passing the memory cgroup's limit.
    oom_kills: int = 0

    def describe(self) -> str:
        """A one-line account of how the run ended."""
        memory = f" ({self.oom_kills} process(es) killed at the memory limit)" if self.oom_kills else ""
        if self.timed_out:
            return f"wall-clock timeout after {self.wall_s:.1f}s{memory}"
        if self.returncode is not None and self.returncode < 0:
            return f"killed by {signal.Signals(-self.returncode).name}{memory}"
        return f"exit code {self.returncode}{memory}"


def _usable_by_anyone(path: str) -> bool:
    """Whether a process of an arbitrary uid can execute `path` (every directory on the way searchable)."""
    real = pathlib.Path(os.path.realpath(path))
    if not real.is_file() or not real.stat().st_mode & stat.S_IXOTH:
        return False
    return all(parent.stat().st_mode & stat.S_IXOTH for parent in real.parents)


def sandbox_python(limits: SandboxLimits) -> str:
    """The interpreter the program runs under."""
    if limits.python:
        return limits.python
    if not (limits.isolate and os.geteuid() == 0) or _usable_by_anyone(sys.executable):
        return sys.executable
    candidate = shutil.which("python3", path=_SEARCH_PATH)
    return candidate if candidate and _usable_by_anyone(candidate) else sys.executable


def _rlimits(limits: SandboxLimits) -> dict[str, tuple[int, int]]:
    mb = 1 << 20
    return {
        "RLIMIT_CPU": (limits.cpu_s, limits.cpu_s + 1),
        "RLIMIT_AS": (limits.memory_mb * mb, limits.memory_mb * mb),
        "RLIMIT_FSIZE": (limits.file_size_mb * mb, limits.file_size_mb * mb),
        "RLIMIT_NPROC": (limits.max_processes, limits.max_processes),
        "RLIMIT_NOFILE": (limits.max_open_files, limits.max_open_files),
        "RLIMIT_CORE": (0, 0),
    }


def _read_head(f, limit: int) -> bytes:
    f.seek(0)
    return f.read(limit)


def _drain(fd: int) -> bytes:
    """Read what a finished run left in a pipe without ever blocking."""
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def run_python(
    files: dict[str, str | bytes],
    main: str,
    limits: SandboxLimits,
    stdin: bytes = b"",
) -> SandboxResult:
    """Run `python -I main` with `files` in a fresh private directory under `limits`."""
    workdir = tempfile.mkdtemp(prefix="relayrl-sbx-")
    cgroup = MemoryCgroup.create(limits.memory_mb << 20) if limits.isolate else None
    try:
        for name, content in files.items():
            data = content.encode() if isinstance(content, str) else content
            pathlib.Path(workdir, name).write_bytes(data)
        # The real path: inside the minimal root only the interpreter's own file is there.
        python = os.path.realpath(sandbox_python(limits))
        return _launch(workdir, [python, "-I", main], limits, stdin, cgroup)
    finally:
        if cgroup is not None:
            cgroup.remove()
        shutil.rmtree(workdir, ignore_errors=True)


def _confinement(argv: list[str], limits: SandboxLimits, cgroup: MemoryCgroup | None) -> dict[str, object]:
    """The parts of the launcher's spec that say how to confine: root filesystem, seccomp, cgroup."""
    if not limits.isolate:
        return {"root": None, "seccomp": None, "cgroup_procs": None}
    numbers = seccomp.syscall_table(os.uname().machine)
    program = seccomp.filter_program()
    root = {**rootfs.layout(argv[0]), "pivot_root_nr": numbers["pivot_root"]} if numbers else None
    return {"root": root, "seccomp": program.hex() if program else None,
            "cgroup_procs": cgroup.procs if cgroup else None}


def _launch(workdir: str, argv: list[str], limits: SandboxLimits, stdin: bytes,
            cgroup: MemoryCgroup | None) -> SandboxResult:
    with tempfile.TemporaryFile() as stdin_file, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        stdin_file.write(stdin)
        stdin_file.seek(0)
        report_r, report_w = os.pipe()
        env = {"PATH": _SEARCH_PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1"}
        spec = {
            "argv": argv, "workdir": workdir, "env": env, "isolate": limits.isolate,
            "uid_base": limits.uid_base, "workdir_mb": limits.workdir_mb,
            "rlimits": _rlimits(limits), "report_fd": report_w, **_confinement(argv, limits, cgroup),
        }
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", str(JAIL), json.dumps(spec)],
                stdin=stdin_file, stdout=out, stderr=err, pass_fds=(report_w,),
                start_new_session=True, env={}, cwd="/",
            )
        finally:
            os.close(report_w)
        timed_out = False
        try:
            returncode: int | None = proc.wait(limits.timeout_s)
        except subprocess.TimeoutExpired:
            # The launcher leads its own process group; with a PID namespace its program's
            # whole tree dies with the program.
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
            returncode, timed_out = None, True
        wall_s = time.monotonic() - start
        report = _drain(report_r)
        os.close(report_r)
        if not report:
            raise SandboxError(f"sandbox launcher failed ({proc.returncode}): "
                               f"{_read_head(err, 4000).decode(errors='replace')}")
        return SandboxResult(
            returncode=returncode,
            stdout=_read_head(out, limits.max_output_bytes),
            stderr=_read_head(err, limits.max_output_bytes),
            timed_out=timed_out,
            wall_s=wall_s,
            isolation=json.loads(report),
            oom_kills=cgroup.oom_kills() if cgroup else 0,
        )
