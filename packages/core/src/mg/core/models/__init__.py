"""Model configs and the GPT family (GPT-2, Llama 2/3, Mistral as configs of one decoder).

from mg.core.models import GPTModel, presets
model = GPTModel(presets.tiny_llama())
logits = model(input_ids)              # [b, s, vocab]
loss = model(input_ids, labels=labels)  # [b, s] per-token loss
"""

from mg.core.models import presets
from mg.core.models.bert import BertModel
from mg.core.models.config import (
    ConfigError,
    RopeScaling,
    TransformerConfig,
    pad_vocab_size,
    swiglu_ffn_hidden_size,
)
from mg.core.models.flops import num_floating_point_operations, num_parameters
from mg.core.models.gpt import GPTModel
from mg.core.models.recompute import apply_activation_recompute
from mg.core.models.t5 import T5Model

__all__ = [
    "BertModel",
    "ConfigError",
    "GPTModel",
    "RopeScaling",
    "T5Model",
    "TransformerConfig",
    "apply_activation_recompute",
    "num_floating_point_operations",
    "num_parameters",
    "pad_vocab_size",
    "presets",
    "swiglu_ffn_hidden_size",
]
