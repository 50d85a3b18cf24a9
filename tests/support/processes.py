"""Start our services as real processes on loopback ports, and wait until they are healthy.

Every service a test starts holds the same cluster secret (`CLUSTER`), handed over in the
environment as `splitmoe up` does; tests call them through `cluster_channel`, which presents it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitmoe.runtime.cluster_auth import ClusterSecurity
from splitmoe.runtime.settings import CLUSTER_TOKEN_ENV
from splitmoe.supervisor import free_port  # noqa: F401 - the tests pick ports as `splitmoe up` does

REPO = Path(__file__).resolve().parents[2]
CLUSTER = ClusterSecurity(token="tests-cluster-secret-0123456789")


def cluster_channel(address: str) -> grpc.Channel:
    """A channel to one of our services that presents the tests' cluster secret."""
    return CLUSTER.channel(address)


def stranger_channel(address: str, secret: str | None) -> grpc.Channel:
    """A channel without the tests' cluster secret: none (`secret` None) or another one."""
    return grpc.insecure_channel(address) if secret is None else ClusterSecurity(token=secret).channel(address)


def assert_refused_but_probes_pass(channel: grpc.Channel, calls: dict[str, Callable[[], object]]) -> None:
    """Every call (by name) fails UNAUTHENTICATED, and so does health Watch; health Check, which
    probes use without a secret, answers SERVING."""
    health = health_pb2_grpc.HealthStub(channel)
    calls = {**calls, "Health.Watch": lambda: next(health.Watch(health_pb2.HealthCheckRequest(), timeout=10))}
    for name, call in calls.items():
        try:
            call()
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED, f"{name}: {e.code()} {e.details()}"
            assert "cluster secret" in e.details(), name
        else:
            raise AssertionError(f"{name} answered a caller without the cluster secret")
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING




def wait_grpc_serving(address: str, timeout_s: float = 60.0, proc: subprocess.Popen | None = None,
                      security: ClusterSecurity | None = None) -> None:
    """Until health Check says SERVING: asked without the secret, as probes do (a TLS service
    needs `security`'s CA)."""
    deadline = time.monotonic() + timeout_s
    with (security or ClusterSecurity()).channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"service at {address} exited with {proc.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"service at {address} not serving after {timeout_s} s")


def spawn(args: list[str], log_path: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """`extra_env`: secrets the command reads from its environment (never from its command line)."""
    log = open(log_path, "wb")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", CLUSTER_TOKEN_ENV: CLUSTER.token, **(extra_env or {})}
    return subprocess.Popen([sys.executable, "-m", "splitmoe", *args], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, env=env)


def stop(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def grpc_service(args: list[str], port: int, log_path: Path, timeout_s: float = 60.0):
    """A `splitmoe <args>` process serving gRPC health on `port`, stopped on exit."""
    proc = spawn(args, log_path)
    try:
        wait_grpc_serving(f"127.0.0.1:{port}", timeout_s, proc)
        yield proc
    except Exception:
        print(log_path.read_text(errors="replace")[-4000:])
        raise
    finally:
        stop(proc)


def run_splitmoe(*args: str, timeout_s: float = 300) -> str:
    """`splitmoe <args>` to completion; its stdout."""
    done = subprocess.run([sys.executable, "-m", "splitmoe", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s)
    assert done.returncode == 0, done.stderr
    return done.stdout
