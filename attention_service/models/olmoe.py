"""OLMoE-1B-7B: q/k RMSNorm over the full projection width, top-k weights not renormalised."""
from splitmoe.attention_service.model.attention import QK_NORM_FULL
from splitmoe.attention_service.models.base import ArchSpec

SPEC = ArchSpec(
    gguf_arch="olmoe",
    qk_norm=QK_NORM_FULL,
    hparam_defaults={"expert_weights_norm": False},
)
