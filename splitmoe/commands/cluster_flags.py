"""The security flags commands share: the cluster secret and TLS of every command that serves or
calls a gRPC service, and the gateway's API key.

The cluster secret never appears on a command line (other local users read command lines in
`ps`): it comes from a file or from the environment (SPLITMOE_CLUSTER_TOKEN); so may the API key.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitmoe.runtime.cluster_auth import ClusterSecurity


def add_cluster_flags(p: argparse.ArgumentParser, serves: bool, calls: bool) -> None:
    """serves: the process is a gRPC server; calls: it calls one (both, for the attention service)."""
    g = p.add_argument_group("cluster security (see docs/operate.md, trust model)")
    g.add_argument("--cluster-token-file", type=Path, metavar="PATH",
                   help="file holding the cluster secret that every RPC between the services carries "
                        "(default: $SPLITMOE_CLUSTER_TOKEN; none: " +
                        ("this service may listen on loopback only)" if serves else "calls carry no secret)"))
    roles = []
    if serves:
        roles.append("the certificate this service serves TLS with (its gRPC port then takes TLS only)")
    if calls:
        roles.append("presented as client certificate to TLS services that require one")
    g.add_argument("--tls-cert", type=Path, metavar="PEM", help="; ".join(roles) + " (with --tls-key)")
    g.add_argument("--tls-key", type=Path, metavar="PEM", help="the private key of --tls-cert")
    uses = []
    if calls:
        uses.append("calls go over TLS, verifying the server's certificate against this CA")
    if serves:
        uses.append("callers must present a client certificate it signed")
    g.add_argument("--tls-ca", type=Path, metavar="PEM", help="the cluster's CA certificate: " + "; ".join(uses))


def cluster_security(args: argparse.Namespace) -> ClusterSecurity:
    from splitmoe.runtime import settings
    from splitmoe.runtime.cluster_auth import ClusterSecurity

    return ClusterSecurity.load(settings.cluster_token(), args.cluster_token_file, args.tls_cert, args.tls_key,
                                args.tls_ca)


def add_api_key_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key-file", type=Path, metavar="PATH",
                   help="require `Authorization: Bearer KEY` on the gateway's /v1/*, KEY read from this file "
                        "(default: $SPLITMOE_API_KEY, else no key)")
    p.add_argument("--api-key", default=None,
                   help="the key itself, as llama-server takes it; other local users can read command lines "
                        "(`ps`): prefer --api-key-file or $SPLITMOE_API_KEY")


def api_key(args: argparse.Namespace) -> str | None:
    """The key of --api-key-file or --api-key; None: neither given."""
    from splitmoe.runtime.cluster_auth import read_secret_file

    if args.api_key_file is None:
        return args.api_key
    if args.api_key is not None:
        raise ValueError("--api-key and --api-key-file: give one")
    return read_secret_file(args.api_key_file, "--api-key-file")
