"""OLMoE-1B-7B: q/k RMSNorm over the full projection width.

Top-k weights not renormalised by default: modelfile/architectures.py (OLMOE).
"""
from splitmoe.attention_service.model.arch_spec import QK_NORM_FULL, ArchSpec
from splitmoe.modelfile.architectures import OLMOE

SPEC = ArchSpec(OLMOE, qk_norm=QK_NORM_FULL)
