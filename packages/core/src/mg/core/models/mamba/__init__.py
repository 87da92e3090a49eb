"""Mamba-2 and hybrid (Mamba-2 + attention + MLP) language models, in plain PyTorch.

from mg.core.models.mamba import MambaConfig, MambaModel
config = MambaConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=128,
                     mamba_head_dim=16, mamba_num_groups=2, mamba_state_dim=16,
                     hybrid_override_pattern="M*M-")
logits = MambaModel(config)(input_ids)

Modules, one job each: `ssd` (the chunked state-space scan and its recurrence),
`mixer` (the Mamba-2 mixer), `pattern` (Megatron's layer allocation),
`config`, `hybrid` (layers, stack, model), `cache` (the decoding state).
"""

from mg.core.models.mamba.cache import HybridCache, PagedHybridCache
from mg.core.models.mamba.config import MambaConfig, decoder_config_from_dict, tiny_hybrid
from mg.core.models.mamba.hybrid import (
    AttentionLayer,
    MambaLayer,
    MambaModel,
    MambaStack,
    MLPLayer,
    decoder_model,
    from_megatron_te_names,
    megatron_te_names,
)
from mg.core.models.mamba.mixer import GatedRMSNorm, MambaMixer
from mg.core.models.mamba.pattern import allocate_layers
from mg.core.models.mamba.ssd import ssd_chunked_scan, ssd_sequential_scan, ssd_step

__all__ = [
    "AttentionLayer",
    "GatedRMSNorm",
    "HybridCache",
    "MLPLayer",
    "MambaConfig",
    "MambaLayer",
    "MambaMixer",
    "MambaModel",
    "MambaStack",
    "PagedHybridCache",
    "allocate_layers",
    "tiny_hybrid",
    "decoder_config_from_dict",
    "decoder_model",
    "from_megatron_te_names",
    "megatron_te_names",
    "ssd_chunked_scan",
    "ssd_sequential_scan",
    "ssd_step",
]
