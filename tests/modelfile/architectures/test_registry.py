"""The architecture registry (modelfile/architectures/__init__.py): one module per family holds its
file facts and its ArchSpec, the one registry lists them, and the attention side's shared layers
know no architecture by name."""
import ast
import dataclasses

import pytest

from splitmoe.kernels.moe import ACT_SWIGLU_OAI, ACTIVATIONS
from splitmoe.modelfile.architectures import ARCHS, FAMILIES, arch_spec, architecture
from splitmoe.modelfile.gguf_file import GGUFError, GGUFFile
from splitmoe.modelfile.hparams import ModelConfig, Reader
from tests.support.processes import REPO

FOLDER = REPO / "modelfile" / "architectures"


def test_every_family_module_is_listed_once_and_names_its_own_file_facts():
    modules = {p.stem for p in FOLDER.glob("*.py")} - {"__init__", "base"}
    assert {m.__name__.rsplit(".", 1)[1] for m in FAMILIES} == modules
    assert len(ARCHS) == len(FAMILIES)
    for m in FAMILIES:
        assert m.SPEC.architecture is m.ARCHITECTURE
        assert ARCHS[m.SPEC.gguf_arch] is m.SPEC and architecture(m.SPEC.gguf_arch) is m.ARCHITECTURE
        assert m.ARCHITECTURE.expert_activation in ACTIVATIONS


def test_only_gpt_oss_has_other_experts_and_an_unlisted_architecture_gets_the_common_case():
    assert {a for a, s in ARCHS.items() if s.architecture.expert_activation == ACT_SWIGLU_OAI} == {"gpt-oss"}
    unlisted = architecture("newmoe")
    assert unlisted.gguf_arch == "newmoe" and unlisted.expert_activation != ACT_SWIGLU_OAI
    assert not unlisted.hparam_defaults and unlisted.read_hparams is None


def test_the_attention_side_refuses_an_unlisted_architecture_naming_the_file():
    with pytest.raises(GGUFError, match=r"new\.gguf: architecture 'newmoe' is not supported \(supported: dbrx, "):
        arch_spec("newmoe", "new.gguf")


@pytest.mark.parametrize("change", [{"qk_norm": "per_head"}, {"qk_norm": 1}, {"shared_expert": "gated"},
                                    {"attention": "linear"}, {"sliding_window_pattern": -1}])
def test_a_spec_of_an_unknown_kind_fails_where_it_is_written(change):
    """q/k norm kinds are QkNorm members only: the string and the kernel's int are no longer spellings."""
    with pytest.raises(ValueError, match="qwen3moe"):
        dataclasses.replace(ARCHS["qwen3moe"], **change)


def test_the_shared_layers_import_no_architecture():
    """attention_service/model/ is what architectures are wired from: it may read the kinds
    (architectures.base), and only the runner looks a file's ArchSpec up in the registry."""
    for path in sorted((REPO / "attention_service" / "model").glob("*.py")):
        imported = {node.module for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.ImportFrom) and node.module}
        found = {m for m in imported if m.startswith("splitmoe.modelfile.architectures")}
        allowed = {"splitmoe.modelfile.architectures.base"}
        if path.name == "runner.py":
            allowed.add("splitmoe.modelfile.architectures")
        assert found <= allowed, path.name


def test_a_family_module_imports_no_other_family():
    """Adding a family is one module: none leans on another's."""
    families = {m.__name__ for m in FAMILIES}
    for m in FAMILIES:
        tree = ast.parse((FOLDER / f"{m.__name__.rsplit('.', 1)[1]}.py").read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert not imported & families, m.__name__


@pytest.mark.parametrize("family", ["dbrx", "deepseek2", "llama4", "qwen3moe"])
def test_a_family_reads_its_own_keys_and_the_shared_reading_none_of_them(fixtures_dir, family):
    """What `read_hparams` sets differs from the shared reading (ModelConfig.from_gguf with no
    architecture, as the expert service reads a file) only in the fields the family names."""
    g = GGUFFile(fixtures_dir / family / f"{family}-q8_0.gguf")
    arch = architecture(g.arch)
    own = arch.config(g)
    shared = ModelConfig.from_gguf(g, arch.hparam_defaults)
    named = set(arch.read_hparams(Reader(g), shared)) if arch.read_hparams else set()
    differs = {f.name for f in dataclasses.fields(own) if getattr(own, f.name) != getattr(shared, f.name)}
    assert differs <= named
    assert differs == {"dbrx": {"clamp_kqv"}, "llama4": {"moe_layer_interval", "nope_layer_interval",
                                                         "attention_chunk_tokens", "attention_temperature_floor_tokens",
                                                         "attention_temperature_scale"},
                       "deepseek2": {"q_lora_rank", "kv_lora_rank", "mla_key_head_dim", "mla_value_head_dim"},
                       "qwen3moe": set()}[family]
