"""`splitmoe up`: the whole topology as local processes, on free loopback ports.

N expert services (each an even, contiguous range of the experts across all MoE layers), then the
attention service pointed at them, then the gateway; each stage waits until it is healthy. The
services log into one file each under a run directory (printed at start); the console shows only
what `up` itself says: which service is ready where, the URL and a curl to paste. Ctrl-C or SIGTERM
stops everything; a service that dies is named, its log tail shown, and the rest stopped (exit 1).
The services share a cluster secret (SPLITMOE_CLUSTER_TOKEN if set, else a fresh random one per
run), and the gateway gets the API key, both in their environment: never on a command line.
The plan (which services, ports, arguments) is `splitmoe.local_stack`; the process management
`splitmoe.supervisor`.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from splitmoe.commands.cluster_flags import add_api_key_flags, api_key
from splitmoe.commands.serve_attention import add_serving_options, serving_options_argv
from splitmoe.local_stack import (
    UpSettings,
    attention_spec,
    expert_count_of,
    expert_ranges,
    expert_specs,
    gateway_spec,
    make_run_dir,
    num_expert_services,
)
from splitmoe.run_dirs import record_run
from splitmoe.runtime.settings import new_cluster_token

if TYPE_CHECKING:
    from splitmoe.supervisor import Supervisor

def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start expert services, the attention service and the gateway as local processes")
    p.add_argument("model", nargs="?", help="GGUF file (default: the built-in demo model, trained to answer simple questions)")
    p.add_argument("--expert-services", type=int, default=2, metavar="N",
                   help="expert service processes, each hosting an even share of the experts "
                        "(default 2; 0 keeps the experts in the attention process)")
    p.add_argument("--host", default="127.0.0.1", help="the gateway's address (other services use loopback)")
    p.add_argument("--port", type=int, default=8000, help="the gateway's port (0: any free port)")
    p.add_argument("--numa", action="store_true",
                   help="one expert service per NUMA node, pinned to its CPUs, its pages on its memory, the "
                        "experts split between the nodes (replaces --expert-services; see docs/deploy.md, NUMA)")
    p.add_argument("--threads", type=int, default=0, metavar="T",
                   help="CPU threads split between the expert services (default: the CPUs this process may "
                        "use); the attention service gets T too, as it computes while the experts wait")
    p.add_argument("--no-pin-threads", dest="pin_threads", action="store_false",
                   help="leave the services' threads to the scheduler (default: each service's compute "
                        "threads pinned one to a CPU, in the same order, as they take turns on the cores)")
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
    num_experts = expert_count_of(settings.model_path)
    if num_expert_services(settings, num_experts):  # a bad split fails before anything starts
        expert_ranges(num_experts, num_expert_services(settings, num_experts))
    run_dir = make_run_dir(settings.run_dir)
    record_run(run_dir, settings.cluster_token)  # for `splitmoe rebalance` and `splitmoe heatmap`
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
    from splitmoe.runtime import settings

    model = args.model
    if model is None:
        from splitmoe.demo import trained_model_path

        model = str(trained_model_path())
    return UpSettings(model_path=model, num_expert_services=args.expert_services, host=args.host, port=args.port,
                      threads=args.threads, api_key=api_key(args),
                      attention_options=tuple(serving_options_argv(args)), run_dir=args.run_dir,
                      startup_timeout_s=args.startup_timeout_s, stop_grace_s=args.stop_grace_s, numa=args.numa,
                      pin_threads=args.pin_threads, cluster_token=settings.cluster_token() or new_cluster_token())


def _say(line: str) -> None:
    print(line, flush=True)


def _start(supervisor: Supervisor, settings: UpSettings, num_experts: int) -> None:
    from splitmoe.supervisor import free_port

    expert_ports = [free_port() for _ in range(num_expert_services(settings, num_experts))]
    if expert_ports:
        supervisor.start_stage(expert_specs(settings, num_experts, expert_ports))
    attention = attention_spec(settings, free_port(), [f"127.0.0.1:{p}" for p in expert_ports])
    supervisor.start_stage([attention])
    gateway = gateway_spec(settings, settings.port or free_port(settings.host), attention.address)
    supervisor.start_stage([gateway])
    _say(ready_banner(gateway.address, _served_model(gateway.address, settings), settings.api_key))


def _served_model(base_url: str, settings: UpSettings) -> str:
    """The model id clients must send: what the gateway lists, else the file's stem."""
    from splitmoe.modelfile.gguf_parts import model_stem
    from splitmoe.supervisor import HttpHealthProbe

    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    status, body = HttpHealthProbe(f"{base_url}/v1/models", headers).get(timeout_s=5.0)
    try:
        return json.loads(body)["data"][0]["id"] if status == 200 else model_stem(settings.model_path)
    except (ValueError, KeyError, IndexError, TypeError):
        return model_stem(settings.model_path)


def curl_example(base_url: str, model_id: str, api_key: str | None) -> str:
    body = {"model": model_id, "messages": [{"role": "user", "content": "What is 7 + 5?"}], "max_tokens": 32}
    lines = [f"curl {base_url}/v1/chat/completions", "-H 'Content-Type: application/json'"]
    if api_key:
        lines.append("-H " + shlex.quote(f"Authorization: Bearer {api_key}"))
    lines.append("-d " + shlex.quote(json.dumps(body)))
    return " \\\n    ".join(lines)


def ready_banner(base_url: str, model_id: str, api_key: str | None) -> str:
    return (f"\nSplitMoE is up: {base_url}/v1  (model {model_id!r}; the base URL for OpenAI clients)\n"
            f"Try:\n  {curl_example(base_url, model_id, api_key)}\n"
            f"Ctrl-C stops every service.\n")
