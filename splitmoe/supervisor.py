"""Local child processes for `splitmoe up`: start them in stages, wait until healthy, watch, stop all.

Why it is built this way:
- Every child runs in a session (process group) of its own. A Ctrl-C in the terminal then reaches
  only the supervisor, which stops the children in reverse start order, so the gateway drains its
  requests before the attention service goes away; signalling the group also reaches grandchildren.
- On Linux each child asks the kernel for SIGTERM when the supervisor dies (PR_SET_PDEATHSIG), so
  even `kill -9` of the supervisor leaves no orphans. SIGTERM, SIGINT and SIGHUP stop it cleanly.
- Each child writes to one log file in the run directory. The console keeps only the supervisor's
  own lines (which service is ready, where, the URL); when a service fails, its message names the
  service and quotes the tail of its log.
- Health is the services' own: gRPC `grpc.health.v1` SERVING, or HTTP 200 from a URL. Probes
  ignore proxy variables: they only ever talk to addresses the supervisor chose.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Protocol, Sequence

from splitmoe.runtime import settings

if TYPE_CHECKING:
    from splitmoe.runtime.cluster_auth import ClusterSecurity

POLL_S = 0.2
PROBE_TIMEOUT_S = 1.0
LOG_TAIL_LINES = 25
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Probe(Protocol):
    def check(self, timeout_s: float) -> bool:
        """True when the service reports itself healthy; never raises for an unreachable service."""
        ...

    def close(self) -> None: ...


class GrpcHealthProbe:
    """grpc.health.v1 Check on one address: healthy means SERVING. Check is open to callers
    without the cluster secret (splitmoe.runtime.cluster_auth); a TLS service needs `security`'s CA."""

    def __init__(self, address: str, service: str = "", security: ClusterSecurity | None = None):
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from splitmoe.runtime.cluster_auth import ClusterSecurity

        self._grpc, self._pb, self.service = grpc, health_pb2, service
        # Short reconnect backoff: a service that starts listening late is seen within a second,
        # not after gRPC's default backoff has grown to tens of seconds.
        options = [("grpc.enable_http_proxy", 0), ("grpc.initial_reconnect_backoff_ms", 200),
                   ("grpc.min_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000)]
        self._channel = (security or ClusterSecurity()).channel(address, options)
        self._stub = health_pb2_grpc.HealthStub(self._channel)

    def check(self, timeout_s: float) -> bool:
        try:
            reply = self._stub.Check(self._pb.HealthCheckRequest(service=self.service), timeout=timeout_s)
        except self._grpc.RpcError:
            return False
        return reply.status == self._pb.HealthCheckResponse.SERVING

    def close(self) -> None:
        self._channel.close()


class HttpHealthProbe:
    """GET a URL: healthy means status 200 (the gateway answers 503 while it is not ready)."""

    def __init__(self, url: str, headers: dict[str, str] | None = None):
        self.url, self.headers = url, dict(headers or {})
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def get(self, timeout_s: float, url: str | None = None) -> tuple[int, bytes]:
        """(status, body); status 0 when nothing answered."""
        request = urllib.request.Request(url or self.url, headers=self.headers)
        try:
            with self._opener.open(request, timeout=timeout_s) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as e:
            return e.code, b""
        except (OSError, ValueError):  # refused, reset, timed out, or not HTTP at all
            return 0, b""

    def check(self, timeout_s: float) -> bool:
        return self.get(timeout_s)[0] == 200

    def close(self) -> None:
        pass


def probe_for(target: str, grpc_service: str = "", security: ClusterSecurity | None = None) -> Probe:
    """An http(s):// URL gets an HTTP probe; HOST:PORT a gRPC health probe."""
    if target.startswith(("http://", "https://")):
        return HttpHealthProbe(target)
    if ":" not in target:
        raise ValueError(f"health target must be HOST:PORT or an http(s):// URL, got {target!r}")
    return GrpcHealthProbe(target, grpc_service, security)


_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the child binds it) and not handed out before by this
    process: children started in one wave bind theirs later, and the system may offer the same free
    port twice meanwhile (seen in CI)."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def check_port_free(host: str, port: int) -> None:
    """Fail before starting anything when a fixed port is taken (SO_REUSEADDR, as servers bind)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise OSError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port") from None


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    name: str                      # names the log file and every message about this service
    argv: tuple[str, ...]          # the whole command line
    address: str                   # where it listens, as shown to people
    make_probe: Callable[[], Probe] = field(repr=False)
    detail: str = ""               # one line for the console, e.g. which experts it hosts
    # Added to the child's environment: where its secrets go (argv is visible to every local user
    # and lands in services.json); never printed.
    env: Mapping[str, str] = field(default_factory=dict, repr=False)


def die_with_supervisor() -> None:
    """In a child of `splitmoe up`: ask Linux for SIGTERM when the supervisor dies, even by SIGKILL."""
    parent = settings.die_with_parent_pid()
    if parent is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM))
    if os.getppid() != parent:  # it died before we asked
        raise SystemExit("splitmoe: the supervising `splitmoe up` is gone")


class Child:
    """One started service: its process, log file and health probe."""

    def __init__(self, spec: ServiceSpec, log_path: Path):
        self.spec, self.log_path = spec, log_path
        self.probe = spec.make_probe()
        # No preexec_fn: it makes Python fork() instead of vfork(), and gRPC's at-fork handlers then
        # restart its poller in the child, which dies (SIGABRT) when close_fds closes the poller's
        # fd before exec. The child asks for SIGTERM on our death itself (splitmoe.cli).
        env = settings.child_env(os.getpid(), spec.env)
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(spec.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, env=env)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # the child leads its own group: grandchildren too
        except (ProcessLookupError, PermissionError):
            pass

    def log_tail(self, num_lines: int = LOG_TAIL_LINES) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 16384))
                lines = f.read().decode(errors="replace").splitlines()[-num_lines:]
        except OSError:
            return "    (no log)"
        return "\n".join("    " + line for line in lines) or "    (the log is empty)"

    def close(self) -> None:
        self.probe.close()


class ServiceFailed(Exception):
    """A child died or never became healthy; the message names it and quotes its log."""

    def __init__(self, child: Child, what: str):
        super().__init__(f"{child.name} {what}; last lines of {child.log_path}:\n{child.log_tail()}")
        self.child = child


class StopRequested(Exception):
    """A stop signal arrived (Ctrl-C, SIGTERM, SIGHUP)."""


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


class Supervisor:
    """Starts stages of services, watches them, and stops all of them however it ends.

    Use as a context manager: entering installs the stop-signal handlers, leaving stops every
    child (reverse stage order; terminate, then kill after `stop_grace_s`) and restores them.
    """

    def __init__(self, run_dir: Path, startup_timeout_s: float = 300.0, stop_grace_s: float = 10.0,
                 say: Callable[[str], None] = lambda line: print(line, flush=True)):
        self.run_dir, self.say = run_dir, say
        self.startup_timeout_s, self.stop_grace_s = startup_timeout_s, stop_grace_s
        self.stages: list[list[Child]] = []
        self.num_signals = 0
        self._signals_at_stop = 0
        self._previous_handlers: dict[int, object] = {}

    def __enter__(self) -> "Supervisor":
        for sig in STOP_SIGNALS:
            self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop_all()
        finally:
            for sig, handler in self._previous_handlers.items():
                signal.signal(sig, handler)

    def _on_signal(self, _signum: int, _frame) -> None:
        # Only count here: the loops below act on it, so no exception lands mid-spawn.
        self.num_signals += 1

    @property
    def children(self) -> list[Child]:
        return [c for stage in self.stages for c in stage]

    def start_stage(self, specs: Sequence[ServiceSpec]) -> list[Child]:
        """Start these services together and wait until all are healthy."""
        stage: list[Child] = []
        self.stages.append(stage)
        for spec in specs:
            stage.append(Child(spec, self.run_dir / f"{spec.name}.log"))
            self.write_manifest()
        self._wait_healthy(stage)
        return stage

    def _wait_healthy(self, stage: list[Child]) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        pending = list(stage)
        while pending:
            self._raise_if_stopped_or_dead(still_starting=pending)
            for child in [c for c in pending if c.probe.check(PROBE_TIMEOUT_S)]:
                pending.remove(child)
                self.say(f"  {child.name:<10} ready on {child.spec.address}  (pid {child.pid}{child.spec.detail})")
            if pending and time.monotonic() > deadline:
                raise ServiceFailed(pending[0], f"was not healthy after {self.startup_timeout_s:g} s")
            if pending:
                time.sleep(POLL_S)

    def _raise_if_stopped_or_dead(self, still_starting: Sequence[Child] = ()) -> None:
        if self.num_signals:
            raise StopRequested()
        for child in self.children:
            if (code := child.poll()) is not None:
                when = "before it was healthy" if child in still_starting else "while running"
                raise ServiceFailed(child, f"{describe_exit(code)} {when}")

    def watch(self) -> None:
        """Return on a stop signal; raise ServiceFailed when any child exits."""
        try:
            while True:
                self._raise_if_stopped_or_dead()
                time.sleep(POLL_S)
        except StopRequested:
            return

    def stop_all(self) -> None:
        """Later stages first: the gateway drains before the attention service, then the experts."""
        self._signals_at_stop = self.num_signals
        for stage in reversed(self.stages):
            self._stop_stage(stage)
        for child in self.children:
            child.close()

    def _stop_stage(self, stage: list[Child]) -> None:
        running = [c for c in stage if c.poll() is None]
        for child in running:
            child.signal_group(signal.SIGTERM)
        deadline, why = time.monotonic() + self.stop_grace_s, ""
        while any(c.poll() is None for c in running):
            # One more Ctrl-C (or SIGTERM) while stopping means: do not wait any longer.
            if self.num_signals > self._signals_at_stop:
                why = "asked again to stop"
                break
            if time.monotonic() > deadline:
                why = f"did not stop within {self.stop_grace_s:g} s"
                break
            time.sleep(0.05)
        for child in stage:
            if child.poll() is None:
                self.say(f"  {child.name} {why}; killing it")
            child.signal_group(signal.SIGKILL)  # whatever is left in its group: the child, its children
            child.proc.wait()

    def write_manifest(self) -> None:
        """services.json in the run directory: what runs where, for people and scripts."""
        services = [{"name": c.name, "pid": c.pid, "address": c.spec.address, "log": str(c.log_path),
                     "argv": list(c.spec.argv)} for c in self.children]
        path = self.run_dir / "services.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"supervisor_pid": os.getpid(), "services": services}, indent=2) + "\n")
        tmp.replace(path)
