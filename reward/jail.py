"""Sandbox launcher: confine this process, fork the untrusted program into it, pass on its exit.

Run by reward/sandbox.py as `python -I -S jail.py SPEC_JSON`; standard library only. As root it
cuts the network (a new network namespace: only a down loopback), makes every mount read-only
in a private mount namespace and mounts a size-capped private tmpfs as the working directory,
starts a PID namespace (when its first process exits, the kernel kills every process left in
it) and drops to an unprivileged uid of its own (uid_base + this pid, unique among live
processes, so RLIMIT_NPROC counts only this sandbox). Without root it first becomes root of a
new user namespace, where the system allows that, and applies the same namespaces and mounts
without the uid drop. The capability bounding set is emptied either way, so the program cannot
undo a mount. Where none of this is permitted, the rlimits, the minimal environment and the
parent-death signal still apply. Just before exec, the program's process writes a JSON report
of which measures took effect to `report_fd`.
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
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 1

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


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


def private_workdir(workdir: str, size_mb: int, uid: int) -> bool:
    """Mount a tmpfs of `size_mb` owned by `uid` over `workdir`, keeping the files already there."""
    files = {}
    for name in os.listdir(workdir):
        with open(os.path.join(workdir, name), "rb") as f:
            files[name] = f.read()
    if not mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size_mb}m,mode=0700,uid={uid},gid={uid}"):
        return False
    for name, data in files.items():
        with open(os.path.join(workdir, name), "wb") as f:
            f.write(data)
        os.chown(os.path.join(workdir, name), uid, uid)
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


def confine(spec: dict, uid: int, report: dict) -> None:
    """Namespaces and mounts, the working directory owned by `uid`; each measure is tried on
    its own and reported."""
    report["network_cut"] = unshare(CLONE_NEWNET)
    report["mount_namespace"] = unshare(CLONE_NEWNS) and mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    if report["mount_namespace"]:
        report["readonly_fs"] = make_all_mounts_readonly()
        report["private_tmpfs"] = private_workdir(spec["workdir"], spec["workdir_mb"], uid)
    if not report.get("private_tmpfs"):
        for name in [".", *os.listdir(spec["workdir"])]:
            os.chown(os.path.join(spec["workdir"], name), uid, uid)
    report["pid_namespace"] = unshare(CLONE_NEWPID)


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
    report_fd = spec["report_fd"]
    os.write(report_fd, json.dumps(report).encode())
    os.close(report_fd)
    os.execve(spec["argv"][0], spec["argv"], spec["env"])


def run_init(spec: dict, uid: int | None, report: dict, status_fd: int) -> None:
    """PID 1 of the sandbox's PID namespace: fork the program, wait, hand its wait status up.

    The program is not PID 1 itself, so signals behave as usual for it (the kernel drops
    default-action signals sent to a namespace's init, SIGXCPU at the soft CPU limit included).
    """
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if report.get("pid_namespace") and report.get("mount_namespace"):
        report["private_proc"] = mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    program = os.fork()
    if program == 0:
        os.close(status_fd)
        become_program(spec, uid, report)
    os.close(spec["report_fd"])
    _, status = os.waitpid(program, 0)
    os.write(status_fd, str(status).encode())
    os._exit(0)  # with a PID namespace, this ends every process left in it


def main() -> None:
    spec = json.loads(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # this process re-raises the program's fatal signal
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    report: dict = {"root": os.geteuid() == 0}
    uid = None
    if spec["isolate"] and os.geteuid() == 0:
        uid = spec["uid_base"] + os.getpid()
        confine(spec, uid, report)
    elif spec["isolate"]:
        report["user_namespace"] = enter_user_namespace()
        if report["user_namespace"]:
            confine(spec, 0, report)
    status_r, status_w = os.pipe()
    init = os.fork()
    if init == 0:
        os.close(status_r)
        run_init(spec, uid, report, status_w)
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
