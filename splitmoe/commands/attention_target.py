"""The attention service a command acts on: `--attention HOST:PORT` with the cluster flags, or,
with no address, the stack `splitmoe up` started most recently (its address and secret are in its
run directory, splitmoe/run_dirs.py)."""
from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING

from splitmoe.commands.cluster_flags import add_cluster_flags, cluster_security

if TYPE_CHECKING:
    import grpc


def add_attention_target_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--attention", default="", metavar="HOST:PORT",
                   help="the attention service (default: the one of the stack `splitmoe up` started most recently)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="how long the call may take")
    add_cluster_flags(p, serves=False, calls=True)


def attention_channel(args: argparse.Namespace) -> tuple[str, "grpc.Channel"]:
    """(the address, a channel to it carrying the secret)."""
    from splitmoe.run_dirs import latest_run
    from splitmoe.runtime.cluster_auth import read_secret_file

    security = cluster_security(args)
    address = args.attention
    if not address:
        stack = latest_run()
        address = stack.attention_address
        if not security.token and stack.token_file.exists():
            security = dataclasses.replace(security, token=read_secret_file(stack.token_file, "the run's secret"))
    return address, security.channel(address)
