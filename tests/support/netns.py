"""Test hosts in Linux network namespaces: each reached from the root namespace over its own veth
pair, as another machine on a LAN would be, and cut off at will.

Cutting takes the root end of the pair down: packets to the host are dropped without a reset or an
ICMP error, so a connection open to it goes silent (a partition, not a refused connection), while
a new connection fails at once (no route). Needs root and `ip`; `skip_reason()` says why not.
Names carry a random tag, so parallel runs never clash; `close()` removes what was made.
"""
from __future__ import annotations

import os
import random
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

from tests.support.processes import CLUSTER, CLUSTER_TOKEN_ENV, REPO


def skip_reason() -> str | None:
    """None when namespaces can be made here, else why not (for pytest.skip)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "building network namespaces needs root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"smprobe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class NetnsHost:
    """One namespace with a veth pair to the root namespace: root end `.1`, host end `.2` of a /30."""

    def __init__(self, index: int):
        tag = secrets.token_hex(3)
        self.namespace = f"smt{tag}{index}"
        self.root_dev, self.host_dev = f"sm{tag}{index}r", f"sm{tag}{index}h"  # <= 15 characters
        self.root_ip, self.ip = _free_subnet()
        self._made: list[list[str]] = []
        try:
            self._run("ip", "netns", "add", self.namespace, undo=["ip", "netns", "del", self.namespace])
            self._run("ip", "link", "add", self.root_dev, "type", "veth", "peer", "name", self.host_dev,
                      undo=["ip", "link", "del", self.root_dev])
            self._run("ip", "link", "set", self.host_dev, "netns", self.namespace)
            self._run("ip", "addr", "add", f"{self.root_ip}/30", "dev", self.root_dev)
            self._run("ip", "link", "set", self.root_dev, "up")
            for command in (["ip", "addr", "add", f"{self.ip}/30", "dev", self.host_dev],
                            ["ip", "link", "set", self.host_dev, "up"], ["ip", "link", "set", "lo", "up"]):
                self._run("ip", "netns", "exec", self.namespace, *command)
        except BaseException:
            self.close()
            raise

    def cut(self) -> None:
        self._run("ip", "link", "set", self.root_dev, "down")

    def restore(self) -> None:
        self._run("ip", "link", "set", self.root_dev, "up")

    def spawn(self, args: list[str], log_path: Path) -> subprocess.Popen:
        """`splitmoe <args>` inside the namespace (`ip netns exec` execs it: the pid is Python's),
        holding the tests' cluster secret in its environment."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", CLUSTER_TOKEN_ENV: CLUSTER.token}
        return subprocess.Popen(["ip", "netns", "exec", self.namespace, sys.executable, "-m", "splitmoe", *args],
                                cwd=REPO, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, env=env)

    def close(self) -> None:
        for undo in reversed(self._made):
            subprocess.run(undo, capture_output=True)
        self._made.clear()

    def _run(self, *command: str, undo: list[str] | None = None) -> None:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")
        if undo is not None:
            self._made.append(undo)


def _free_subnet() -> tuple[str, str]:
    """A /30 in 10.200-254.x.y that no interface here uses: (root end, host end)."""
    for _ in range(100):
        base = f"10.{random.randint(200, 254)}.{random.randint(0, 255)}.{random.randrange(0, 256, 4)}"
        prefix, last = base.rsplit(".", 1)
        taken = subprocess.run(["ip", "-o", "addr", "show", "to", f"{base}/30"], capture_output=True, text=True)
        if not taken.stdout.strip():
            return f"{prefix}.{int(last) + 1}", f"{prefix}.{int(last) + 2}"
    raise RuntimeError("no free /30 found in 10.200.0.0/13")
