"""The `splitmoe` command: the edge where arguments become settings objects.

Each subcommand lives in its own module under `splitmoe/commands/` and registers itself; modules
import their heavy dependencies inside the command, so `splitmoe serve-gateway` never loads torch.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from splitmoe.supervisor import die_with_supervisor

COMMAND_MODULES = (
    "splitmoe.commands.model",
    "splitmoe.commands.serve_experts",
    "splitmoe.commands.serve_gateway",
    "splitmoe.commands.serve_attention",
    "splitmoe.commands.up",
    "splitmoe.commands.healthcheck",
    "splitmoe.commands.cluster_token",
    "splitmoe.commands.bench",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitmoe", description="Serve MoE GGUF models split across services.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    die_with_supervisor()
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, OSError, KeyError) as e:  # GGUFError is a ValueError: one clear line
        print(f"splitmoe {args.command}: error: {e}", file=sys.stderr)
        return 2
