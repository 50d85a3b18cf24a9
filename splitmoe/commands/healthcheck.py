"""`splitmoe healthcheck TARGET`: exit 0 when a service is healthy, 1 when not (container healthchecks).

TARGET is HOST:PORT for a gRPC service (standard grpc.health.v1: healthy means SERVING; Check needs
no cluster secret, a TLS service needs --tls-ca) or an http(s):// URL that must answer 200 (the
gateway's /health). Imports no torch: it runs every few seconds inside each container.
"""
from __future__ import annotations

import argparse

from splitmoe.commands.cluster_flags import add_cluster_flags, cluster_security


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("healthcheck", help="exit 0 when a gRPC (HOST:PORT) or HTTP (URL) service is healthy")
    p.add_argument("target", help="HOST:PORT of a gRPC service, or an http(s):// URL that must answer 200")
    p.add_argument("--service", default="", help="gRPC health service name (default: the whole server)")
    p.add_argument("--timeout-s", type=float, default=3.0, help="how long the check may take")
    add_cluster_flags(p, serves=False, calls=True)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from splitmoe.supervisor import probe_for

    try:
        probe = probe_for(args.target, args.service, cluster_security(args))
    except ValueError as e:
        print(f"splitmoe healthcheck: {e}")
        return 1  # Docker reserves exit code 2; anything but 0 means unhealthy
    try:
        healthy = probe.check(args.timeout_s)
    finally:
        probe.close()
    print(f"{args.target}: {'healthy' if healthy else 'not healthy'}")
    return 0 if healthy else 1
