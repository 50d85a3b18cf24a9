"""The `splitmoe` command line itself: every flag explained, every default shown, a version."""
import argparse
import subprocess
import sys

import pytest

from splitmoe.cli import build_parser
from splitmoe.runtime.version import package_version as version
from tests.support.processes import REPO


def _commands(parser: argparse.ArgumentParser, path=()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _commands(child, (*path, name))


COMMANDS = list(_commands(build_parser()))


@pytest.mark.parametrize("path, parser", COMMANDS, ids=[" ".join(p) or "splitmoe" for p, _ in COMMANDS])
def test_every_flag_has_help_and_its_default_shows(path, parser):
    text = parser.format_help()
    for action in parser._actions:
        if action.dest in ("help", "version") or isinstance(action, argparse._SubParsersAction):
            continue
        assert action.help, f"splitmoe {' '.join(path)} {action.option_strings or action.dest}: no help line"
        if action.nargs != 0 and action.default not in (None, argparse.SUPPRESS):
            shown = parser._get_formatter()._get_help_string(action) % vars(action)
            assert "default" in shown, f"{action.option_strings}: default {action.default!r} not shown"
            assert shown.split("(default")[0].strip() in " ".join(text.split())


@pytest.mark.stack
def test_version():
    out = subprocess.run([sys.executable, "-m", "splitmoe", "--version"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"splitmoe {version()}"
    assert version()[0].isdigit()


def test_serving_defaults_to_the_fast_path_and_tools_to_the_exact_one():
    parser = build_parser()
    assert parser.parse_args(["serve-attention"]).dtype == "bfloat16"
    assert parser.parse_args(["up"]).dtype == "bfloat16"
    assert parser.parse_args(["logits", "m.gguf", "--token-ids", "1", "--out", "o.npy"]).dtype == "float32"
    assert parser.parse_args(["generate", "--prompt", "hi"]).dtype == "float32"
