"""`splitmoe serve-experts` processes for tests: started together, killed or restarted by name.

Starting a service is mostly importing torch, so a test module starts all it needs in one wave.
"""
from __future__ import annotations

import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from splitmoe.attention_service.expert_backends.remote import RemoteExperts, RemoteExpertsSettings
from tests.support.processes import CLUSTER, free_port, spawn, wait_grpc_serving

# Short timeouts for tests: a dead service is noticed in a fraction of a second.
FAST_SETTINGS = dict(connect_timeout_s=0.5, reconnect_interval_s=0.2, startup_wait_s=60.0, security=CLUSTER)


class ExpertServices:
    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs, self.args, self.ports, self.hosts = {}, {}, {}, {}

    def start(self, name: str, model: Path, *args: str, host: str = "127.0.0.1", port: int = 0) -> str:
        """Spawn without waiting (see `wait`); returns the address. `host`: another loopback
        address (127.0.0.2, ...) lets services share one port, as replicas behind one name do."""
        self.ports[name], self.hosts[name] = port or free_port(), host
        self.args[name] = ["serve-experts", str(model), "--host", host, "--port", str(self.ports[name]),
                           "--threads", "1", *args]
        self.procs[name] = spawn(self.args[name], self.log_dir / f"{name}.log")
        return self.address(name)

    def address(self, name: str) -> str:
        return f"{self.hosts[name]}:{self.ports[name]}"

    def wait(self, timeout_s: float = 90.0, names: tuple[str, ...] = ()) -> None:
        for name in names or tuple(self.procs):
            wait_grpc_serving(self.address(name), timeout_s, self.procs[name])

    def kill(self, name: str) -> None:
        """kill -9: no goodbye on any stream."""
        self.procs[name].kill()
        self.procs[name].wait()

    def pause(self, name: str) -> None:
        """SIGSTOP: connections stay open, nothing is answered (a hung service).

        kill() only queues the signal: wait until the kernel shows every thread stopped, so that a
        hop sent next cannot be answered by a thread that had not stopped yet.
        """
        proc = self.procs[name]
        proc.send_signal(signal.SIGSTOP)
        task_dir = Path(f"/proc/{proc.pid}/task")
        deadline_s = time.monotonic() + 5
        while time.monotonic() < deadline_s:
            states = [_task_state(t) for t in task_dir.iterdir()] if task_dir.exists() else []
            if states and all(state in "Tt" for state in states):
                return
            time.sleep(0.005)

    def resume(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGCONT)

    def restart(self, name: str, timeout_s: float = 90.0) -> None:
        """The same command on the same port."""
        self.procs[name] = spawn(self.args[name], self.log_dir / f"{name}-restarted.log")
        wait_grpc_serving(self.address(name), timeout_s, self.procs[name])

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _task_state(task: Path) -> str:
    try:
        # "pid (comm) S ...": the state follows the last ')' (comm may hold spaces or parens).
        return (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "T"  # the thread is gone: nothing there to answer


@contextmanager
def remote_experts(g, *addresses: str, **settings) -> Iterator[RemoteExperts]:
    """A RemoteExperts backend over `addresses` with FAST_SETTINGS (overridden by `settings`), closed after."""
    backend = RemoteExperts(g, RemoteExpertsSettings(addresses=tuple(addresses), **{**FAST_SETTINGS, **settings}))
    try:
        yield backend
    finally:
        backend.close()
