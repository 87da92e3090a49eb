"""How a language model's final hidden states become logits or the per-token loss.

Every model holds one `OutputHead` (`model.output_head`) and its
`output_and_loss(hidden, labels)` hands the hidden states to it. The head is a
strategy, not a module: it holds no parameters or buffers, so choosing one adds
no state-dict names and moves no tensors. It reads what it needs from the model
it is given at each call (`output_weight()`, `output_bias()`, `real_vocab_size`,
or the output module), so a pipeline stage that holds the last layers and the
output layer takes the whole model's head and runs it on its own weights.

The plain head is the default; a construction step that needs another output
picks it and says so here:

    OutputHead                 hidden @ Wᵀ (+ b), padding rows masked, cross-entropy
    OutputModuleHead           logits from the output layer's own forward (a quantized
                               output layer has no float weight: mg.core.quantization;
                               a fully sharded one is gathered around its forward)
    FullyShardedTiedHead       logits from the tied embedding's `tied_logits`, an FSDP
                               forward method (mg.core.parallel.fully_sharded)
    FusedCrossEntropyHead      the output matmul and the loss fused a few tokens at a
                               time (mg.core.models.fused_cross_entropy)
    VocabParallelOutputHead    vocab-sharded logits and Megatron's vocab-parallel
                               cross-entropy under tensor parallelism
                               (mg.core.parallel.loss_parallel)

A serving engine that packs the output matrix for its own kernel subclasses
`OutputHead` with logits from that kernel the same way (`logits_from` below).
"""

from __future__ import annotations

from typing import Protocol

import torch.nn.functional as F
from torch import Tensor, nn

from mg.core.models.vocab_mask import loss_or_logits, mask_padded_vocab


class HasOutputWeight(Protocol):
    """What a head reads from the model it serves (GPTModel, MambaModel, BertModel,
    T5Model and their pipeline stages); `real_vocab_size` where it has one."""

    def output_weight(self) -> Tensor: ...

    def output_bias(self) -> Tensor | None: ...


def real_vocab_size(model: nn.Module) -> int | None:
    """Where the model's padding rows start (None: no masking; BERT and T5 never mask)."""
    return getattr(model, "real_vocab_size", None)


class OutputHead:
    """The plain PyTorch output: logits = hidden @ output_weight()ᵀ (+ output_bias()),
    rows >= real_vocab_size at -inf, and with labels the per-token fp32 cross-entropy
    [b, s], unreduced (as Megatron returns it)."""

    def logits_from(self, model: HasOutputWeight, hidden: Tensor) -> Tensor:
        """Logits [..., vocab] of `hidden` [..., h] before the padding is masked."""
        return F.linear(hidden, model.output_weight(), model.output_bias())

    def __call__(self, model: HasOutputWeight, hidden: Tensor, labels: Tensor | None) -> Tensor:
        logits = mask_padded_vocab(self.logits_from(model, hidden), real_vocab_size(model))
        return loss_or_logits(logits, labels)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class OutputModuleHead(OutputHead):
    """Logits from `model.output_layer(hidden)`: for an output layer whose module computes
    them itself without a float weight to hand out (a quantized linear)."""

    def logits_from(self, model: nn.Module, hidden: Tensor) -> Tensor:
        return model.output_layer(hidden)


def is_plain_output(model: nn.Module) -> bool:
    """Whether `model` still has the default head (no step has chosen another)."""
    return type(model.output_head) is OutputHead
