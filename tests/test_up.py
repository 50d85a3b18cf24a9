"""`splitmoe up` (splitmoe/commands/up.py) and the process supervision under it (splitmoe/supervisor.py).

The end-to-end test runs `splitmoe up` with no model (the trained demo model) and two expert services,
asks it a few questions through the gateway at temperature 0 and checks the answers, then SIGTERMs
`up` and checks that no child is left. The supervisor tests use stand-in children (a few lines
serving grpc health) to cover what real services rarely do on demand: crash while starting, never
get ready, die while running, ignore SIGTERM, or outlive a supervisor killed with SIGKILL.
"""
from __future__ import annotations

import dataclasses
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from splitmoe.cli import build_parser
from splitmoe.commands.up import curl_example
from splitmoe.demo.corpus import WEATHER_TOOL
from splitmoe.local_stack import (
    UpSettings,
    attention_spec,
    connect_host,
    expert_ranges,
    expert_specs,
    gateway_spec,
    split_threads,
)
from splitmoe.runtime.settings import CLUSTER_TOKEN_ENV
from splitmoe.supervisor import GrpcHealthProbe, ServiceFailed, ServiceSpec, Supervisor
from tests.support.processes import free_port

REPO = Path(__file__).resolve().parents[1]

# A stand-in service: grpc health on a port, behaving as argv[2] says.
FAKE_SERVICE = r"""
import signal, sys, time
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from splitmoe.supervisor import die_with_supervisor  # what every `splitmoe` command does first
die_with_supervisor()
port, behaviour = int(sys.argv[1]), sys.argv[2]
print("fake service starting", flush=True)
if behaviour == "crash":
    sys.exit("fake service: cannot open the model file")
if behaviour == "ignore-sigterm":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
servicer = health.HealthServicer()
health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
server.add_insecure_port(f"127.0.0.1:{port}")
server.start()
status = "NOT_SERVING" if behaviour == "never-ready" else "SERVING"  # "" starts as SERVING
servicer.set("", health_pb2.HealthCheckResponse.ServingStatus.Value(status))
time.sleep(1.5 if behaviour == "die-soon" else 3600)
sys.exit(3)
"""

# A supervisor in its own process, so that it can be sent SIGTERM or SIGKILL.
DRIVER = r"""
import sys
from pathlib import Path
from splitmoe.supervisor import GrpcHealthProbe, ServiceSpec, Supervisor
run_dir, port = Path(sys.argv[1]), int(sys.argv[2])
address = f"127.0.0.1:{port}"
spec = ServiceSpec("fake", (sys.executable, "-c", sys.argv[3], str(port), "ok"), address,
                   lambda: GrpcHealthProbe(address))
with Supervisor(run_dir, startup_timeout_s=20) as supervisor:
    supervisor.start_stage([spec])
    print("ready", supervisor.children[0].pid, flush=True)
    supervisor.watch()
print("stopped", flush=True)
"""


def fake_spec(name: str, behaviour: str) -> ServiceSpec:
    port = free_port()
    address = f"127.0.0.1:{port}"
    return ServiceSpec(name, (sys.executable, "-c", FAKE_SERVICE, str(port), behaviour), address,
                       lambda: GrpcHealthProbe(address))


def alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def quiet(line: str) -> None:
    pass


# ---- the plan `up` makes ----

def test_expert_ranges_are_contiguous_even_and_cover_every_expert():
    assert expert_ranges(8, 2) == [(0, 3), (4, 7)]
    assert expert_ranges(128, 3) == [(0, 41), (42, 84), (85, 127)]
    ranges = expert_ranges(60, 7)
    assert [e for a, b in ranges for e in range(a, b + 1)] == list(range(60))
    assert max(b - a for a, b in ranges) - min(b - a for a, b in ranges) <= 1
    with pytest.raises(ValueError, match="more than the model's 8 experts"):
        expert_ranges(8, 9)


def test_threads_are_split_between_expert_services():
    assert split_threads(16, 2) == [8, 8]
    assert split_threads(7, 3) == [3, 2, 2]
    assert split_threads(1, 2) == [1, 1]  # never zero


def test_plan_wires_experts_into_attention_and_attention_into_the_gateway():
    settings = UpSettings(model_path="/m/x.gguf", num_expert_services=2, threads=6, host="0.0.0.0", port=8080,
                          api_key="sekret")
    experts = expert_specs(settings, 8, [5001, 5002])
    parser = build_parser()
    assert [parser.parse_args(s.argv[4:]).experts for s in experts] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [parser.parse_args(s.argv[4:]).threads for s in experts] == [3, 3]
    attention = attention_spec(settings, 5003, [s.address for s in experts])
    assert parser.parse_args(attention.argv[4:]).expert_services == ("127.0.0.1:5001", "127.0.0.1:5002")
    gateway = gateway_spec(settings, 8080, attention.address)
    args = parser.parse_args(gateway.argv[4:])
    assert (args.attention, args.host, args.port) == ("127.0.0.1:5003", "0.0.0.0", 8080)
    assert gateway.address == "http://127.0.0.1:8080"  # what a local client connects to


def test_services_pin_their_threads_pairwise_on_the_cores_they_share(monkeypatch):
    import splitmoe.local_stack as local_stack

    monkeypatch.setattr(local_stack, "usable_cpu_set", lambda: frozenset({4, 5, 6, 7}))
    parser = build_parser()
    settings = UpSettings(model_path="/m/x.gguf", num_expert_services=2, threads=4)
    experts = [parser.parse_args(s.argv[4:]) for s in expert_specs(settings, 8, [5001, 5002])]
    # expert service i's thread j shares a core with the attention service's thread (its first + j)
    assert [(sorted(a.cpus), a.pin_threads) for a in experts] == [([4, 5], True), ([6, 7], True)]
    assert parser.parse_args(attention_spec(settings, 5003, ["127.0.0.1:5001"]).argv[4:]).pin_threads
    assert not parser.parse_args(attention_spec(settings, 5003, []).argv[4:]).pin_threads  # experts in-process
    # more threads than CPUs: the services the CPUs do not cover are left to the scheduler
    over = [parser.parse_args(s.argv[4:]) for s in expert_specs(dataclasses.replace(settings, threads=6), 8, [1, 2])]
    assert [(a.cpus and sorted(a.cpus), a.pin_threads) for a in over] == [([4, 5, 6], True), (None, False)]
    off = dataclasses.replace(settings, pin_threads=False)
    assert not any(parser.parse_args(s.argv[4:]).pin_threads for s in expert_specs(off, 8, [5001, 5002]))
    assert not parser.parse_args(attention_spec(off, 5003, ["127.0.0.1:5001"]).argv[4:]).pin_threads
    assert not parser.parse_args(["up", "--no-pin-threads"]).pin_threads


def test_secrets_reach_the_children_in_their_environment_never_on_a_command_line():
    settings = UpSettings(model_path="/m/x.gguf", api_key="sekret-api-key")
    other = UpSettings(model_path="/m/x.gguf")
    assert len(settings.cluster_token) >= 32 and settings.cluster_token != other.cluster_token  # fresh per run
    specs = [*expert_specs(settings, 8, [5001, 5002]), attention_spec(settings, 5003, ["127.0.0.1:5001"]),
             gateway_spec(settings, 8080, "127.0.0.1:5003")]
    for spec in specs:
        assert spec.env["SPLITMOE_CLUSTER_TOKEN"] == settings.cluster_token, spec.name
        assert not {settings.cluster_token, "sekret-api-key"} & set(spec.argv), spec.name
        assert settings.cluster_token not in repr(spec) + repr(settings)
    assert [s.env.get("SPLITMOE_API_KEY") for s in specs] == [None, None, None, "sekret-api-key"]


@pytest.mark.parametrize("command", ["up", "serve-gateway"])
def test_the_api_key_comes_from_a_file(tmp_path, command):
    from splitmoe.commands.cluster_flags import api_key

    (tmp_path / "key").write_text("from-a-file\n")
    base = ["serve-gateway", "--attention", "h:1"] if command == "serve-gateway" else ["up"]
    parser = build_parser()
    assert api_key(parser.parse_args([*base, "--api-key-file", str(tmp_path / "key")])) == "from-a-file"
    assert api_key(parser.parse_args(base)) is None
    with pytest.raises(ValueError, match="give one"):
        api_key(parser.parse_args([*base, "--api-key-file", str(tmp_path / "key"), "--api-key", "k"]))


def test_up_hands_the_attention_options_to_the_attention_service():
    from splitmoe.commands.up import _settings

    parser = build_parser()
    args = parser.parse_args(["up", "m.gguf", "--dtype", "float32", "--kv-cache-tokens", "999",
                              "--max-batch-tokens", "128", "--served-model-name", "mine", "--local-experts", "2",
                              "--reasoning-format", "none", "--experts-per-token", "4"])
    child = parser.parse_args(attention_spec(_settings(args), 5003, []).argv[4:])
    assert (child.dtype, child.kv_cache_tokens, child.max_batch_tokens, child.served_model_name) == \
        ("float32", 999, 128, "mine")
    assert (child.local_experts, child.reasoning_format, child.experts_per_token) == (2, "none", 4)
    defaults = parser.parse_args(attention_spec(_settings(parser.parse_args(["up", "m.gguf"])), 5003, []).argv[4:])
    assert defaults.dtype == "bfloat16" and defaults.kv_cache_tokens == 16384


def test_no_expert_services_keeps_the_experts_in_the_attention_process():
    spec = attention_spec(UpSettings(model_path="/m/x.gguf", num_expert_services=0), 5003, [])
    assert build_parser().parse_args(spec.argv[4:]).expert_services == ()


def test_connect_host_and_curl_example():
    assert connect_host("0.0.0.0") == "127.0.0.1" and connect_host("::") == "[::1]"
    curl = curl_example("http://127.0.0.1:8000", "demo", "k")
    assert "http://127.0.0.1:8000/v1/chat/completions" in curl and "'Authorization: Bearer k'" in curl
    body = json.loads(re.search(r"-d '(.*)'", curl).group(1))
    assert body["model"] == "demo" and body["messages"][0]["role"] == "user"


# ---- the supervisor, with stand-in children ----

@pytest.mark.stack
def test_stage_waits_for_health_and_leaving_stops_every_child(tmp_path):
    with Supervisor(tmp_path, startup_timeout_s=20, say=quiet) as supervisor:
        supervisor.start_stage([fake_spec("a", "ok"), fake_spec("b", "ok")])
        pids = [c.pid for c in supervisor.children]
        assert all(c.probe.check(1.0) for c in supervisor.children)
        manifest = json.loads((tmp_path / "services.json").read_text())
        assert [s["pid"] for s in manifest["services"]] == pids
    assert wait_gone(pids, 0.5) == []


@pytest.mark.stack
def test_a_child_that_dies_while_starting_is_named_with_its_log_tail(tmp_path):
    with Supervisor(tmp_path, startup_timeout_s=20, say=quiet) as supervisor:
        with pytest.raises(ServiceFailed) as failed:
            supervisor.start_stage([fake_spec("expert-1", "crash")])
    message = str(failed.value)
    assert message.startswith("expert-1 exited with code 1 before it was healthy")
    assert "cannot open the model file" in message and str(tmp_path / "expert-1.log") in message


@pytest.mark.stack
def test_a_child_that_never_gets_healthy_times_out_by_name(tmp_path):
    with Supervisor(tmp_path, startup_timeout_s=1.5, say=quiet) as supervisor:
        with pytest.raises(ServiceFailed, match=r"^attention was not healthy after 1.5 s"):
            supervisor.start_stage([fake_spec("attention", "never-ready")])
        pid = supervisor.children[0].pid
    assert wait_gone([pid], 0.5) == []


@pytest.mark.stack
def test_a_child_that_dies_while_running_stops_the_rest(tmp_path):
    with Supervisor(tmp_path, startup_timeout_s=20, say=quiet) as supervisor:
        supervisor.start_stage([fake_spec("expert-0", "ok")])
        supervisor.start_stage([fake_spec("gateway", "die-soon")])
        with pytest.raises(ServiceFailed, match=r"^gateway exited with code 3 while running"):
            supervisor.watch()
        pids = [c.pid for c in supervisor.children]
    assert wait_gone(pids, 0.5) == []


@pytest.mark.stack
def test_a_child_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path):
    lines: list[str] = []
    with Supervisor(tmp_path, startup_timeout_s=20, stop_grace_s=0.5, say=lines.append) as supervisor:
        supervisor.start_stage([fake_spec("stubborn", "ignore-sigterm")])
        pid = supervisor.children[0].pid
        started = time.monotonic()
    assert time.monotonic() - started < 5 and wait_gone([pid], 0.5) == []
    assert any("stubborn did not stop within 0.5 s; killing it" in line for line in lines)


@pytest.mark.stack
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_no_orphans_when_the_supervisor_itself_is_stopped(tmp_path, sig):
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path), str(free_port()), FAKE_SERVICE],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        child_pid = int(LineReader(driver.stdout).wait_for(r"^ready (\d+)", 20).group(1))
        driver.send_signal(sig)
        driver.wait(15)
        assert wait_gone([child_pid]) == [], f"child {child_pid} outlived a supervisor stopped by {sig.name}"
    finally:
        driver.kill()
        driver.wait()


# ---- `splitmoe up`, end to end ----

def _require_subcommands(*names: str) -> None:
    choices = next(a for a in build_parser()._actions if a.dest == "command").choices
    missing = [n for n in names if n not in choices]
    if missing:
        pytest.skip(f"`splitmoe {', '.join(missing)}` not registered yet in splitmoe/cli.py")


class LineReader:
    """A process's output lines, read on a thread so that waiting for one can time out."""

    def __init__(self, stream):
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout_s: float, give_up=lambda: None) -> re.Match:
        """The first line matching; `give_up` is called while waiting (it may skip or fail the test)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            give_up()
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                continue
            self.seen.append(line)
            if match := re.search(pattern, line):
                return match
        raise AssertionError(f"no line matching {pattern!r} within {timeout_s} s; output:\n{''.join(self.seen)}")


def _skip_if_attention_lacks_remote_experts(run_dir: Path) -> None:
    log = run_dir / "attention.log"
    if log.exists() and "remote expert services are not wired in yet" in log.read_text(errors="replace"):
        pytest.skip("the attention service cannot use remote expert services yet (attention_service/service.py)")


# What `up` with no model answers at temperature 0: the trained demo model (splitmoe/demo/corpus.py),
# its experts on two expert services, in the default serving dtype (bfloat16, quantized kernels).
DEMO_ANSWERS = {
    "What is 7 + 5?": "12",
    "What is 6 * 7?": "42",
    "What is the capital of Japan?": "The capital of Japan is Tokyo.",
    "How many centimeters are in 3 meters?": "300 centimeters",
    "What is the opposite of hot?": "The opposite of hot is cold.",
}


@pytest.mark.stack
def test_up_answers_the_demo_questions_and_sigterm_leaves_no_child(tmp_path):
    _require_subcommands("serve-experts", "serve-gateway")
    httpx = pytest.importorskip("httpx")
    port = free_port()
    # The demo model and the default run directory both go under this cache.
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "splitmoe", "up", "--expert-services", "2", "--port", str(port),
            "--threads", "2", "--startup-timeout-s", "40"]
    up = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = LineReader(up.stdout)
    try:
        run_dir = Path(out.wait_for(r"logs in (\S+)/ ", 30).group(1))
        assert run_dir.is_relative_to(tmp_path / "cache" / "splitmoe" / "runs")
        base_url = out.wait_for(r"SplitMoE is up: (http://\S+)/v1", 50,
                                give_up=lambda: _skip_if_attention_lacks_remote_experts(run_dir)).group(1)
        assert base_url == f"http://127.0.0.1:{port}"
        model_id = out.wait_for(r'"model": "([^"]+)"', 5).group(1)  # from the curl example
        assert httpx.get(f"{base_url}/health", timeout=10).status_code == 200
        for question, answer in DEMO_ANSWERS.items():
            reply = httpx.post(f"{base_url}/v1/chat/completions", timeout=30, json={
                "model": model_id, "messages": [{"role": "user", "content": question}], "temperature": 0})
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"] == answer, question
        # offered a tool, the demo calls it (README)
        reply = httpx.post(f"{base_url}/v1/chat/completions", timeout=30, json={
            "model": model_id, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": [WEATHER_TOOL], "temperature": 0})
        [call] = reply.json()["choices"][0]["message"]["tool_calls"]
        assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("get_weather", {"city": "Paris"})
        services = json.loads((run_dir / "services.json").read_text())["services"]
        assert [s["name"] for s in services] == ["expert-0", "expert-1", "attention", "gateway"]
        # with no address, rebalance and heatmap find this stack and its secret in the run directory
        assert (run_dir / "cluster-token").stat().st_mode & 0o777 == 0o600
        said = []
        for command in (["rebalance", "--dry-run"], ["heatmap", str(tmp_path / "heat.png")]):
            done = subprocess.run([sys.executable, "-m", "splitmoe", *command], cwd=REPO, capture_output=True,
                                  text=True, timeout=60, env={k: v for k, v in env.items() if k != CLUSTER_TOKEN_ENV})
            assert done.returncode == 0, done.stdout + done.stderr
            said.append(done.stdout)
        assert "would rebalance" in said[0] and (tmp_path / "heat.png").read_bytes()[:4] == b"\x89PNG"
        up.send_signal(signal.SIGTERM)
        assert up.wait(30) == 0
        assert wait_gone([s["pid"] for s in services], 1.0) == []
    finally:
        _stop(up)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()  # its children get SIGTERM from the kernel (PR_SET_PDEATHSIG)
            proc.wait()
