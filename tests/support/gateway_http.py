"""`splitmoe serve-gateway` processes for tests, and what tests read from them over HTTP.

A gateway starts in about a second (no torch), so tests may start one per case; the services
behind it are started by the caller (see processes.py and expert_services.py).
"""
from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.processes import free_port, spawn, stop


@dataclass(frozen=True)
class GatewayStack:
    url: str
    attention_port: int
    log_dir: Path


@contextmanager
def gateway_over_attention(model: Path, log_dir: Path, *gateway_args: str,
                           attention_args: tuple[str, ...] = ()) -> Iterator[GatewayStack]:
    """`serve-attention` on `model` (experts in-process; `attention_args` added) and a gateway in front, both healthy."""
    port = free_port()
    attention = spawn(["serve-attention", str(model), "--port", str(port), *attention_args], log_dir / "attention.log")
    try:
        with running_gateway(port, log_dir / "splitmoe.gateway.log", *gateway_args) as url:
            try:
                wait_http(url + "/health", attention, lambda r: r.status_code == 200)
            except Exception:
                print((log_dir / "attention.log").read_text(errors="replace")[-4000:])
                raise
            yield GatewayStack(url, port, log_dir)
    finally:
        stop(attention)


@contextmanager
def running_gateway(attention_port: int, log_path: Path, *args: str) -> Iterator[str]:
    """A gateway in front of 127.0.0.1:`attention_port`, answering HTTP (with any status); yields its URL."""
    port = free_port()
    proc = spawn(["serve-gateway", "--attention", f"127.0.0.1:{attention_port}", "--port", str(port), *args], log_path)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", proc, lambda r: True)
        yield url
    except Exception:
        print(log_path.read_text(errors="replace")[-4000:])
        raise
    finally:
        stop(proc)


def wait_http(url: str, proc: subprocess.Popen | None, until: Callable[[httpx.Response], bool],
              timeout_s: float = 90.0) -> httpx.Response:
    """GET `url` until `until(response)`; fails at once if `proc` (what the answer waits on) exits."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        assert proc is None or proc.poll() is None, f"{url}: {' '.join(proc.args[3:5])} exited with {proc.returncode}"
        try:
            response = httpx.get(url, timeout=2)
            if until(response):
                return response
            last = f"{response.status_code} {response.text[:200]}"
        except httpx.TransportError as e:
            last = repr(e)
        time.sleep(0.05)
    raise TimeoutError(f"{url}: not as expected after {timeout_s} s; last: {last}")


def sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE body, checking OpenAI's framing: one line per event, blank line after."""
    text = response.read().decode()
    assert text.endswith("\n\n"), text[-200:]
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), text[:500]
    return [e[len("data: "):] for e in events]


def sse_chunks(response: httpx.Response) -> list[dict]:
    """The JSON chunks of a stream that ended with [DONE]."""
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def assert_openai_error(response: httpx.Response, status: int, error_type: str) -> dict:
    """OpenAI's error body with `status`, and the request's id as in its header; returns its `error` object."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code", "request_id"} and error["type"] == error_type, error
    assert error["message"] and error["request_id"] == response.headers["x-request-id"], (error, response.headers)
    return error


def metric(metrics_text: str, sample: str) -> float:
    """One sample's value from Prometheus text, e.g. `splitmoe:expert_hops_total{address="h:1"}`."""
    match = re.search(rf"^{re.escape(sample)} (\S+)$", metrics_text, re.MULTILINE)
    assert match, f"{sample} not in /metrics"
    return float(match.group(1))


def samples(metrics_text: str, name: str) -> dict[str, float]:
    """Every sample of one metric, by its label text (`{...}`, or "" when it has none)."""
    pattern = rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$"
    return {labels or "": float(value) for labels, value in re.findall(pattern, metrics_text, re.MULTILINE)}


def wait_until_idle(http: httpx.Client, timeout_s: float = 10.0) -> None:
    """Until the attention service runs and queues nothing, and its scheduler has stopped stepping."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = http.get("/metrics").text
        if metric(text, "splitmoe:num_requests_running") + metric(text, "splitmoe:num_requests_waiting") == 0:
            break
        assert time.monotonic() < deadline, "a generation went on after its client left"
        time.sleep(0.05)
    steps = metric(text, "splitmoe:scheduler_steps_total")
    time.sleep(0.3)
    assert metric(http.get("/metrics").text, "splitmoe:scheduler_steps_total") == steps, "still computing"
