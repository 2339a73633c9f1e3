"""Sandbox launcher: confine this process, fork the untrusted program into it, pass on its exit.

Run by reward/sandbox.py as `python -I -S jail.py SPEC_JSON`; standard library only. First it
joins the run's memory cgroup, when the sandbox made one. As root it cuts the network (a new
network namespace: only a down loopback), and in a private mount namespace builds a minimal root
filesystem (a tmpfs holding only the allow-list of reward/rootfs.py, bound read-only, plus a
fresh /proc of its PID namespace), pivots into it and mounts a size-capped private tmpfs as the
working directory; it starts a PID namespace (when its first process exits, the kernel kills
every process left in it) and drops to an unprivileged uid of its own (uid_base + this pid,
unique among live processes, so RLIMIT_NPROC counts only this sandbox). Without root it first
becomes root of a new user namespace, where the system allows that, and applies the same
namespaces and mounts without the uid drop. Where the minimal root cannot be built, every
mount of the host is made read-only instead (the program can then read what its uid may). The
capability bounding set is emptied either way, so the program cannot undo a mount, and the
seccomp filter of reward/seccomp.py is installed last, before exec. Where none of this is
permitted, the rlimits, the minimal environment and the parent-death signal still apply. Just
before exec, the program's process writes a JSON report of which measures took effect to
`report_fd`.
"""

import ctypes
import errno
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 1 << 14, 1 << 18
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MNT_DETACH = 1, 32, 4096, 1024, 2048, 1 << 21, 2
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS = 1, 24, 22, 38
SECCOMP_MODE_FILTER = 2
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 1

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def ok(result: int) -> bool:
    """A libc call succeeded; a refusal (EPERM in a container, ENOSYS on an old kernel) is reported, not fatal."""
    return result == 0


def unshare(flag: int) -> bool:
    return ok(libc.unshare(flag))


def _c_string(text: str | None) -> bytes | None:
    return text.encode() if text is not None else None


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> bool:
    return ok(libc.mount(_c_string(source), _c_string(target), _c_string(fstype), ctypes.c_ulong(flags),
                         _c_string(data)))


def make_all_mounts_readonly() -> bool:
    attr = MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    return ok(libc.syscall(SYS_MOUNT_SETATTR, ctypes.c_int(AT_FDCWD), b"/", ctypes.c_uint(AT_RECURSIVE),
                           ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr))))


def remount_readonly(targets: list[str]) -> bool:
    """Where mount_setattr is missing (kernels before 5.12): remount each mount read-only one by
    one, keeping the flags it has (a user namespace may not clear a flag locked on it)."""
    kept = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
            (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))
    for target in targets:
        flags = os.statvfs(target).f_flag
        extra = sum(ms for st, ms in kept if flags & st)
        if not mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | extra, None):
            return False
    return True


def umount(target: str) -> bool:
    return ok(libc.umount2(_c_string(target), ctypes.c_int(MNT_DETACH)))


def read_files(workdir: str) -> dict[str, bytes]:
    files = {}
    for name in os.listdir(workdir):
        with open(os.path.join(workdir, name), "rb") as f:
            files[name] = f.read()
    return files


def private_workdir(workdir: str, size_mb: int, uid: int, files: dict[str, bytes]) -> bool:
    """Mount a tmpfs of `size_mb` owned by `uid` over `workdir` and put `files` in it."""
    if not mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size_mb}m,mode=0700,uid={uid},gid={uid}"):
        return False
    for name, data in files.items():
        with open(os.path.join(workdir, name), "wb") as f:
            f.write(data)
        os.chown(os.path.join(workdir, name), uid, uid)
    return True


def build_root(root: str, layout: dict) -> bool:
    """Mount a tmpfs at `root` (the working directory's path, whose files were read) and bind the
    allow-list into it; the working directory's own path inside it becomes a mount point.
    On a refusal, nothing of it stays mounted."""
    if not mount("tmpfs", root, "tmpfs", MS_NOSUID, "size=1m,mode=0755"):
        return False
    # Binds first (real paths, no symlink on the way), then the symlinks, so that no mount target
    # resolves through a symlink into the host.
    for path in layout["binds"]:
        target = root + path
        if os.path.isdir(path):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "a").close()
        if not mount(path, target, None, MS_BIND | MS_REC, None):
            umount(root)
            return False
    for path, destination in layout["symlinks"]:
        if not os.path.lexists(root + path):
            os.makedirs(os.path.dirname(root + path), exist_ok=True)
            os.symlink(destination, root + path)
    os.makedirs(root + "/proc", exist_ok=True)
    os.makedirs(root + root, exist_ok=True)
    return True


def enter_root(root: str, pivot_root_nr: int) -> bool:
    """Make `root` this mount namespace's root and detach the old one entirely."""
    os.chdir(root)
    if not ok(libc.syscall(ctypes.c_long(pivot_root_nr), b".", b".")):
        os.chdir("/")
        return False
    # The old root now lies on top of the new one: until it is gone, "/" would show the host.
    if not umount("."):
        raise OSError(ctypes.get_errno(), "cannot detach the old root after pivot_root")
    os.chdir("/")
    return True


def install_seccomp(program: bytes) -> bool:
    """Install the classic-BPF filter (packed sock_filters); needs no_new_privs without root."""
    code = ctypes.create_string_buffer(program, len(program))
    fprog = SockFprog(len(program) // 8, ctypes.addressof(code))
    return ok(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0))


def join_cgroup(procs: str) -> bool:
    """Move this process (and so everything it forks) into the run's memory cgroup."""
    try:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    except OSError:  # not permitted here (a v2 tree this uid may not move processes in): RLIMIT_AS only
        return False
    return True


def enter_user_namespace() -> bool:
    """Without root: become root of a new user namespace (mapped to this uid), which lets this
    process create the other namespaces. Refused where unprivileged user namespaces are off."""
    uid, gid = os.getuid(), os.getgid()
    if not unshare(CLONE_NEWUSER):
        return False
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    return True


def drop_capability_bounding_set() -> bool:
    """No capability can come back at exec, even to uid 0 of a user namespace."""
    cap = 0
    while libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
        cap += 1
    return cap > 0 and ctypes.get_errno() == errno.EINVAL


def readonly_host(spec: dict, uid: int, files: dict[str, bytes], report: dict) -> None:
    """Without a minimal root: every mount of the host read-only, the working directory a private tmpfs."""
    report["readonly_fs"] = make_all_mounts_readonly()
    report["private_tmpfs"] = private_workdir(spec["workdir"], spec["workdir_mb"], uid, files)


def confine(spec: dict, uid: int, report: dict) -> dict[str, bytes]:
    """Namespaces and the root filesystem (the pivot itself happens in the PID namespace's init,
    after it has mounted /proc); each measure is tried on its own and reported. Returns the
    working directory's files, which the private tmpfs will hold."""
    files = read_files(spec["workdir"])
    report["network_cut"] = unshare(CLONE_NEWNET)
    report["mount_namespace"] = unshare(CLONE_NEWNS) and mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    if report["mount_namespace"]:
        report["minimal_root"] = bool(spec["root"]) and build_root(spec["workdir"], spec["root"])
        if not report["minimal_root"]:
            readonly_host(spec, uid, files, report)
    report["pid_namespace"] = unshare(CLONE_NEWPID)
    return files


def finish_root(spec: dict, uid: int, files: dict[str, bytes], report: dict) -> None:
    """In the PID namespace's init: /proc, then the pivot into the minimal root (or, where the
    pivot is refused, the read-only host), the private working directory."""
    root = spec["workdir"]
    if report.get("pid_namespace"):
        # Mounted before the pivot: a user namespace may mount a procfs only while one is visible.
        report["private_proc"] = mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    report["minimal_root"] = enter_root(root, spec["root"]["pivot_root_nr"])
    if report["minimal_root"]:
        mounts = ["/", *spec["root"]["binds"], *(["/proc"] if report.get("private_proc") else [])]
        report["readonly_fs"] = make_all_mounts_readonly() or remount_readonly(mounts)
        report["private_tmpfs"] = private_workdir(spec["workdir"], spec["workdir_mb"], uid, files)
        return
    umount(root)
    readonly_host(spec, uid, files, report)
    report["private_proc"] = report.get("pid_namespace", False) and mount(
        "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)


def become_program(spec: dict, uid: int | None, report: dict) -> None:
    """Limits, identity, then exec the program. Never returns."""
    for name, (soft, hard) in spec["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    if spec["isolate"]:
        report["caps_dropped"] = drop_capability_bounding_set()
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    report["uid_drop"] = uid is not None
    report["no_new_privs"] = ok(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))
    # Set after setuid: a credential change clears the parent-death signal.
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.chdir(spec["workdir"])
    # Last: from here on only write, close and execve are needed.
    report["seccomp"] = bool(spec["seccomp"]) and report["no_new_privs"] and install_seccomp(
        bytes.fromhex(spec["seccomp"]))
    report_fd = spec["report_fd"]
    os.write(report_fd, json.dumps(report).encode())
    os.close(report_fd)
    os.execve(spec["argv"][0], spec["argv"], spec["env"])


def run_init(spec: dict, uid: int | None, report: dict, status_fd: int, files: dict[str, bytes]) -> None:
    """PID 1 of the sandbox's PID namespace: fork the program, wait, hand its wait status up.

    The program is not PID 1 itself, so signals behave as usual for it (the kernel drops
    default-action signals sent to a namespace's init, SIGXCPU at the soft CPU limit included).
    """
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if report.get("minimal_root"):
        finish_root(spec, 0 if uid is None else uid, files, report)
    elif report.get("pid_namespace") and report.get("mount_namespace"):
        report["private_proc"] = mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    if uid is not None and not report.get("private_tmpfs"):
        for name in [".", *os.listdir(spec["workdir"])]:
            os.chown(os.path.join(spec["workdir"], name), uid, uid)
    program = os.fork()
    if program == 0:
        os.close(status_fd)
        become_program(spec, uid, report)
    os.close(spec["report_fd"])
    _, status = os.waitpid(program, 0)
    while os.WIFSTOPPED(status):  # the program made this process its tracer (PTRACE_TRACEME): it ends here
        os.kill(program, signal.SIGKILL)
        _, status = os.waitpid(program, 0)
    os.write(status_fd, str(status).encode())
    os._exit(0)  # with a PID namespace, this ends every process left in it


def main() -> None:
    spec = json.loads(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # this process re-raises the program's fatal signal
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    report: dict = {"root": os.geteuid() == 0, "memory_rlimit": "RLIMIT_AS" in spec["rlimits"]}
    report["memory_cgroup"] = bool(spec["cgroup_procs"]) and join_cgroup(spec["cgroup_procs"])
    uid, files = None, {}
    if spec["isolate"] and os.geteuid() == 0:
        uid = spec["uid_base"] + os.getpid()
        files = confine(spec, uid, report)
    elif spec["isolate"]:
        report["user_namespace"] = enter_user_namespace()
        if report["user_namespace"]:
            files = confine(spec, 0, report)
    status_r, status_w = os.pipe()
    init = os.fork()
    if init == 0:
        os.close(status_r)
        run_init(spec, uid, report, status_w, files)
    os.close(status_w)
    os.close(spec["report_fd"])
    _, init_status = os.waitpid(init, 0)
    raw = os.read(status_r, 32)
    status = int(raw) if raw else init_status  # no status: init itself was killed
    if os.WIFSIGNALED(status):
        if os.WTERMSIG(status) != signal.SIGKILL:
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
