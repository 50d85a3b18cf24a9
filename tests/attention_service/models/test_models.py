"""The architecture registry: each ArchSpec (attention_service/models/<arch>.py) names its file facts
(modelfile/architectures.py), the two agree on what is supported, and the shared layers know no
architecture by name."""
import ast
import dataclasses

import pytest

from splitmoe.attention_service.models import ARCHS
from splitmoe.kernels.moe import ACT_SWIGLU_OAI, ACTIVATIONS
from splitmoe.modelfile.architectures import ARCHITECTURES, architecture
from tests.support.processes import REPO


def test_every_arch_spec_names_the_file_facts_of_its_architecture():
    assert set(ARCHS) == set(ARCHITECTURES)
    for name, spec in ARCHS.items():
        assert spec.architecture is architecture(name)
        assert spec.architecture.expert_activation in ACTIVATIONS


def test_only_gpt_oss_has_other_experts_and_an_unlisted_architecture_gets_the_common_case():
    assert {a.gguf_arch for a in ARCHITECTURES.values() if a.expert_activation == ACT_SWIGLU_OAI} == {"gpt-oss"}
    unlisted = architecture("newmoe")
    assert unlisted.gguf_arch == "newmoe" and unlisted.expert_activation != ACT_SWIGLU_OAI
    assert not unlisted.hparam_defaults


@pytest.mark.parametrize("change", [{"qk_norm": "sometimes"}, {"shared_expert": "gated"}, {"attention": "linear"},
                                    {"sliding_window_pattern": -1}])
def test_a_spec_of_an_unknown_kind_fails_where_it_is_written(change):
    with pytest.raises(ValueError, match="qwen3moe"):
        dataclasses.replace(ARCHS["qwen3moe"], **change)


def test_the_shared_layers_import_no_architecture():
    """model/ is what architectures are wired from; only the runner looks a file's ArchSpec up."""
    for path in sorted((REPO / "attention_service" / "model").glob("*.py")):
        imported = {node.module for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.ImportFrom) and node.module}
        models = {m for m in imported if m.startswith("splitmoe.attention_service.models")}
        assert models == ({"splitmoe.attention_service.models"} if path.name == "runner.py" else set()), path.name
