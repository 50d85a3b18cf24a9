"""`splitmoe up --device cuda`, end to end: the README's first command with attention on the GPU.

As tests/test_up.py does on the CPU: `up` with no model (the trained demo model) and two expert
services on the CPU, one question through the gateway at temperature 0, its answer checked, then
SIGTERM. The attention service's log must say the model was loaded on cuda. Runs where torch sees
a GPU (bench/gpu/run.sh: pytest -m cuda); skips elsewhere.
"""
from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import free_port
from tests.test_up import DEMO_ANSWERS, REPO, LineReader, _stop

pytestmark = [pytest.mark.cuda, pytest.mark.stack]  # `splitmoe up` and its children

QUESTION = "What is 7 + 5?"


def _fail_if_exited(proc: subprocess.Popen, out: LineReader) -> None:
    if proc.poll() is not None:
        rest = []
        while True:
            try:
                rest.append(out.lines.get_nowait())
            except queue.Empty:
                break
        pytest.fail(f"`splitmoe up --device cuda` exited ({proc.returncode}):\n{''.join(out.seen + rest)}")


def test_up_on_cuda_answers_the_demo_question(tmp_path):
    httpx = pytest.importorskip("httpx")
    assert DEMO_ANSWERS[QUESTION] == "12"
    port = free_port()
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "splitmoe", "up", "--device", "cuda", "--expert-services", "2", "--port", str(port),
            "--threads", "2", "--startup-timeout-s", "120"]
    up = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = LineReader(up.stdout)
    exited = lambda: _fail_if_exited(up, out)  # noqa: E731 - a callback for wait_for
    try:
        run_dir = Path(out.wait_for(r"logs in (\S+)/ ", 60, give_up=exited).group(1))
        base_url = out.wait_for(r"SplitMoE is up: (http://\S+)/v1", 180, give_up=exited).group(1)
        assert base_url == f"http://127.0.0.1:{port}"
        model_id = out.wait_for(r'"model": "([^"]+)"', 5).group(1)  # from the curl example
        reply = httpx.post(f"{base_url}/v1/chat/completions", timeout=60, json={
            "model": model_id, "messages": [{"role": "user", "content": QUESTION}], "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == "12"
        attention_log = (run_dir / "attention.log").read_text(errors="replace")
        assert re.search(r"loaded: .* on cuda", attention_log), attention_log[-2000:]
        up.send_signal(signal.SIGTERM)
        assert up.wait(30) == 0
    finally:
        _stop(up)
