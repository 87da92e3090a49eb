"""REALM's retriever: a BERT bi-encoder trained with the Inverse Cloze Task (ICT).

    query tokens  → query_model   (BERT encoder → [CLS] → projection_enc) → q [b, d]
    block tokens  → context_model (BERT encoder → [CLS] → projection_enc) → c [b, d]
    scores = q cᵀ (/ √hidden size with --retriever-score-scaling); loss = CE(scores, diagonal)

Megatron's `BiEncoderModel` / `PretrainedBertModel` (megatron/legacy/model/
biencoder_model.py) and `pretrain_ict.py`'s loss, as plain PyTorch: each tower is
the encoder of our BertModel (same `embedding.*`, `encoder.layers.*` names, so a
BERT checkpoint loads into it by name) without its heads, its output the [CLS]
position's last hidden state, through `projection_enc` when
``projection_dim > 0``. With ``shared`` one tower (`shared_model`) embeds both.
The other rows of the batch are each query's negatives (in-batch negatives);
data parallelism widens the batch by gathering from outside, not here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mg.core.models.bert import BertEmbedding, PostLNTransformerBlock, padding_attention_mask
from mg.core.models.config import TransformerConfig
from mg.core.models.gpt import TransformerBlock
from mg.core.models.te_spec import init_linear

TOWER_WEIGHT_PREFIXES = ("embedding.", "encoder.")
"""The weights of a BERT checkpoint that a tower takes (its heads are left out)."""


class BiEncoderTower(nn.Module):
    """A BERT encoder whose output is its [CLS] hidden state (Megatron's PretrainedBertModel)."""

    def __init__(self, config: TransformerConfig, projection_dim: int = 0, num_tokentypes: int = 2):
        super().__init__()
        self.config = config
        self.embedding = BertEmbedding(config, num_tokentypes)
        if config.transformer_layer_order == "post_ln":
            self.encoder: nn.Module = PostLNTransformerBlock(config)
        else:
            self.encoder = TransformerBlock(config, causal=False)
        self.projection_enc = (
            nn.Linear(config.hidden_size, projection_dim) if projection_dim > 0 else None
        )
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        std = self.config.init_method_std
        self.embedding.init_weights(std)
        for layer in self.encoder.layers:
            layer.init_weights(std, std / math.sqrt(2.0 * self.config.num_layers))
        if hasattr(self.encoder, "final_layernorm"):
            self.encoder.final_layernorm.reset_parameters()
        if self.projection_enc is not None:
            init_linear(self.projection_enc, std)

    def forward(
        self, tokens: Tensor, pad_mask: Tensor, tokentype_ids: Tensor | None = None
    ) -> Tensor:
        """tokens [b, s] ([CLS] first), pad_mask [b, s] (1 = real token) → [b, d]."""
        b, s = tokens.shape
        positions = torch.arange(s, device=tokens.device).expand(b, s)
        hidden = self.embedding(tokens, positions, tokentype_ids)
        hidden = self.encoder(hidden, None, padding_attention_mask(pad_mask))
        pooled = hidden[:, 0]
        return self.projection_enc(pooled) if self.projection_enc is not None else pooled


class BiEncoderModel(nn.Module):
    """Query and context towers; forward → (query embeddings, context embeddings)."""

    def __init__(
        self,
        config: TransformerConfig,
        projection_dim: int = 0,
        shared: bool = False,
        num_tokentypes: int = 2,
    ) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.shared = shared
        if shared:
            self.shared_model = BiEncoderTower(config, projection_dim, num_tokentypes)
        else:
            self.query_model = BiEncoderTower(config, projection_dim, num_tokentypes)
            self.context_model = BiEncoderTower(config, projection_dim, num_tokentypes)

    @property
    def query_tower(self) -> BiEncoderTower:
        return self.shared_model if self.shared else self.query_model

    @property
    def context_tower(self) -> BiEncoderTower:
        return self.shared_model if self.shared else self.context_model

    def forward(
        self,
        query_tokens: Tensor,
        query_pad_mask: Tensor,
        context_tokens: Tensor,
        context_pad_mask: Tensor,
    ) -> tuple[Tensor, Tensor]:
        # token types are all 0, as pretrain_ict.py's forward_step sets them
        return (
            self.query_tower(query_tokens, query_pad_mask),
            self.context_tower(context_tokens, context_pad_mask),
        )

    @torch.no_grad()
    def load_bert(self, bert_weights: Mapping[str, Tensor]) -> None:
        """Both towers from one BERT checkpoint's encoder (Megatron's `--bert-load`, read at
        iteration 0); a projection keeps its init, the same in both towers as Megatron."""
        towers = [self.shared_model] if self.shared else [self.query_model, self.context_model]
        encoder = {k: v for k, v in bert_weights.items() if k.startswith(TOWER_WEIGHT_PREFIXES)}
        for tower in towers:
            missing, unexpected = tower.load_state_dict(encoder, strict=False)
            missing = [k for k in missing if not k.startswith("projection_enc.")]
            if missing or unexpected:
                raise ValueError(
                    f"the BERT weights do not fit the bi-encoder's towers (missing {missing[:3]}, "
                    f"unexpected {unexpected[:3]}); give a BERT of the same shape"
                )
        if not self.shared and self.query_model.projection_enc is not None:
            self.context_model.projection_enc.load_state_dict(
                self.query_model.projection_enc.state_dict()
            )


def retrieval_scores(
    query: Tensor, context: Tensor, scale_hidden_size: int | None = None
) -> Tensor:
    """[queries, contexts] inner products; divided by √hidden size when given
    (--retriever-score-scaling: Megatron divides by √--hidden-size, projection or not)."""
    scores = query.float() @ context.float().t()
    return scores / math.sqrt(scale_hidden_size) if scale_hidden_size else scores


def ict_loss(scores: Tensor, first_block: int = 0) -> Tensor:
    """Cross entropy of each query against its own block among the batch's: query i's is
    column `first_block` + i (the diagonal; offset when the blocks are gathered from
    several data-parallel ranks and these queries are one rank's)."""
    labels = torch.arange(scores.shape[0], device=scores.device) + first_block
    return F.nll_loss(F.log_softmax(scores, dim=1), labels)


def topk_accuracies(scores: Tensor, ks: Sequence[int]) -> dict[int, float]:
    """The fraction of queries whose own block (the diagonal) is among their k best, per k."""
    own = scores.diagonal().unsqueeze(1)
    rank = (scores > own).sum(dim=1)  # blocks scored above the right one (ties count for it)
    return {int(k): int((rank < k).sum()) / scores.shape[0] for k in ks}
