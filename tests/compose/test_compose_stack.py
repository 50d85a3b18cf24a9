"""compose.yaml for real: the image built from a local base, the stack up with 2 expert services,
the official openai client answering through it, then `--scale expert=3` and `--scale expert=1` on
the running stack (no --force-recreate) while streams run: the newcomer serves hops, the leavers
drain, no request fails.

Minutes (the image is built): marked `compose`, run with `python -m pytest -m compose tests/compose`
on a machine with a docker engine; skipped, saying why, otherwise (docs/deploy.md, Docker).
"""
from __future__ import annotations

import http.server
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import pytest

from tests.support.processes import REPO, free_port

pytestmark = [pytest.mark.compose, pytest.mark.stack]
BASE_IMAGE = "splitmoe-base:bookworm"
API_KEY = "compose-test-key-0123456789"
PROJECT = "splitmoe-compose-test"


def compose_command() -> list[str]:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.skip("neither `docker compose` nor `docker-compose` is installed")


def engine_or_skip() -> None:
    if not shutil.which("docker") or subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        pytest.skip("no docker engine answers here (`docker info` fails)")


def local_torch_wheel() -> Path | None:
    """The CPU torch wheel in pip's find-links directories, if this machine keeps one there."""
    config = subprocess.run(["pip", "config", "list"], capture_output=True, text=True).stdout
    dirs = re.findall(r"find-links='([^']+)'", config)
    for folder in dirs:
        found = sorted(Path(folder).glob("torch-2.13.0+cpu-cp311-*.whl"))
        if found:
            return found[0]
    return None


def bridge_ip() -> str:
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "docker0"], capture_output=True, text=True).stdout
    match = re.search(r"inet (\d+\.\d+\.\d+\.\d+)/", out)
    if not match:
        pytest.skip("no docker0 bridge: the build cannot reach a local wheel directory")
    return match.group(1)


def build_image() -> None:
    """The local base (tests/compose/base_image.sh), then the Dockerfile on it; torch from the local
    wheel when there is one (served to the build over HTTP on the docker bridge), else its index."""
    subprocess.run([str(REPO / "tests/compose/base_image.sh"), BASE_IMAGE], check=True, capture_output=True)
    args = ["--build-arg", f"BASE_IMAGE={BASE_IMAGE}"]
    wheel, server = local_torch_wheel(), None
    if wheel is not None:
        ip = bridge_ip()
        handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(wheel.parent))
        server = http.server.ThreadingHTTPServer((ip, 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://{ip}:{server.server_address[1]}/"
        args += ["--build-arg", "TORCH_VERSION=2.13.0+cpu",
                 "--build-arg", f"TORCH_PIP_ARGS=--find-links {url} --trusted-host {ip}"]
    try:
        done = subprocess.run(["docker", "build", *args, "-t", "splitmoe:local", str(REPO)], capture_output=True,
                              text=True, timeout=1800)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "native kernels:" in done.stdout
    finally:
        if server is not None:
            server.shutdown()


class Stack:
    def __init__(self, command: list[str], port: int, project: str = PROJECT, env: dict[str, str] | None = None):
        self.command, self.port, self.project = command, port, project
        self.env = {**os.environ, "GATEWAY_PORT": str(port), "SPLITMOE_API_KEY": API_KEY, **(env or {})}

    def compose(self, *args: str, timeout_s: float = 600) -> str:
        done = subprocess.run([*self.command, "-p", self.project, "-f", str(REPO / "compose.yaml"), *args],
                              env=self.env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout + done.stderr

    def scale(self, num_experts: int) -> str:
        return self.compose("up", "-d", "--no-build", "--scale", f"expert={num_experts}", "gateway")

    def logs(self, service: str) -> str:
        return self.compose("logs", "--no-color", service)

    def hops_by_address(self) -> dict[str, float]:
        import httpx

        text = httpx.get(f"http://127.0.0.1:{self.port}/metrics", headers={"Authorization": f"Bearer {API_KEY}"},
                         timeout=30).text
        return {m.group(1): float(m.group(2))
                for m in re.finditer(r'^splitmoe:expert_hops_total\{address="([^"]+)"\} (\S+)$', text, re.MULTILINE)}


@contextmanager
def running_stack(num_experts: int, project: str = PROJECT, env: dict[str, str] | None = None) -> Iterator[Stack]:
    """The image built, the stack up with `num_experts` expert replicas and healthy; down (volumes too) after."""
    engine_or_skip()
    command = compose_command()
    build_image()
    s = Stack(command, free_port(), project, env)
    try:
        s.scale(num_experts)
        deadline_s = time.monotonic() + 300
        import httpx

        while time.monotonic() < deadline_s:
            try:
                if httpx.get(f"http://127.0.0.1:{s.port}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            raise AssertionError("the stack did not become healthy:\n" + s.logs("attention")[-3000:])
        yield s
    finally:
        subprocess.run([*command, "-p", project, "-f", str(REPO / "compose.yaml"), "down", "-v", "--timeout", "70"],
                       env=s.env, capture_output=True, timeout=300, cwd=REPO)


@pytest.fixture(scope="module")
def stack():
    with running_stack(2) as s:
        yield s


def ask(client, question: str = "What is 7 + 5?") -> str:
    reply = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": question}],
                                           max_tokens=16, temperature=0)
    return reply.choices[0].message.content


def test_scaling_the_running_stack_up_and_down_loses_no_request(stack):
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.port}/v1", api_key=API_KEY, max_retries=0)
    assert ask(client) == "12"
    assert len(stack.hops_by_address()) == 2
    answers, errors, stop = [], [], threading.Event()

    def chat_meanwhile():
        while not stop.is_set():
            try:
                answers.append(ask(client))
            except Exception as e:  # noqa: BLE001 - the test's verdict
                errors.append(e)

    with ThreadPoolExecutor(4) as pool:
        for _ in range(4):
            pool.submit(chat_meanwhile)
        try:
            said = stack.scale(3)
            assert "Recreating" not in said  # nothing restarted: only a replica added
            deadline_s = time.monotonic() + 60
            while time.monotonic() < deadline_s:
                hops = stack.hops_by_address()
                if len(hops) == 3 and all(n > 0 for n in hops.values()):
                    break
                time.sleep(1)
            else:
                raise AssertionError(f"the third replica serves no hops: {stack.hops_by_address()}")
            count_before = len(answers)
            stack.scale(1)
            deadline_s = time.monotonic() + 30
            while len(answers) < count_before + 8 and time.monotonic() < deadline_s:
                time.sleep(0.5)
        finally:
            stop.set()
    assert not errors, errors[:1]
    assert answers and set(answers) == {"12"}
    assert len(stack.hops_by_address()) == 1
    log = stack.logs("attention")  # the drained replicas' containers, and their logs, are gone
    assert len(re.findall(r"expert service \S+ left \(it is draining\)", log)) == 2, log[-3000:]
