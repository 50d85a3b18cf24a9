"""The attention service's settings: parsed once at the edge (the CLI), passed down frozen.

What the model runner and the remote experts take is their own settings object, held here whole
rather than spelled again field by field.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from splitmoe.attention_service.engine.speculation import SpeculationSettings
from splitmoe.attention_service.engine.tool_calls import FORMATS
from splitmoe.attention_service.expert_backends.load_plan import HeatBudget
from splitmoe.attention_service.expert_backends.remote import RemoteExpertsSettings
from splitmoe.attention_service.lora_adapters import LoraSettings
from splitmoe.attention_service.model.runner import RunnerOptions
from splitmoe.runtime.cluster_auth import ClusterSecurity

TOOL_CALL_PARSERS = ("auto", *FORMATS, "none")


def serving_runner_options(**options) -> RunnerOptions:
    """The runner's options as the service defaults them: the fast path (bfloat16), a large cache."""
    return RunnerOptions(**{"dtype": torch.bfloat16, "kv_cache_tokens": 16384, **options})


@dataclass(frozen=True, slots=True)
class AttentionSettings:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 50051
    served_model_name: str = ""  # default: the GGUF file's stem
    runner: RunnerOptions = field(default_factory=serving_runner_options)
    experts: RemoteExpertsSettings | None = None  # None: every routed expert in this process
    max_batch_tokens: int = 512  # tokens per step: prompt chunks share it with decodes
    max_running_seqs: int = 64
    max_waiting_requests: int = 256
    otlp_endpoint: str = ""
    reasoning_format: str = "auto"  # auto: chat replies carry reasoning apart | none: inline, in the content
    tool_call_parser: str = "auto"  # auto: from the vocabulary and template | a format's name | none
    # The secret its callers must present (the expert services' is `experts.security`); TLS
    security: ClusterSecurity = ClusterSecurity()
    # The hottest routed experts kept in GPU memory (expert_backends/gpu_hot.py); needs a CUDA device.
    gpu_experts: HeatBudget = HeatBudget()
    speculation: SpeculationSettings = SpeculationSettings()  # drafted tokens verified per step (none by default)
    # LoRA adapters (attention_service/lora_adapters.py): (name, path) loaded at start, how many may be
    # loaded at once, the largest rank a tensor of one may have (vLLM's --lora-modules, --max-loras, --max-lora-rank)
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 4
    max_lora_rank: int = 64

    @property
    def lora_settings(self) -> LoraSettings:
        return LoraSettings(tuple(self.lora_modules), self.max_loras, self.max_lora_rank)

    def __post_init__(self):
        if self.reasoning_format not in ("auto", "none"):
            raise ValueError(f"reasoning_format must be auto or none, not {self.reasoning_format!r}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"not {self.tool_call_parser!r}")
        if self.max_batch_tokens < 1 or self.max_running_seqs < 1:
            raise ValueError("max_batch_tokens and max_running_seqs must be >= 1")
        self.lora_settings  # checked here, at the edge
        if self.gpu_experts and self.runner.device.type != "cuda":
            raise ValueError(f"--gpu-experts keeps experts in GPU memory: it needs --device cuda, "
                             f"not {self.runner.device}")
