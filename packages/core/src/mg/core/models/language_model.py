"""The decoder language model's shell: embedding → rotary positions → decoder → output.

GPTModel (gpt.py) and MambaModel (mamba/hybrid.py) are this shell around their
own decoder stack; a pipeline stage (`mg.core.parallel.pipeline.PipelineChunk`)
holds a part of one:

    LanguageModelParts   what a model or a stage of it holds: `embedding` (None on a
                         later pipeline stage), `rotary_pos_emb` (None without RoPE),
                         `decoder`, `output_layer` (None when tied to the embedding),
                         `real_vocab_size` and the `output_head` that turns the final
                         hidden states into logits or the loss (output_head.py)
    LanguageModel        a whole model built from its config: the parts on the meta
                         device, Megatron's init as ordered `init_units`, the forward

Module and parameter names are Megatron-Core's (`embedding.word_embeddings`,
`decoder.layers.{i}...`, `output_layer`); the decoder's final norm keeps its
stack's name (`final_layernorm` in GPT's TransformerBlock, `final_norm` in
Mamba's stack). With tied embeddings (the default, as in Megatron) there is no
`output_layer` parameter: the logits use `embedding.word_embeddings.weight`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor, nn

from mg.core.models.config import TransformerConfig
from mg.core.models.mtp import MTPLosses, roll_left
from mg.core.models.output_head import OutputHead
from mg.core.models.rope import RotaryEmbedding
from mg.core.models.tied_gradient import TiedGradient, tied_logits, tied_lookup

if TYPE_CHECKING:
    from mg.core.models.kv_cache import KVCache
    from mg.core.models.mamba.cache import HybridCache
    from mg.core.parallel.vocab_shards import VocabShards


@dataclass(frozen=True)
class InitUnit:
    """One step of a model's initialisation: `init(module)` for the module at `prefix`."""

    prefix: str
    module: nn.Module
    init: Callable[[nn.Module], None]


class LanguageModelEmbedding(nn.Module):
    """Token embedding, plus learned absolute positions for GPT-2-style models."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = (
            nn.Embedding(config.max_position_embeddings, config.hidden_size)
            if config.position_embedding_type == "learned_absolute"
            else None
        )
        self.embedding_dropout = nn.Dropout(config.hidden_dropout)
        # Gemma: × √hidden, rounded to the embedding's dtype first (as HF's normalizer)
        self.embedding_scale = (
            config.hidden_size**0.5 if config.scale_embeddings_by_sqrt_hidden else None
        )
        self.tied_gradient: TiedGradient | None = None
        """Set where the lookup and `tied_logits` sum the shared weight's gradient in one
        tensor (fully sharded training: mg.core.parallel.fully_sharded)."""
        self.vocab_shards: VocabShards | None = None
        """Set where the weight stays sharded by rows over the data-parallel ranks and the
        lookup and `tied_logits` exchange tokens instead (mg.core.parallel.vocab_shards)."""

    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.word_embeddings.weight, mean=0.0, std=std)
        if self.position_embeddings is not None:
            nn.init.normal_(self.position_embeddings.weight, mean=0.0, std=std)

    def tied_logits(self, hidden: Tensor) -> Tensor:
        """hidden @ word_embeddingsᵀ: the tied output layer as a method of the module that
        owns its weight, so that FSDP can gather the weight around it (fully_sharded.py)."""
        if self.vocab_shards is not None:
            return self.vocab_shards.logits(hidden, self.word_embeddings.weight)
        return tied_logits(hidden, self.word_embeddings.weight, self.tied_gradient)

    def forward(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        if self.vocab_shards is not None:
            hidden = self.vocab_shards.lookup(input_ids, self.word_embeddings.weight)
        elif self.tied_gradient is None:
            hidden = self.word_embeddings(input_ids)
        else:
            hidden = tied_lookup(input_ids, self.word_embeddings.weight, self.tied_gradient)
        if self.embedding_scale is not None:
            hidden = hidden * torch.tensor(self.embedding_scale, dtype=hidden.dtype)
        if self.position_embeddings is not None:
            hidden = hidden + self.position_embeddings(position_ids)
        return self.embedding_dropout(hidden)


class LanguageModelParts(nn.Module):
    """The parts of a decoder language model, whole or one pipeline stage of it, and what
    they do together: the decoder with its rotary tables, and the output.

    `output_and_loss(hidden, labels)` runs `output_head` on this module's output weight
    (or output layer): construction steps choose the head (tensor parallelism its
    vocab-parallel one, `--cross-entropy-loss-fusion` the fused one, a quantized output
    layer its module's forward), never the method itself."""

    def __init__(
        self,
        config: TransformerConfig,
        embedding: LanguageModelEmbedding | None,
        rotary_pos_emb: RotaryEmbedding | None,
        decoder: nn.Module,
        output_layer: nn.Module | None,
        output_head: OutputHead | None = None,
        mtp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        # the tokenizer's vocabulary, where a reader sets it: padding rows beyond it get
        # -inf logits (mg.core.models.vocab_mask)
        self.real_vocab_size: int | None = None
        self.output_head = output_head if output_head is not None else OutputHead()
        self.embedding = embedding
        self.rotary_pos_emb = rotary_pos_emb
        self.decoder = decoder
        self.mtp = mtp  # multi-token prediction (mg.core.models.mtp), on the last stage
        self.output_layer = output_layer

    def output_weight(self) -> Tensor:
        """The [vocab, hidden] matrix that produces logits (shared or own)."""
        if self.output_layer is not None:
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    def output_bias(self) -> Tensor | None:
        """None: a decoder language model's output layer has no bias (Megatron's)."""
        return None

    def run_decoder(
        self,
        hidden: Tensor,
        position_ids: Tensor,
        attention_mask: Tensor | None,
        inference_cache: KVCache | HybridCache | None = None,
    ) -> Tensor:
        """The embedded tokens [b, s, h] through the decoder (its final norm included)."""
        rotary = self.rotary_pos_emb(position_ids) if self.rotary_pos_emb is not None else None
        if inference_cache is None:
            return self.decoder(hidden, rotary, attention_mask)
        return self.decoder(hidden, rotary, attention_mask, inference_cache)

    def output_and_loss(self, hidden: Tensor, labels: Tensor | None) -> Tensor:
        """Final hidden states [b, s, h] → logits [b, s, vocab], or with labels the
        per-token fp32 cross-entropy [b, s], by the model's `output_head`."""
        return self.output_head(self, hidden, labels)

    def mtp_losses(
        self,
        hidden: Tensor,
        input_ids: Tensor,
        position_ids: Tensor,
        attention_mask: Tensor | None,
        labels: Tensor,
    ) -> MTPLosses:
        """Each MTP depth's per-token cross-entropy [D, b, s] from the decoder's output:
        depth k against the labels rolled left k times (0 where that runs past the end,
        for the rolled loss mask to drop), through the same output head."""
        rotary = self.rotary_pos_emb(position_ids) if self.rotary_pos_emb is not None else None
        depths = self.mtp(hidden, input_ids, position_ids, self.embedding, rotary, attention_mask)
        losses = []
        for depth_hidden in depths:
            labels = roll_left(labels)
            losses.append(self.output_and_loss(depth_hidden, labels))
        return MTPLosses(torch.stack(losses), self.config.mtp_loss_scaling_factor)


class LanguageModel(LanguageModelParts):
    """A whole decoder-only language model; subclasses name their decoder stack.

    `decoder_class(config)` builds the layer stack and its final norm, named
    `final_norm_name`; `residual_branches_per_layer` sets the init of the projections
    that write into the residual stream (see `init_units`).

    The model builds on the meta device: `with torch.device("meta"): m = GPTModel(cfg)`,
    then `m.to_empty(device=...)` and `m.init_weights()`; built on any other device it
    is initialised at once. A rank that holds a part of it replays `init_units()` to
    give its shards the whole model's values (`mg.core.parallel.materialize`).
    """

    decoder_class: ClassVar[Callable[[TransformerConfig], nn.Module]]
    final_norm_name: ClassVar[str]
    residual_branches_per_layer: ClassVar[int]

    def __init__(self, config: TransformerConfig) -> None:
        device = torch.get_default_device()
        # Built on the meta device, then given storage: the submodules' own default init
        # (kaiming for nn.Linear) would draw random numbers that init_weights overwrites,
        # and a sharded build (mg.core.parallel.materialize) replays init_weights only.
        with torch.device("meta"):
            super().__init__(
                config,
                embedding=LanguageModelEmbedding(config),
                rotary_pos_emb=(
                    RotaryEmbedding(config) if config.position_embedding_type == "rope" else None
                ),
                decoder=self.decoder_class(config),
                mtp=self.build_mtp(config),
                output_layer=(
                    nn.Linear(config.hidden_size, config.vocab_size, bias=False)
                    if config.untie_embeddings_and_output_weights
                    else None
                ),
            )
        if device.type != "meta":
            self.to_empty(device=device)
            self.init_weights()

    def build_mtp(self, config: TransformerConfig) -> nn.Module | None:
        """The multi-token prediction block, where the model has one (GPTModel's)."""
        return None

    def init_units(self) -> list[InitUnit]:
        """Megatron's init as an ordered list of (name prefix, module, init function):
        the embedding N(0, σ), each layer (N(0, σ), its residual-writing projections
        N(0, σ/√(branches·L))), the decoder's final norm, then an untied output layer.

        Running the functions in order is `init_weights`; the order fixes which
        random numbers each tensor gets, so a rank that builds only its shards
        replays the list unit by unit on a full-size scratch copy and keeps its
        part (`mg.core.parallel.materialize`) and gets the single-process values."""
        std = self.config.init_method_std
        branches = self.residual_branches_per_layer
        output_std = std / math.sqrt(branches * self.config.num_layers)
        units = [InitUnit("embedding", self.embedding, lambda m: m.init_weights(std))]
        units += [
            InitUnit(f"decoder.layers.{i}", layer, lambda m: m.init_weights(std, output_std))
            for i, layer in enumerate(self.decoder.layers)
        ]
        norm = getattr(self.decoder, self.final_norm_name)
        units.append(InitUnit(f"decoder.{self.final_norm_name}", norm, _reset_norm))
        if self.mtp is not None:  # built after the decoder, as Megatron builds it
            units += [
                InitUnit(f"mtp.layers.{k}", layer, lambda m: m.init_weights(std, output_std))
                for k, layer in enumerate(self.mtp.layers)
            ]
        if self.output_layer is not None:
            units.append(
                InitUnit(
                    "output_layer",
                    self.output_layer,
                    lambda m: nn.init.normal_(m.weight, mean=0.0, std=std),
                )
            )
        return units

    @torch.no_grad()
    def init_weights(self) -> None:
        """Megatron's init: N(0, σ) everywhere, N(0, σ/√(branches·L)) for the projections
        that write into the residual stream, norms at weight 1 / bias 0, biases 0. Seed
        with torch.manual_seed beforehand."""
        for unit in self.init_units():
            unit.init(unit.module)

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
        inference_cache: KVCache | HybridCache | None = None,
        return_mtp: bool = False,
    ) -> Tensor | tuple[Tensor, MTPLosses]:
        """input_ids [b, s] → logits [b, s, vocab], or, with labels [b, s], the
        per-token cross-entropy [b, s] in fp32 (unreduced, as Megatron returns it:
        the trainer applies the loss mask and averages).

        position_ids default to 0..s-1 per row. attention_mask is optional, bool,
        broadcastable to [b, 1, s, s], True = may not attend (Megatron's
        convention); it is applied on top of the causal mask.

        inference_cache (a bound `KVCache`, or a hybrid's `HybridCache`) makes this an
        incremental step: position_ids must then be given, and each layer continues
        from each row's cached state in its slot (attention_mask is not used).

        return_mtp, with labels, on a model with multi-token prediction: the pair
        (per-token loss [b, s], `MTPLosses`: each depth's per-token loss [D, b, s]).
        """
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).expand(b, s)
        hidden = self.embedding(input_ids, position_ids)
        hidden = self.run_decoder(hidden, position_ids, attention_mask, inference_cache)
        if return_mtp and self.mtp is not None and labels is not None:
            mtp = self.mtp_losses(hidden, input_ids, position_ids, attention_mask, labels)
            return self.output_and_loss(hidden, labels), mtp
        return self.output_and_loss(hidden, labels)


def _reset_norm(norm: nn.Module) -> None:
    norm.reset_parameters()
