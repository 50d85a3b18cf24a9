import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The fixtures beside the clone (CI), or where SPLITMOE_FIXTURES_DIR says: the GPU check carries a
# subset of them into the tree it sends (bench/gpu/prepare.sh), since ../shared does not travel.
FIXTURES = Path(os.environ.get("SPLITMOE_FIXTURES_DIR") or REPO.parent / "shared" / "fixtures")
sys.path.insert(0, str(REPO))  # `tests.support` importable from any rootdir

import splitmoe  # noqa: E402,F401 - before torch: the runtimes' defaults (splitmoe/__init__.py)

# The fixtures here that start the stack as processes: a test using one (directly or through another
# fixture) is `stack` wherever it lives, so `-m "not stack"` never starts it.
STACK_FIXTURES = frozenset({"bf16_stack"})


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: it must see the marks added here
def pytest_collection_modifyitems(config, items):
    mark_stack_fixture_users(items)
    skip_cuda_without_a_gpu(items)
    skip_compose_unless_asked(config, items)


def mark_stack_fixture_users(items) -> None:
    for item in items:
        if STACK_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.stack)


def skip_compose_unless_asked(config, items) -> None:
    """`compose` tests build the image (minutes): they run when `-m` names them (-m compose)."""
    wanted = config.getoption("markexpr") or ""
    if "compose" in wanted and "not compose" not in wanted:
        return
    skip = pytest.mark.skip(reason="builds the image and runs docker compose (minutes): "
                                   "python -m pytest -m compose tests/compose")
    for item in items:
        if item.get_closest_marker("compose") is not None:
            item.add_marker(skip)


def skip_cuda_without_a_gpu(items) -> None:
    """Tests marked `cuda` need a GPU that torch sees: elsewhere they skip, saying so."""
    cuda_items = [item for item in items if "cuda" in item.keywords]
    if not cuda_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch sees none here (bench/gpu/run.sh runs these on a GPU machine)")
    for item in cuda_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    if not FIXTURES.is_dir():
        pytest.skip("../shared/fixtures not found: the llama.cpp-made fixtures live beside the clone in CI")
    return FIXTURES


@pytest.fixture(scope="session")
def demo_gguf(tmp_path_factory) -> Path:
    """The built-in demo model (tiny qwen3moe, random weights), written once per test session."""
    from splitmoe.demo_model import write_demo_model

    path = tmp_path_factory.mktemp("demo") / "demo.gguf"
    write_demo_model(path)
    return path


@pytest.fixture(scope="session")
def bf16_stack(demo_gguf, tmp_path_factory):
    """The whole stack on the demo model, serving bfloat16, shared by the tests that drive it with the
    official openai client (structured outputs, tool calls)."""
    from tests.support.stack import running_stack

    # speculation on: every greedy request the shared stack serves verifies n-gram drafts (bfloat16, services)
    with running_stack(demo_gguf, tmp_path_factory.mktemp("bf16-stack-logs"), "--dtype", "bfloat16",
                       "--speculative", "ngram") as s:
        yield s


@pytest.fixture(scope="session")
def openai_client(bf16_stack):
    import openai

    return openai.OpenAI(base_url=bf16_stack.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def served_model_id(openai_client) -> str:
    return openai_client.models.list().data[0].id
