"""What every family's pipeline stage is made of: its run of layers, and the tied copy.

A stage module (`pipeline.PipelineChunk` for GPT and hybrid Mamba models,
`pipeline_bert.BertPipelineChunk` for BERT) holds a run of the whole model's
layers as a `StageBlock`. With tied embeddings its last stage holds its own copy
of the word embeddings as the output weight (`tied_output_copy`), marked so the
gradient norm counts it once and checkpoints store it once (`is_shared_copy`).
"""

from __future__ import annotations

from torch import Tensor, nn

_SHARED_COPY = "_mg_shared_embedding_copy"


class StageBlock(nn.Module):
    """The chunk's layers, then the final norm on the last stage (Identity elsewhere).

    Named and shaped like `TransformerBlock` so `apply_activation_recompute`
    works on a chunk exactly as on a whole model. The final norm keeps the
    whole model's name: `final_layernorm` (TransformerBlock), `final_norm`
    (a hybrid's MambaStack)."""

    def __init__(
        self,
        layers: list[nn.Module],
        final_layernorm: nn.Module | None,
        final_norm_name: str = "final_layernorm",
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.final_norm_name = final_norm_name
        norm = final_layernorm if final_layernorm is not None else nn.Identity()
        setattr(self, final_norm_name, norm)

    def forward(
        self, hidden: Tensor, rotary: tuple[Tensor, Tensor] | None, attention_mask: Tensor | None
    ) -> Tensor:
        for layer in self.layers:
            hidden = layer(hidden, rotary, attention_mask)
        return getattr(self, self.final_norm_name)(hidden)


def tied_output_copy(word_embeddings: Tensor) -> nn.Parameter:
    """The last stage's own output weight when it is tied to the first stage's embedding:
    a copy (a DTensor stays one), marked as the shared copy; its gradient is summed with
    the embedding's over the embedding group (`pipeline.allreduce_shared_embedding_grad`)."""
    copy = nn.Parameter(word_embeddings.detach().clone())
    setattr(copy, _SHARED_COPY, True)
    return copy


def is_shared_copy(param: Tensor) -> bool:
    """True for the last stage's copy of a tied embedding (left out of the grad norm)."""
    return getattr(param, _SHARED_COPY, False)
