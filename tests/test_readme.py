"""The README and docs/ as a new user reads them: the set-up commands and the examples work as printed, and
every link between them lands on a file and a heading that exist."""
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from splitmoe.cli import build_parser
from splitmoe.commands.serve_attention import SERVING_OPTIONS
from splitmoe.kernels.quants import supported_types
from tests.support.processes import REPO

README = (REPO / "README.md").read_text()
DOCS = {path: path.read_text() for path in sorted((REPO / "docs").glob("*.md"))}
TEXTS = {REPO / "README.md": README, **DOCS}
README_BLOCKS = re.findall(r"```bash\n(.*?)```", README, re.S)
# every bash block a reader may copy: the README's first, then docs/'s
BLOCKS = [block for text in TEXTS.values() for block in re.findall(r"```bash\n(.*?)```", text, re.S)]


def commands(block: str) -> list[list[str]]:
    """The block's commands, continuation lines joined, comments and blank lines dropped."""
    text = re.sub(r"\\\n\s*", " ", block)
    return [shlex.split(line) for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_exactly_two_setup_commands_on_top_and_ci_runs_the_second():
    first = commands(README_BLOCKS[0])
    assert [" ".join(c) for c in first] == [
        "pip install torch==2.13.0 -e . && splitmoe up",
        "pip install torch==2.13.0 -e .[test] && python -m pytest -q",  # shlex took the quotes off
    ]
    ci = (REPO / ".ci" / "run").read_text()
    assert "pip install --quiet torch==2.13.0 -e '.[test]'" in ci and "python -m pytest -q" in ci


def test_every_splitmoe_command_in_the_readme_and_docs_parses():
    assert len(BLOCKS) > len(README_BLOCKS) >= 2  # docs/ was read
    parser = build_parser()
    for block in BLOCKS:
        for argv in commands(block):
            if argv[:1] == ["splitmoe"]:
                try:
                    parser.parse_args(argv[1:])
                except SystemExit:
                    pytest.fail(f"README or docs/: `{' '.join(argv)}` does not parse")


def test_the_attention_flag_table_names_every_serving_option():
    deploy = DOCS[REPO / "docs" / "deploy.md"]
    table = deploy.split("| attention flag | meaning |", 1)[1].split("\n\n", 1)[0]
    for flag, _ in SERVING_OPTIONS:
        assert f"`{flag}" in table, f"docs/deploy.md's attention flag table lacks {flag}"


@pytest.mark.stack
def test_the_single_process_examples_run_on_the_demo_model(demo_gguf, tmp_path):
    block = next(b for b in BLOCKS if "splitmoe logits" in b)
    ran = []
    for argv in commands(block):
        argv = [str(demo_gguf) if a == "MODEL.gguf" else a for a in argv]
        done = subprocess.run([sys.executable, "-m", "splitmoe", *argv[1:]], cwd=tmp_path, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, f"{' '.join(argv)}: {done.stderr[-2000:]}"
        ran.append(argv[1])
    assert ran == ["logits", "generate"]
    logits = np.load(tmp_path / "logits.npy")
    assert logits.shape[0] == 3 and np.isfinite(logits).all()


def test_the_curl_example_names_the_demo_models_served_name(tmp_path):
    from splitmoe.demo import trained_model_path

    model = re.search(r'"model": "([^"]+)"', README_BLOCKS[1]).group(1)
    assert model == trained_model_path().stem  # what `up` serves it as


def layout_names() -> list[tuple[str, str]]:
    """(top-level folder, name) for every file or folder the layout section names."""
    section = README.split("## Layout: the data path by file name", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```\n(.*?)```", section, re.S).group(1)
    names, top = [], None
    for line in block.splitlines():
        if not line.startswith(" "):
            top = line.split()[0].rstrip("/")
        for name in re.findall(r"[\w./]*\w\.(?:py|proto|md)\b|\b\w+/", line):
            names.append((top, name))
    return names


def test_every_path_in_the_layout_exists():
    names = layout_names()
    assert len(names) > 80 and {top for top, _ in names} >= {"gateway", "attention_service", "expert_service"}
    missing = []
    for top, name in names:
        under = [p.relative_to(REPO).as_posix() + ("/" if p.is_dir() else "") for p in (REPO / top).rglob("*")]
        if not (REPO / name).exists() and not any(f"/{path}".endswith(f"/{name}") for path in under):
            missing.append(f"{top}: {name}")
    assert not missing


def test_the_tensor_type_list_names_every_supported_type():
    listed = re.search(r"Tensor types: ([A-Z0-9_,\s]+)\.", README)[1]
    names = {name.strip() for name in listed.split(",")}
    assert names == {T(t).name for t in supported_types()}


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(text: str) -> set[str]:
    """The anchors of a Markdown file's headings (a '#' line inside a code block is a comment)."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return {anchor(m) for m in re.findall(r"^#{1,6} (.+)$", prose, re.M)}


def test_every_relative_link_lands_on_a_file_and_heading():
    checked, broken = 0, []
    for path, text in TEXTS.items():
        prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            file, _, fragment = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            checked += 1
            if not dest.exists():
                broken.append(f"{path.relative_to(REPO)}: {target} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in headings(dest.read_text()):
                broken.append(f"{path.relative_to(REPO)}: {target} (no such heading)")
    assert checked > 50 and not broken, broken


def test_the_readme_links_every_docs_file():
    linked = {m for m in re.findall(r"\]\(docs/([\w-]+\.md)", README)}
    assert linked >= {path.name for path in DOCS} - {"README.md"}
    assert "](docs/README.md)" in README or "](docs/)" in README
