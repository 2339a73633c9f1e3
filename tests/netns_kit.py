"""Hosts on one machine for tests: network namespaces joined through a bridge, each with its own address.

    hub namespace: a bridge; each host namespace: lo + one veth to the bridge, 10.X.Y.n/24

Nothing touches the machine's own network namespace: the veth pairs are created straight inside the namespaces,
and traffic flows only between them. `cut(host)` sets a host's link down (`ip link set DEV down`), `restore`
brings it back. Processes are started inside a host with `spawn` (`ip netns exec` execs, so the pid is the
program's own) and are killed by pid at `close()`, then whatever else still runs in the namespaces (children the
programs started), then the namespaces are deleted.
"""

import os
import pathlib
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent


def available() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"rrlprobe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    """Namespaces named `<prefix><host>` (unique per instance), one address each on a private /24."""

    def __init__(self, names: Sequence[str]):
        tag = secrets.token_hex(3)
        self.prefix = f"rrl{tag}"
        subnet = f"10.{200 + int(tag[:2], 16) % 50}.{int(tag[2:4], 16)}"
        self.hub = f"{self.prefix}hub"
        self.namespaces: dict[str, str] = {}
        self.addresses: dict[str, str] = {}
        self.links: dict[str, str] = {}
        self.procs: list[subprocess.Popen] = []
        try:
            _ip("netns", "add", self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for index, name in enumerate(names, start=1):
                self._add_host(name, f"{subnet}.{index}")
        except BaseException:
            self.close()
            raise

    def _add_host(self, name: str, address: str) -> None:
        ns, dev, peer = f"{self.prefix}{name}", f"eth{name}"[:15], f"p{self.prefix[3:]}{name}"[:15]
        _ip("netns", "add", ns)
        self.namespaces[name] = ns
        _ip("-n", ns, "link", "add", dev, "type", "veth", "peer", "name", peer, "netns", self.hub)
        _ip("-n", self.hub, "link", "set", peer, "master", "br0")
        _ip("-n", self.hub, "link", "set", peer, "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", dev)
        _ip("-n", ns, "link", "set", dev, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        self.addresses[name], self.links[name] = address, dev

    def exec_args(self, host: str, args: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[host], *args]

    def spawn(self, host: str, args: Sequence[str], log_path: pathlib.Path,
              env: Mapping[str, str] | None = None) -> subprocess.Popen:
        """`python ARGS` inside `host`, logging to `log_path`; killed at close()."""
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                     "PYTHONPATH": str(ROOT), **(env or {})}
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(self.exec_args(host, [sys.executable, *args]), stdout=log,
                                    stderr=subprocess.STDOUT, env=child_env, cwd=ROOT)
        self.procs.append(proc)
        return proc

    def run(self, host: str, args: Sequence[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
        """`python ARGS` inside `host`, to its end."""
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        return subprocess.run(self.exec_args(host, [sys.executable, *args]), capture_output=True, text=True,
                              timeout=timeout, env=env, cwd=ROOT, check=False)

    def cut(self, host: str) -> None:
        _ip("-n", self.namespaces[host], "link", "set", self.links[host], "down")

    def restore(self, host: str) -> None:
        _ip("-n", self.namespaces[host], "link", "set", self.links[host], "up")

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for ns in [*self.namespaces.values(), self.hub]:
            self._kill_rest(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)

    @staticmethod
    def _kill_rest(ns: str) -> None:
        """SIGKILL what still runs in `ns`: only processes this kit's programs started can be there."""
        listed = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False)
        for pid in listed.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
