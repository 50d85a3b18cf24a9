"""The `splitmoe` command: the edge where arguments become settings objects.

Each subcommand lives in its own module under `splitmoe/commands/` and registers itself; modules
import their heavy dependencies inside the command, so `splitmoe serve-gateway` never loads torch.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
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


def version() -> str:
    try:
        return importlib.metadata.version("splitmoe")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitmoe", description="Serve MoE GGUF models split across services.")
    parser.add_argument("--version", action="version", version=f"splitmoe {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    _show_defaults(parser)
    return parser


class _HelpFormatter(argparse.HelpFormatter):
    """Appends each flag's default to its help, unless the help already words it itself or there
    is nothing to show (a switch that is off, an optional argument that is unset)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.nargs == 0 or action.default in (None, "", (), argparse.SUPPRESS):
            return text  # a switch (nargs 0) says what it does when given
        return f"{text} (default: %(default)s)"


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every command's --help shows each flag's default (registered commands need not ask)."""
    parser.formatter_class = _HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in set(action.choices.values()):
                _show_defaults(child)


def main(argv: list[str] | None = None) -> int:
    die_with_supervisor()
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, OSError, KeyError) as e:  # GGUFError is a ValueError: one clear line
        print(f"splitmoe {args.command}: error: {e}", file=sys.stderr)
        return 2
