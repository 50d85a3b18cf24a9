"""Settings of one expert service process, parsed once at the edge (`splitmoe serve-experts`)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from splitmoe.runtime.cluster_auth import ClusterSecurity


@dataclass(frozen=True, slots=True)
class ExpertServiceSettings:
    model_path: Path
    host: str = "127.0.0.1"
    port: int = 50061
    layers: tuple[int, ...] | None = None   # block indices to host (MoE ones among them); None: all
    experts: tuple[int, ...] | None = None  # expert ids to host in each of those layers; None: all
    unassigned: bool = False                # start empty and wait for LoadShard
    num_threads: int | None = None          # torch intra-op threads; None: torch's default
    cpus: frozenset[int] | None = None      # pin the process to these CPUs
    numa_node: int | None = None            # the NUMA node those CPUs are (its memory: where pages land)
    pin_threads: bool = False               # each compute thread on one CPU of the process's, in order
    # Each open Forward stream holds one worker thread for its lifetime; unary RPCs share the rest.
    max_workers: int = 64
    max_message_bytes: int = 1 << 30       # 1 GiB: a long prefill's hidden states in one message
    shutdown_grace_s: float = 5.0
    drain_timeout_s: float = 45.0           # SIGTERM: how long attention services get to move our experts away
    metrics_port: int | None = None         # Prometheus /metrics (how busy: the autoscaler's signal); None: none
    join: str = ""                          # an attention service to announce this one to (host:port)
    advertise: str = ""                     # the address it should dial us at; default: ':port' (our IP as it sees us)
    otlp_endpoint: str = ""                 # OTLP collector for spans; empty: none exported
    doorbell: bool = True                   # offer co-located clients the shared-memory doorbell
    security: ClusterSecurity = ClusterSecurity()  # the secret callers must present; TLS

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port {self.port}: not a TCP port")
        if self.unassigned and (self.layers is not None or self.experts is not None):
            raise ValueError("--unassigned takes no --layers/--experts: the placement assigns the shard")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"--threads {self.num_threads}: must be at least 1")
        if self.cpus is not None and not self.cpus:
            raise ValueError("--cpus is empty")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"--metrics-port {self.metrics_port}: not a TCP port")
        if self.drain_timeout_s < 0:
            raise ValueError(f"--drain-timeout-s {self.drain_timeout_s:g}: must not be negative")
        if self.advertise and not self.join:
            raise ValueError("--advertise names the address to announce: give --join too")
        if self.max_workers < 2:
            raise ValueError("max_workers must leave room for a stream and a unary call")
        self.security.check_listen(self.host)

    @property
    def advertised(self) -> str:
        """What --join announces: --advertise, else ':port' (the attention service fills in our IP)."""
        return self.advertise or f":{self.port}"

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # IPv6 literal
        return f"{host}:{self.port}"
