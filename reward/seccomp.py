"""The sandbox's seccomp filter: a small classic-BPF program, built here, installed by reward/jail.py.

What a program in the sandbox has no business doing fails with EPERM: opening any socket but an
AF_UNIX one (asyncio and multiprocessing use socketpairs), ptrace and reading or writing other
processes' memory, new namespaces (unshare, setns, clone with a CLONE_NEW* flag), mounts and
root changes, loading kernel code (modules, kexec, bpf), keyrings, io_uring, perf events,
handle-based opens that bypass paths, clock and host settings, and the like. clone3 answers ENOSYS,
so the C library falls back to clone, whose flags the filter can read. A syscall of another ABI
(32-bit int 0x80, x32) kills the process: the table below would not describe it.

The filter is built in the trusted process and travels to the launcher as bytes, so the launcher
stays a short standard-library script; `filter_program()` is None on an architecture without a table.
"""

import errno
import os
import struct

# seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6] (little-endian: low word first).
_NR, _ARCH, _ARG0 = 0, 4, 16
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
RET_ALLOW, RET_KILL_PROCESS, RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
AF_UNIX = 1
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET, and CLONE_NEWTIME.
CLONE_NEW_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80

DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "unshare", "setns",
    "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount",
    "open_tree", "mount_setattr", "open_by_handle_at", "name_to_handle_at", "lookup_dcookie",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "uselib",
    "reboot", "swapon", "swapoff", "acct", "quotactl", "syslog", "vhangup", "iopl", "ioperm",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname", "setdomainname",
)

# Syscall numbers (from the kernel's asm/unistd_64.h and asm-generic/unistd.h), and the audit arch.
_TABLES: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (0xC000003E, {
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "pidfd_getfd": 438,
        "unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
        "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "move_mount": 429, "open_tree": 428,
        "mount_setattr": 442, "open_by_handle_at": 304, "name_to_handle_at": 303, "lookup_dcookie": 212,
        "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426,
        "io_uring_register": 427, "keyctl": 250, "add_key": 248, "request_key": 249, "kexec_load": 246,
        "kexec_file_load": 320, "init_module": 175, "finit_module": 313, "delete_module": 176, "uselib": 134,
        "reboot": 169, "swapon": 167, "swapoff": 168, "acct": 163, "quotactl": 179, "syslog": 103,
        "vhangup": 153, "iopl": 172, "ioperm": 173, "settimeofday": 164, "clock_settime": 227,
        "clock_adjtime": 305, "adjtimex": 159, "sethostname": 170, "setdomainname": 171,
        "socket": 41, "clone": 56, "clone3": 435,
    }),
    "aarch64": (0xC00000B7, {
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272, "pidfd_getfd": 438,
        "unshare": 97, "setns": 268, "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51,
        "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "move_mount": 429, "open_tree": 428,
        "mount_setattr": 442, "open_by_handle_at": 265, "name_to_handle_at": 264, "lookup_dcookie": 18,
        "bpf": 280, "perf_event_open": 241, "userfaultfd": 282, "io_uring_setup": 425, "io_uring_enter": 426,
        "io_uring_register": 427, "keyctl": 219, "add_key": 217, "request_key": 218, "kexec_load": 104,
        "kexec_file_load": 294, "init_module": 105, "finit_module": 273, "delete_module": 106,
        "reboot": 142, "swapon": 224, "swapoff": 225, "acct": 89, "quotactl": 60, "syslog": 116,
        "vhangup": 58, "settimeofday": 170, "clock_settime": 112, "clock_adjtime": 266, "adjtimex": 171,
        "sethostname": 161, "setdomainname": 162,
        "socket": 198, "clone": 220, "clone3": 435,
    }),
}
_X32_SYSCALL_BIT = 0x40000000


def syscall_table(machine: str) -> dict[str, int] | None:
    """Syscall numbers of `machine` (os.uname().machine), None when this module has no table for it."""
    entry = _TABLES.get(machine)
    return entry[1] if entry else None


def _assemble(program: list[tuple]) -> bytes:
    """(op, k) statements, (op, k, true_label, false_label) jumps (None: the next instruction) and
    ("label", name) marks -> sock_filter array. Classic BPF jumps only forward."""
    labels, position = {}, 0
    for item in program:
        if item[0] == "label":
            labels[item[1]] = position
        else:
            position += 1
    out, position = [], 0
    for item in program:
        if item[0] == "label":
            continue
        position += 1
        if len(item) == 2:
            out.append(struct.pack("=HBBI", item[0], 0, 0, item[1]))
        else:
            op, k, true, false = item
            offsets = [0 if t is None else labels[t] - position for t in (true, false)]
            if not all(0 <= o <= 255 for o in offsets):
                raise ValueError(f"seccomp jump out of range: {offsets}")
            out.append(struct.pack("=HBBI", op, offsets[0], offsets[1], k))
    return b"".join(out)


def filter_program(machine: str | None = None) -> bytes | None:
    """The filter for `machine` (default: this one) as packed `struct sock_filter`s."""
    machine = machine or os.uname().machine
    if machine not in _TABLES:
        return None
    arch, numbers = _TABLES[machine]
    program: list[tuple] = [(_LD_ABS, _ARCH), (_JEQ, arch, None, "kill"), (_LD_ABS, _NR)]
    if machine == "x86_64":
        program.append((_JGE, _X32_SYSCALL_BIT, "kill", None))
    program += [(_JEQ, numbers[name], "deny", None) for name in DENIED if name in numbers]
    program += [
        (_JEQ, numbers["socket"], "socket", None),
        (_JEQ, numbers["clone"], "clone", None),
        (_JEQ, numbers["clone3"], "enosys", None),
        (_RET, RET_ALLOW),
        ("label", "socket"), (_LD_ABS, _ARG0), (_JEQ, AF_UNIX, None, "deny"), (_RET, RET_ALLOW),
        ("label", "clone"), (_LD_ABS, _ARG0), (_JSET, CLONE_NEW_FLAGS, "deny", None), (_RET, RET_ALLOW),
        ("label", "deny"), (_RET, RET_ERRNO | errno.EPERM),
        ("label", "enosys"), (_RET, RET_ERRNO | errno.ENOSYS),
        ("label", "kill"), (_RET, RET_KILL_PROCESS),
    ]
    return _assemble(program)
