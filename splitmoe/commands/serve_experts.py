"""`splitmoe serve-experts`: one expert service hosting a shard of a GGUF file's routed experts."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from splitmoe.commands.cluster_flags import add_cluster_flags, cluster_security

if TYPE_CHECKING:  # heavy imports stay inside the command
    from splitmoe.expert_service.settings import ExpertServiceSettings
    from splitmoe.expert_service.shard import HostedShard


def _index_range(text: str) -> tuple[int, ...]:
    """'4-7' or '5' -> (4, 5, 6, 7) / (5,), inclusive."""
    try:
        first, _, last = text.partition("-")
        lo, hi = int(first), int(last or first)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want A-B or A, got {text!r}") from None
    if lo < 0 or hi < lo:
        raise argparse.ArgumentTypeError(f"{text!r} is an empty or negative range")
    return tuple(range(lo, hi + 1))


def _cpu_list(text: str) -> frozenset[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}, as taskset and docker --cpuset-cpus write it."""
    from splitmoe.runtime.topology import parse_cpu_list

    try:
        return parse_cpu_list(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve-experts", help="host a shard of a GGUF file's routed experts over gRPC")
    p.add_argument("model", help="path to a GGUF file (memory-mapped; only this shard's bytes are read)")
    p.add_argument("--port", type=int, required=True, help="gRPC port")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in a container)")
    p.add_argument("--layers", type=_index_range, help="block indices to host, A-B inclusive (default: all MoE layers)")
    p.add_argument("--experts", type=_index_range, help="expert ids to host, X-Y inclusive (default: all)")
    p.add_argument("--threads", type=int, help="torch threads for the expert kernels")
    pinning = p.add_mutually_exclusive_group()
    pinning.add_argument("--cpus", type=_cpu_list, help="pin the process to these CPUs, e.g. 0-7,16-23")
    pinning.add_argument("--numa-node", type=int, metavar="N",
                         help="pin the process to NUMA node N's CPUs (its pages then land on N's memory); "
                              "--threads defaults to their number")
    p.add_argument("--pin-threads", action="store_true",
                   help="each compute thread on its own CPU, in the order of the CPUs the process may use "
                        "(the hop loop on the first): what `splitmoe up` passes where the services share "
                        "cores with the attention service, which pins its threads in the same order")
    p.add_argument("--unassigned", action="store_true",
                   help="start with no experts; the attention service assigns a shard with LoadShard")
    p.add_argument("--no-doorbell", dest="doorbell", action="store_false",
                   help="no shared-memory fast path: attention services on this host use gRPC too")
    scaling = p.add_argument_group("joining and leaving while the attention service serves (docs/deploy.md, scaling)")
    scaling.add_argument("--join", metavar="ATTENTION_ADDR", default="",
                         help="announce this service to the attention service at host:port (repeated while it "
                              "runs): it is checked, given a share of the experts, then sent hops. Not "
                              "needed where the attention service resolves a name that covers this one: compose's "
                              "`expert`, a Kubernetes headless Service (default: none)")
    scaling.add_argument("--advertise", metavar="HOST:PORT", default="",
                         help="with --join: the address to dial this service at (default: the address the "
                              "attention service sees the announcement come from, and --port)")
    scaling.add_argument("--drain-timeout-s", type=float, default=45.0, metavar="S",
                         help="on SIGTERM: keep answering hops while the attention services move this service's "
                              "experts to others and close their links, for at most this long, then exit "
                              "(a second signal exits at once). Kubernetes' terminationGracePeriodSeconds and "
                              "compose's stop_grace_period must be longer (default: 45)")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus /metrics on --host:PORT: compute seconds (its rate is how busy the "
                        "service is: the autoscaler's signal), hops, hops in progress, open links, hosted pairs "
                        "and bytes, draining; counts only, no secret needed (default: none)")
    add_cluster_flags(p, serves=True, calls=True)
    p.set_defaults(run=cmd_serve_experts)


def cmd_serve_experts(args: argparse.Namespace) -> int:
    from pathlib import Path

    from splitmoe.expert_service.settings import ExpertServiceSettings
    from splitmoe.runtime.settings import otlp_endpoint

    cpus, threads = args.cpus, args.threads
    if args.numa_node is not None:
        from splitmoe.runtime.topology import node_of

        cpus = node_of(args.numa_node).cpus  # ValueError naming the nodes there are
        threads = threads or len(cpus)
    settings = ExpertServiceSettings(
        model_path=Path(args.model), host=args.host, port=args.port, layers=args.layers, experts=args.experts,
        unassigned=args.unassigned, num_threads=threads, cpus=cpus, numa_node=args.numa_node,
        pin_threads=args.pin_threads, drain_timeout_s=args.drain_timeout_s, join=args.join,
        metrics_port=args.metrics_port, advertise=args.advertise,
        otlp_endpoint=otlp_endpoint(), doorbell=args.doorbell, security=cluster_security(args))
    return serve_experts(settings)


def serve_experts(settings: ExpertServiceSettings) -> int:
    """Load the shard, serve until SIGTERM/SIGINT, then drain (the attention services move its
    experts elsewhere first; a second signal cuts that short) and exit 0."""
    import logging
    import signal
    import threading

    from splitmoe.expert_service.server import ExpertServer, describe_shard, memory_line
    from splitmoe.runtime.heap import freeze_startup_heap
    from splitmoe.runtime.settings import setup_logging
    from splitmoe.runtime.telemetry import setup_tracing

    setup_logging()
    _apply_cpu_settings(settings)
    setup_tracing("splitmoe-expert", settings.otlp_endpoint or None)
    hosted = _hosted_shard(settings)
    server = ExpertServer(settings, hosted)
    stop, give_up = threading.Event(), threading.Event()

    def on_signal(*_) -> None:
        (give_up if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    log = logging.getLogger("splitmoe.serve_experts")
    if settings.metrics_port is not None:
        # Before the gRPC port reports SERVING: whoever sees it serving can scrape it too.
        from splitmoe.expert_service.metrics import ExpertMetrics, serve_metrics

        metrics = ExpertMetrics(hosted, server.hops, lambda: server.servicer.draining)
        log.info("metrics on http://%s:%d/metrics", settings.host, serve_metrics(settings.host, settings.metrics_port, metrics))
    port = server.start()
    freeze_startup_heap()  # the loaded shard's objects out of the collector's walks (runtime/heap.py)
    log.info("ready on %s:%d: %s %s; memory: %s", settings.host, port, settings.model_path.name,
             describe_shard(hosted.describe()), memory_line())
    if settings.numa_node is not None:
        _log_numa_placement(log, settings.numa_node)
    announcer = None
    if settings.join:
        from splitmoe.expert_service.join import Announcer

        announcer = Announcer(settings.join, settings.advertised, server.servicer.instance_id, settings.security,
                              lambda: server.servicer.draining)
        announcer.start()
    stop.wait()
    if announcer is not None:
        announcer.stop()
    log.info("draining: asking the attention services to move this service's experts (up to %g s)",
             settings.drain_timeout_s)
    if server.drain(settings.drain_timeout_s, give_up):
        log.info("drained: no attention service sends hops here any more")
    server.stop()
    _exit_now()
    return 0


def _exit_now() -> None:
    """Exit 0 without the interpreter's finalization: nothing is left to write (spans flushed here,
    logs are unbuffered), and finalizing with daemon threads still in native code (gRPC's pollers,
    the doorbell's, torch's pools) aborted once in some thirty drains here ("terminate called
    without an active exception", exit -6): a drained service must exit 0."""
    import logging
    import os

    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()
    logging.shutdown()
    os._exit(0)


def _log_numa_placement(log, node: int) -> None:
    """Where the loaded shard's pages are, as the kernel reports them: pages of the file read
    before this service started (by another process) stay on the node that read them."""
    import logging

    from splitmoe.runtime.topology import memory_by_node

    by_node = memory_by_node()
    total = sum(by_node.values())
    if not total:
        return
    line = ", ".join(f"node {n} {b / 2**20:.0f} MiB" for n, b in sorted(by_node.items()))
    local = by_node.get(node, 0) / total
    log.log(logging.INFO if local >= 0.9 else logging.WARNING,
            "NUMA node %d: %.0f%% of this process's pages are on its memory (%s)", node, 100 * local, line)


def _apply_cpu_settings(settings: ExpertServiceSettings) -> None:
    import torch

    from splitmoe.runtime.topology import pin_process

    if settings.cpus is not None:
        pin_process(settings.cpus)  # before the shard loads: its pages are first touched from there
    if settings.num_threads is not None:
        torch.set_num_threads(settings.num_threads)
    if settings.pin_threads:
        from splitmoe.kernels import native
        from splitmoe.runtime.topology import compute_cpus

        native.pin_compute(compute_cpus(torch.get_num_threads()))


def _hosted_shard(settings: ExpertServiceSettings) -> HostedShard:
    from splitmoe.expert_service.shard import HostedShard
    from splitmoe.kernels.repack_cache import RepackCache
    from splitmoe.modelfile.gguf_file import GGUFFile
    from splitmoe.runtime.settings import repack_cache_dir

    g = GGUFFile(settings.model_path)
    if settings.unassigned:
        return HostedShard(g, layers=(), experts=(), repack_cache=RepackCache(repack_cache_dir()))
    hosted = HostedShard(g, layers=(), repack_cache=RepackCache(repack_cache_dir()))  # read the file's MoE layers first
    layers = hosted.moe_layers if settings.layers is None else [i for i in settings.layers if i in hosted.moe_layers]
    if not layers:
        raise ValueError(f"--layers {settings.layers[0]}-{settings.layers[-1]}: no MoE layer in that range "
                         f"(MoE layers: {list(hosted.moe_layers)})")
    hosted.load(layers, settings.experts if settings.experts is not None else range(hosted.num_experts))
    return hosted
