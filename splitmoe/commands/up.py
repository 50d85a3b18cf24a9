"""`splitmoe up`: the whole topology as local processes, on free loopback ports.

N expert services (each an even, contiguous range of the experts across all MoE layers), then the
attention service pointed at them, then the gateway; each stage waits until it is healthy. The
services log into one file each under a run directory (printed at start); the console shows only
what `up` itself says: which service is ready where, the URL and a curl to paste. Ctrl-C or SIGTERM
stops everything; a service that dies is named, its log tail shown, and the rest stopped (exit 1).
The services share a cluster secret (SPLITMOE_CLUSTER_TOKEN if set, else a fresh random one per
run), and the gateway gets the API key, both in their environment: never on a command line.
The process management itself lives in `splitmoe.supervisor`.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from splitmoe.commands.cluster_flags import add_api_key_flags, api_key
from splitmoe.commands.serve_attention import add_serving_options, serving_options_argv
from splitmoe.settings import new_cluster_token

if TYPE_CHECKING:
    from splitmoe.supervisor import ServiceSpec, Supervisor

CHILD_PREFIX = (sys.executable, "-u", "-m", "splitmoe")  # the same interpreter and install as `up`


@dataclass(frozen=True, slots=True)
class UpSettings:
    model_path: str                    # a GGUF file (the CLI resolves "none given" to the demo model)
    num_expert_services: int = 2       # 0: experts stay inside the attention process
    host: str = "127.0.0.1"            # the gateway's; every other service binds loopback
    port: int = 8000                   # the gateway's; 0 picks a free one
    threads: int = 0                   # split between the expert services; 0: the CPUs we may use
    api_key: str | None = field(default=None, repr=False)
    # Handed to every child in its environment (never on a command line): each run its own
    cluster_token: str = field(default_factory=new_cluster_token, repr=False)
    attention_options: tuple[str, ...] = ()  # serve-attention's serving options, as arguments
    run_dir: str = ""                  # default: <cache>/splitmoe/runs/<time>-<pid>
    startup_timeout_s: float = 300.0   # per stage: loading a large model's shard takes a while
    stop_grace_s: float = 10.0         # per stage, between SIGTERM and SIGKILL

    def __post_init__(self) -> None:
        if self.num_expert_services < 0:
            raise ValueError(f"--expert-services must be >= 0, got {self.num_expert_services}")
        if self.threads < 0:
            raise ValueError(f"--threads must be >= 0, got {self.threads}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must lie in [0, 65535], got {self.port}")
        if self.startup_timeout_s <= 0 or self.stop_grace_s <= 0:
            raise ValueError("--startup-timeout-s and --stop-grace-s must be positive")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start expert services, the attention service and the gateway as local processes")
    p.add_argument("model", nargs="?", help="GGUF file (default: the built-in demo model)")
    p.add_argument("--expert-services", type=int, default=2, metavar="N",
                   help="expert service processes, each hosting an even share of the experts "
                        "(default 2; 0 keeps the experts in the attention process)")
    p.add_argument("--host", default="127.0.0.1", help="the gateway's address (other services use loopback)")
    p.add_argument("--port", type=int, default=8000, help="the gateway's port (0: any free port)")
    p.add_argument("--threads", type=int, default=0, metavar="T",
                   help="CPU threads split between the expert services (default: the CPUs this process may "
                        "use); the attention service gets T too, as it computes while the experts wait")
    add_api_key_flags(p)
    p.add_argument("--run-dir", default="", help="where the services' logs go (default: a new directory "
                                                 "under ~/.cache/splitmoe/runs/)")
    p.add_argument("--startup-timeout-s", type=float, default=300.0,
                   help="how long each stage may take to become healthy")
    p.add_argument("--stop-grace-s", type=float, default=10.0, help="how long a stopping service gets before SIGKILL")
    add_serving_options(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from splitmoe.supervisor import ServiceFailed, StopRequested, Supervisor, check_port_free

    settings = _settings(args)
    if settings.port:
        check_port_free(settings.host, settings.port)
    num_experts = _expert_count(settings.model_path)
    if settings.num_expert_services:
        expert_ranges(num_experts, settings.num_expert_services)  # a bad split fails before anything starts
    run_dir = _make_run_dir(settings.run_dir)
    _say(f"splitmoe up: {Path(settings.model_path).name}, {num_experts} experts per layer; "
         f"logs in {run_dir}/ (tail -f {run_dir}/*.log)")
    with Supervisor(run_dir, settings.startup_timeout_s, settings.stop_grace_s, say=_say) as supervisor:
        try:
            _start(supervisor, settings, num_experts)
            supervisor.watch()
        except StopRequested:
            pass
        except ServiceFailed as e:
            print(f"splitmoe up: {e}\nsplitmoe up: stopping the other services", file=sys.stderr, flush=True)
            return 1
        _say("splitmoe up: stopping")
    _say("splitmoe up: stopped")
    return 0


def _settings(args: argparse.Namespace) -> UpSettings:
    from splitmoe import settings

    model = args.model
    if model is None:
        from splitmoe.demo_model import demo_model_path

        model = str(demo_model_path())
    return UpSettings(model_path=model, num_expert_services=args.expert_services, host=args.host, port=args.port,
                      threads=args.threads, api_key=api_key(args),
                      attention_options=tuple(serving_options_argv(args)), run_dir=args.run_dir,
                      startup_timeout_s=args.startup_timeout_s, stop_grace_s=args.stop_grace_s,
                      cluster_token=settings.cluster_token() or new_cluster_token())


def _expert_count(model_path: str) -> int:
    from splitmoe.modelfile.experts import expert_count
    from splitmoe.modelfile.gguf_file import GGUFFile

    return expert_count(GGUFFile(model_path))


def _make_run_dir(requested: str) -> Path:
    if requested:
        path = Path(requested)
    else:
        from splitmoe.settings import cache_dir

        path = cache_dir() / "runs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)  # logs may quote prompts
    return path.resolve()


def _say(line: str) -> None:
    print(line, flush=True)


# ---- the plan: which services, on which ports, with which arguments (pure; tested directly) ----

def expert_ranges(num_experts: int, num_services: int) -> list[tuple[int, int]]:
    """Contiguous, inclusive expert ranges, as even as integers allow (sizes differ by at most 1)."""
    if num_services > num_experts:
        raise ValueError(f"--expert-services {num_services} is more than the model's {num_experts} experts")
    bounds = [i * num_experts // num_services for i in range(num_services + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(num_services)]


def split_threads(total: int, parts: int) -> list[int]:
    """`total` threads over `parts` processes, at least one each."""
    return [max(1, total // parts + (i < total % parts)) for i in range(parts)]


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))  # respects taskset and container CPU sets
    except AttributeError:
        return os.cpu_count() or 1


def connect_host(host: str) -> str:
    """The address a client on this machine uses to reach a server bound to `host`."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def expert_specs(settings: UpSettings, num_experts: int, ports: list[int]) -> list[ServiceSpec]:
    from splitmoe.supervisor import GrpcHealthProbe, ServiceSpec

    total_threads = settings.threads or usable_cpus()
    ranges = expert_ranges(num_experts, len(ports))
    threads = split_threads(total_threads, len(ports))
    specs = []
    for i, (port, (first, last), num_threads) in enumerate(zip(ports, ranges, threads, strict=True)):
        address = f"127.0.0.1:{port}"
        argv = (*CHILD_PREFIX, "serve-experts", settings.model_path, "--host", "127.0.0.1", "--port", str(port),
                "--experts", f"{first}-{last}", "--threads", str(num_threads))
        specs.append(ServiceSpec(f"expert-{i}", argv, address, lambda a=address: GrpcHealthProbe(a),
                                 detail=f", experts {first}-{last}, {num_threads} thread{'s' * (num_threads != 1)}",
                                 env=cluster_env(settings)))
    return specs


def attention_spec(settings: UpSettings, port: int, expert_addresses: list[str]) -> ServiceSpec:
    from splitmoe.supervisor import GrpcHealthProbe, ServiceSpec

    address = f"127.0.0.1:{port}"
    argv = [*CHILD_PREFIX, "serve-attention", settings.model_path, "--host", "127.0.0.1", "--port", str(port)]
    if expert_addresses:
        argv += ["--expert-services", ",".join(expert_addresses)]
    if settings.threads:
        argv += ["--threads", str(settings.threads)]
    argv += settings.attention_options
    detail = "" if expert_addresses else ", experts in-process"
    return ServiceSpec("attention", tuple(argv), address, lambda: GrpcHealthProbe(address), detail=detail,
                       env=cluster_env(settings))


def gateway_spec(settings: UpSettings, port: int, attention_address: str) -> ServiceSpec:
    from splitmoe.supervisor import HttpHealthProbe, ServiceSpec

    base_url = f"http://{connect_host(settings.host)}:{port}"
    argv = (*CHILD_PREFIX, "serve-gateway", "--attention", attention_address, "--host", settings.host,
            "--port", str(port))
    env = cluster_env(settings)
    if settings.api_key:
        from splitmoe.gateway.settings import ENV_API_KEY

        env[ENV_API_KEY] = settings.api_key
    return ServiceSpec("gateway", argv, base_url, lambda: HttpHealthProbe(f"{base_url}/health"), env=env)


def cluster_env(settings: UpSettings) -> dict[str, str]:
    """What every child finds in its environment: the cluster secret of this run."""
    from splitmoe.settings import CLUSTER_TOKEN_ENV

    return {CLUSTER_TOKEN_ENV: settings.cluster_token}


def _start(supervisor: Supervisor, settings: UpSettings, num_experts: int) -> None:
    from splitmoe.supervisor import free_port

    expert_ports = [free_port() for _ in range(settings.num_expert_services)]
    if expert_ports:
        supervisor.start_stage(expert_specs(settings, num_experts, expert_ports))
    attention = attention_spec(settings, free_port(), [f"127.0.0.1:{p}" for p in expert_ports])
    supervisor.start_stage([attention])
    gateway = gateway_spec(settings, settings.port or free_port(settings.host), attention.address)
    supervisor.start_stage([gateway])
    _say(ready_banner(gateway.address, _served_model(gateway.address, settings), settings.api_key))


def _served_model(base_url: str, settings: UpSettings) -> str:
    """The model id clients must send: what the gateway lists, else the file's stem."""
    from splitmoe.supervisor import HttpHealthProbe

    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    status, body = HttpHealthProbe(f"{base_url}/v1/models", headers).get(timeout_s=5.0)
    try:
        return json.loads(body)["data"][0]["id"] if status == 200 else Path(settings.model_path).stem
    except (ValueError, KeyError, IndexError, TypeError):
        return Path(settings.model_path).stem


def curl_example(base_url: str, model_id: str, api_key: str | None) -> str:
    body = {"model": model_id, "messages": [{"role": "user", "content": "Hello! Who are you?"}], "max_tokens": 32}
    lines = [f"curl {base_url}/v1/chat/completions", "-H 'Content-Type: application/json'"]
    if api_key:
        lines.append("-H " + shlex.quote(f"Authorization: Bearer {api_key}"))
    lines.append("-d " + shlex.quote(json.dumps(body)))
    return " \\\n    ".join(lines)


def ready_banner(base_url: str, model_id: str, api_key: str | None) -> str:
    return (f"\nSplitMoE is up: {base_url}/v1  (model {model_id!r}; the base URL for OpenAI clients)\n"
            f"Try:\n  {curl_example(base_url, model_id, api_key)}\n"
            f"Ctrl-C stops every service.\n")
