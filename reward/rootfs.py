"""The sandbox's root filesystem: the allow-list of host paths a sandboxed program can see.

reward/jail.py mounts a fresh tmpfs, binds these paths into it at their own paths, pivots into it
and makes it all read-only; the working directory (a private tmpfs) is the one writable place. The
allow-list is what a Python program needs to run:
- the shared libraries: /lib*, /usr/lib* (directories bound, or the same symlinks where the host
  has symlinks, as on merged-/usr systems);
- the interpreter: its executable (real path) and its installation's lib/ directory (the standard
  library), each bound at its own path, so a build that finds its libpython by an absolute RUNPATH
  still starts; nothing else of the directories above them is there (a python under /root shows
  /root holding only the path down to it);
- /etc/ld.so.cache (where the dynamic loader looks libraries up), and nothing else of /etc;
- /dev/null, zero, full, random, urandom, and the /dev/fd, stdin, stdout, stderr links into /proc;
- /proc: a fresh procfs of the sandbox's own PID namespace (only its processes), where one exists.
No home directory, no /etc/passwd, no /tmp of the host, no repository, no /sys.
"""

import os

LIBRARY_DIRS = ("/lib", "/lib64", "/lib32", "/libx32", "/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32")
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
DEV_LINKS = (("/dev/fd", "/proc/self/fd"), ("/dev/stdin", "/proc/self/fd/0"), ("/dev/stdout", "/proc/self/fd/1"),
             ("/dev/stderr", "/proc/self/fd/2"))
ETC_FILES = ("/etc/ld.so.cache",)


def _covered(path: str, binds: list[str]) -> bool:
    return any(path == b or path.startswith(b.rstrip("/") + "/") for b in binds)


def layout(python: str) -> dict[str, list]:
    """{"binds": host paths bound read-only at the same path, "symlinks": [path, target] pairs} for
    running `python` (the interpreter's real path)."""
    binds: list[str] = []
    symlinks: list[list[str]] = []
    for path in LIBRARY_DIRS:
        if os.path.islink(path):
            symlinks.append([path, os.readlink(path)])
        elif os.path.isdir(path):
            binds.append(path)
    real = os.path.realpath(python)
    stdlib = os.path.join(os.path.dirname(os.path.dirname(real)), "lib")
    for path in (real, stdlib):
        if os.path.exists(path) and not _covered(path, binds):
            binds.append(path)
    binds += [path for path in (*ETC_FILES, *DEVICES) if os.path.exists(path)]
    symlinks += [list(pair) for pair in DEV_LINKS]
    return {"binds": binds, "symlinks": symlinks}
