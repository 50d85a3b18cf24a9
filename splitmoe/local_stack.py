"""The plan of a local stack: which services, on which ports, with which arguments and environment.

Pure but for reading the model's expert count and making the run directory; `splitmoe up` runs the
plan under the supervisor, and the benchmark starts the same services from it.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from splitmoe.runtime.settings import CLUSTER_TOKEN_ENV, cache_dir, new_cluster_token
from splitmoe.runtime.topology import SYSFS_NODES, NumaNode, read_numa_nodes, usable_cpu_set, usable_cpus

if TYPE_CHECKING:
    from splitmoe.numa_plan import NodeService
    from splitmoe.supervisor import ServiceSpec

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
    numa: bool = False                 # one expert service per NUMA node (num_expert_services unused)
    # Every service's compute threads one to a CPU, in the same order (see `cpu_slices`); the
    # NUMA stack pins each expert service to its node instead.
    pin_threads: bool = True
    sysfs_nodes: str = str(SYSFS_NODES)  # where the NUMA topology is read (tests fake it)

    def __post_init__(self) -> None:
        if self.num_expert_services < 0:
            raise ValueError(f"--expert-services must be >= 0, got {self.num_expert_services}")
        if self.threads < 0:
            raise ValueError(f"--threads must be >= 0, got {self.threads}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must lie in [0, 65535], got {self.port}")
        if self.startup_timeout_s <= 0 or self.stop_grace_s <= 0:
            raise ValueError("--startup-timeout-s and --stop-grace-s must be positive")


def expert_count_of(model_path: str) -> int:
    """Routed experts per layer in the GGUF file: what the expert services split between them."""
    from splitmoe.modelfile.expert_tensors import expert_count
    from splitmoe.modelfile.gguf_file import GGUFFile

    return expert_count(GGUFFile(model_path))


def make_run_dir(requested: str) -> Path:
    """Where the services' logs go: `requested`, else a new directory under the cache's runs/."""
    if requested:
        path = Path(requested)
    else:
        path = cache_dir() / "runs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)  # logs may quote prompts
    return path.resolve()


def expert_ranges(num_experts: int, num_services: int) -> list[tuple[int, int]]:
    """Contiguous, inclusive expert ranges, as even as integers allow (sizes differ by at most 1)."""
    if num_services > num_experts:
        raise ValueError(f"--expert-services {num_services} is more than the model's {num_experts} experts")
    bounds = [i * num_experts // num_services for i in range(num_services + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(num_services)]


def cpu_slices(threads: list[int]) -> list[list[int] | None]:
    """Each expert service's CPUs when the stack pins its threads: consecutive runs of the CPUs we
    may use, as many as its threads, so that its thread j shares a core with the attention
    service's thread (its first CPU's index + j), which pins its own in the same order. The
    services take turns with the attention side on those cores: each handoff then stays on a core,
    with no thread migrating (measured: 5-7% faster decode through the services, 3% slower
    prompts). None for a service the CPUs do not cover (more threads asked than CPUs): it is left
    unpinned."""
    cpus = sorted(usable_cpu_set())
    slices, start = [], 0
    for n in threads:
        slices.append(cpus[start:start + n] if start + n <= len(cpus) else None)
        start += n
    return slices


def split_threads(total: int, parts: int) -> list[int]:
    """`total` threads over `parts` processes, at least one each."""
    return [max(1, total // parts + (i < total % parts)) for i in range(parts)]


def connect_host(host: str) -> str:
    """The address a client on this machine uses to reach a server bound to `host`."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def numa_plan(settings: UpSettings, num_experts: int) -> list[NodeService]:
    """`--numa`'s services; one on the CPUs we may use where no topology is reported."""
    from splitmoe.numa_plan import plan_numa_services

    nodes = read_numa_nodes(Path(settings.sysfs_nodes)) or [NumaNode(0, usable_cpu_set())]
    return plan_numa_services(nodes, num_experts, settings.threads)


def num_expert_services(settings: UpSettings, num_experts: int) -> int:
    return len(numa_plan(settings, num_experts)) if settings.numa else settings.num_expert_services


def expert_specs(settings: UpSettings, num_experts: int, ports: list[int]) -> list[ServiceSpec]:
    from splitmoe.supervisor import GrpcHealthProbe, ServiceSpec

    if settings.numa:
        return numa_expert_specs(settings, num_experts, ports)
    total_threads = settings.threads or usable_cpus()
    ranges = expert_ranges(num_experts, len(ports))
    threads = split_threads(total_threads, len(ports))
    slices = cpu_slices(threads) if settings.pin_threads else [None] * len(ports)
    specs = []
    for i, (port, (first, last), num_threads, cpus) in enumerate(zip(ports, ranges, threads, slices, strict=True)):
        address = f"127.0.0.1:{port}"
        argv = (*CHILD_PREFIX, "serve-experts", settings.model_path, "--host", "127.0.0.1", "--port", str(port),
                "--experts", f"{first}-{last}", "--threads", str(num_threads))
        if cpus is not None:
            argv += ("--cpus", ",".join(map(str, cpus)), "--pin-threads")
        specs.append(ServiceSpec(f"expert-{i}", argv, address, lambda a=address: GrpcHealthProbe(a),
                                 detail=f", experts {first}-{last}, {num_threads} thread{'s' * (num_threads != 1)}",
                                 env=cluster_env(settings)))
    return specs


def numa_expert_specs(settings: UpSettings, num_experts: int, ports: list[int]) -> list[ServiceSpec]:
    """One service per node: `serve-experts --numa-node` pins it there (its pages follow)."""
    from splitmoe.supervisor import GrpcHealthProbe, ServiceSpec

    specs = []
    for port, service in zip(ports, numa_plan(settings, num_experts), strict=True):
        address = f"127.0.0.1:{port}"
        first, last = service.experts
        argv = (*CHILD_PREFIX, "serve-experts", settings.model_path, "--host", "127.0.0.1", "--port", str(port),
                "--experts", f"{first}-{last}", "--threads", str(service.num_threads),
                "--numa-node", str(service.node))
        specs.append(ServiceSpec(f"expert-{service.node}", argv, address, lambda a=address: GrpcHealthProbe(a),
                                 detail=f", NUMA {service.describe()}", env=cluster_env(settings)))
    return specs


def attention_spec(settings: UpSettings, port: int, expert_addresses: list[str]) -> ServiceSpec:
    from splitmoe.supervisor import GrpcHealthProbe, ServiceSpec

    address = f"127.0.0.1:{port}"
    argv = [*CHILD_PREFIX, "serve-attention", settings.model_path, "--host", "127.0.0.1", "--port", str(port)]
    if expert_addresses:
        argv += ["--expert-services", ",".join(expert_addresses)]
    if settings.threads:
        argv += ["--threads", str(settings.threads)]
    if settings.pin_threads and not settings.numa and expert_addresses:  # alone it takes no turns: no gain measured
        argv += ["--pin-threads"]
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
    return {CLUSTER_TOKEN_ENV: settings.cluster_token}


