"""The `splitmoe` command: the edge where arguments become settings objects.

Each subcommand lives in its own module under `splitmoe/commands/` and registers itself; modules
import their heavy dependencies inside the command, so `splitmoe serve-gateway` never loads torch.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import traceback

from splitmoe.runtime.settings import log_level
from splitmoe.runtime.version import package_version
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
    "splitmoe.commands.rebalance",
    "splitmoe.commands.heatmap",
    "splitmoe.commands.vram",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitmoe", description="Serve MoE GGUF models split across services.")
    parser.add_argument("--version", action="version", version=f"splitmoe {package_version()}")
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


# What a command's bad input raises (GGUFError is a ValueError): exit 2, as argparse exits for
# bad arguments. Anything else is a fault of ours: exit 1. Either way one line, no traceback,
# unless SPLITMOE_LOG_LEVEL=DEBUG asks for it.
BAD_INPUT = (ValueError, OSError, KeyError)
EXIT_BAD_INPUT, EXIT_FAULT = 2, 1


def main(argv: list[str] | None = None) -> int:
    die_with_supervisor()
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - the process's last word: one line, never a traceback
        debug = log_level() == "DEBUG"
        if debug:
            traceback.print_exc()
        bad_input = isinstance(e, BAD_INPUT)
        what = _one_line(e) if bad_input else f"internal error: {type(e).__name__}: {_one_line(e)}"
        if not bad_input and not debug:
            what += " (SPLITMOE_LOG_LEVEL=DEBUG shows where)"
        print(f"splitmoe {args.command}: error: {what}", file=sys.stderr)
        return EXIT_BAD_INPUT if bad_input else EXIT_FAULT


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__
