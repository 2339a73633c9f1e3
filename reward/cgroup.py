"""A memory cgroup per sandboxed run, where this process may make one: the limit covers every
process of the run together (and its tmpfs pages), where RLIMIT_AS only bounds each process.

Where: `$RELAYRL_SANDBOX_CGROUP` when set (a cgroup v2 directory delegated to this user, with
`memory` in its cgroup.subtree_control, or a cgroup v1 memory directory); otherwise this process's
own cgroup, if it is writable and can hold a child with a memory limit: on cgroup v2 when `memory`
is enabled in its subtree_control (a delegated subtree), on cgroup v1 in the memory hierarchy
(as root). Nowhere of these: None, and the sandbox reports `memory_cgroup: false`.
"""

import os
import pathlib
import secrets
import signal
import time
from dataclasses import dataclass

ENV = "RELAYRL_SANDBOX_CGROUP"


_PREFIX = "relayrl-sbx-"


def _sweep(parent: pathlib.Path) -> None:
    """Remove the cgroups left by runs whose process was killed mid-run (a reward worker past its
    timeout), named after that process's pid; a cgroup still in use refuses rmdir and stays."""
    for child in parent.glob(f"{_PREFIX}*"):
        pid = child.name[len(_PREFIX):].partition("-")[0]
        if pid.isdigit() and not pathlib.Path(f"/proc/{pid}").exists():
            try:
                child.rmdir()
            except OSError:
                pass  # processes still in it, or removed by another sweeper meanwhile


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(mount root, mount point, fs type, super options) of every cgroup filesystem in /proc/self/mountinfo."""
    found = []
    for line in pathlib.Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        fstype, options = fields[sep + 1], set(fields[sep + 3].split(","))
        if fstype in ("cgroup", "cgroup2"):
            found.append((fields[3], fields[4], fstype, options))
    return found


def _own_paths() -> tuple[str | None, str | None]:
    """This process's cgroup v2 path and its v1 memory-hierarchy path, from /proc/self/cgroup."""
    v2 = v1 = None
    for line in pathlib.Path("/proc/self/cgroup").read_text().splitlines():
        number, controllers, path = line.split(":", 2)
        if number == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _under(mount_root: str, mount_point: str, path: str) -> pathlib.Path | None:
    if path != mount_root and not path.startswith(mount_root.rstrip("/") + "/"):
        return None  # our cgroup lies outside what this mount shows
    return pathlib.Path(mount_point, os.path.relpath(path, mount_root))


def _usable(directory: pathlib.Path) -> int | None:
    """The cgroup version a child of `directory` could take a memory limit in, None if it could not."""
    if not os.access(directory, os.W_OK | os.X_OK):
        return None
    control = directory / "cgroup.subtree_control"
    if control.exists():
        return 2 if "memory" in control.read_text().split() else None
    return 1 if (directory / "memory.limit_in_bytes").exists() else None


def find_parent() -> tuple[pathlib.Path, int] | None:
    """Where per-run memory cgroups can be made, and their version."""
    if os.environ.get(ENV):
        parent = pathlib.Path(os.environ[ENV])
        version = _usable(parent)
        return (parent, version) if version else None
    v2_path, v1_path = _own_paths()
    for mount_root, mount_point, fstype, options in _mounts():
        own = v2_path if fstype == "cgroup2" else (v1_path if "memory" in options else None)
        directory = _under(mount_root, mount_point, own) if own is not None else None
        version = _usable(directory) if directory is not None else None
        if version:
            return directory, version
    return None


@dataclass
class MemoryCgroup:
    """One run's cgroup: the launcher writes its pid to `procs` before it forks anything."""

    path: pathlib.Path
    version: int

    @property
    def procs(self) -> str:
        return str(self.path / "cgroup.procs")

    @classmethod
    def create(cls, limit_bytes: int) -> "MemoryCgroup | None":
        """A fresh cgroup limited to `limit_bytes`; None where the machine refuses one."""
        found = find_parent()
        if found is None:
            return None
        parent, version = found
        _sweep(parent)
        path = parent / f"{_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        limits = [("memory.max", limit_bytes), ("memory.swap.max", 0)] if version == 2 else [
            ("memory.limit_in_bytes", limit_bytes), ("memory.memsw.limit_in_bytes", limit_bytes)]  # no swap past it
        try:
            path.mkdir()
            for name, value in limits:
                if (path / name).exists():
                    (path / name).write_text(str(value))
        except OSError:  # a read-only cgroupfs, a limit the hierarchy refuses: RLIMIT_AS only
            if path.exists():
                path.rmdir()
            return None
        return cls(path, version)

    def oom_kills(self) -> int:
        """How many processes of the run the kernel killed for passing the limit."""
        events = self.path / ("memory.events" if self.version == 2 else "memory.oom_control")
        if not events.exists():
            return 0  # removed under us (see _sweep): nothing to count
        for line in events.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self, wait_s: float = 5.0) -> None:
        """Kill whatever of the run is left (a program without a PID namespace may leave orphans),
        then remove the cgroup."""
        deadline = time.monotonic() + wait_s
        while self.path.exists():
            if self.version == 2 and (self.path / "cgroup.kill").exists():
                (self.path / "cgroup.kill").write_text("1")
            else:
                # Only this run's processes are in here. (A pid read here could only be reused
                # by another process if the run's one exited and pids wrapped around meanwhile.)
                for pid in (self.path / "cgroup.procs").read_text().split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass  # it exited since the list was read
            try:
                self.path.rmdir()
                return
            except OSError:  # EBUSY until the killed processes are gone
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
