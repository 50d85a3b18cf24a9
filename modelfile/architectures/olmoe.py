"""OLMoE-1B-7B, GGUF arch `olmoe`: q/k RMSNorm over the full projection width, top-k weights not
renormalised when the file does not say."""
from splitmoe.modelfile.architectures.base import Architecture, ArchSpec, QkNorm

ARCHITECTURE = Architecture("olmoe", hparam_defaults={"expert_weights_norm": False})
SPEC = ArchSpec(ARCHITECTURE, qk_norm=QkNorm.FULL)
