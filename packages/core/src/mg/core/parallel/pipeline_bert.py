"""Pipeline parallelism for BertModel: its encoder cut into stage modules, as for GPT.

The layers are assigned to pipeline ranks and virtual stages exactly as a
GPTModel's (`mg.core.parallel.pipeline.layer_ranges`, Megatron's assignment).
The first stage holds the embedding (words, positions, token types); the last
one the final norm (pre-LN), the LM head, the output layer's bias and the
pooler and binary head. Names are the whole BertModel's with the layers
numbered locally (`encoder.layers.0` is the chunk's first layer), so
`global_parameter_name` and the `torch_dist` helpers of `pipeline` work
unchanged (a stage's pieces, its `StageBlock` and the tied copy, are
`pipeline_stage`'s, as GPT's chunks' are).

Tied embeddings (BERT's default): as for GPT, the last stage holds its own
`output_layer.weight`, a copy of the word embeddings marked as the shared
copy, whose gradient is summed with the first stage's over the embedding
group (`allreduce_shared_embedding_grad`).

T5 has no pipeline split: Megatron core_v0.16.1 refuses pipeline parallelism
for T5 (`pretrain_t5.py`), and so does mg-train.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mg.core.models.bert import BertModel, padding_attention_mask
from mg.core.parallel.pipeline_stage import StageBlock, tied_output_copy


class BertPipelineChunk(nn.Module):
    """Layers [start, end) of a BertModel, with the embedding if first, the heads if last.

    forward(input, attention_mask, tokentype_ids, lm_labels): input is token ids
    [b, s] on the first stage and the hidden states [b, s, h] elsewhere;
    attention_mask is the padding mask [b, s] (1 = real token). The last stage
    returns (per-token LM loss [b, s] or logits, binary logits [b, 2] or None),
    the others the hidden states for the next stage."""

    def __init__(self, model: BertModel, start: int, end: int, first: bool, last: bool) -> None:
        super().__init__()
        self.config = model.config
        self.layer_offset = start
        self.is_first, self.is_last = first, last
        self.embedding = model.embedding if first else None
        final_norm = getattr(model.encoder, "final_layernorm", None)  # pre-LN only
        self.encoder = StageBlock(
            list(model.encoder.layers[start:end]), final_norm if last else None
        )
        self.lm_head = model.lm_head if last else None
        self.pooler = model.pooler if last else None
        self.binary_head = model.binary_head if last else None
        self.output_layer = None
        if last:
            if isinstance(model.output_layer, nn.Linear) or first:
                self.output_layer = model.output_layer
            else:  # tied: the bias, and the last stage's own copy of the word embeddings
                self.output_layer = nn.Module()
                self.output_layer.bias = model.output_layer.bias
                self.output_layer.weight = tied_output_copy(model.embedding.word_embeddings.weight)
        self.real_vocab_size = getattr(model, "real_vocab_size", None)
        # the whole model's head (tensor parallelism's vocab-parallel one, if it chose it),
        # run on this stage's output weight and bias
        self.output_head = model.output_head

    def output_weight(self) -> Tensor:
        if self.output_layer is not None and hasattr(self.output_layer, "weight"):
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    def output_bias(self) -> Tensor:
        return self.output_layer.bias

    def output_and_loss(self, hidden: Tensor, labels: Tensor | None) -> Tensor:
        return self.output_head(self, hidden, labels)

    def forward(
        self,
        input: Tensor,
        attention_mask: Tensor | None = None,
        tokentype_ids: Tensor | None = None,
        lm_labels: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor | None]:
        if self.is_first:
            b, s = input.shape
            positions = torch.arange(s, device=input.device).expand(b, s)
            hidden = self.embedding(input, positions, tokentype_ids)
        else:
            hidden = input
        hidden = self.encoder(hidden, None, padding_attention_mask(attention_mask))
        if not self.is_last:
            return hidden
        binary = self.binary_head(self.pooler(hidden)) if self.binary_head is not None else None
        return self.output_and_loss(self.lm_head(hidden), lm_labels), binary
