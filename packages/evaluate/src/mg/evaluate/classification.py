"""Megatron's downstream heads on a pretrained BERT (``legacy/model/classification.py``,
``multiple_choice.py``): the pooled ``[CLS]`` output → dropout → one linear layer.

Classification (MNLI, QQP) has ``num_classes`` outputs; multiple choice (RACE) one
score per choice row, the rows of an example read as ``[b, choices]`` logits. A
BERT saved without a pooler (``--bert-no-binary-head``, a BertForMaskedLM) gets a
fresh one, as Megatron adds the pooler when it builds the classifier.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mg.core.models.bert import BertModel, Pooler


class BertClassifier(nn.Module):
    def __init__(self, bert: BertModel, num_classes: int, num_choices: int = 0) -> None:
        super().__init__()
        config = bert.config
        self.bert = bert
        self.num_choices = num_choices
        self.pooler = bert.pooler if bert.pooler is not None else Pooler(config)
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.head = nn.Linear(config.hidden_size, 1 if num_choices else num_classes)
        device = bert.embedding.word_embeddings.weight.device
        with torch.no_grad():
            new = [self.head] + ([self.pooler.dense] if bert.pooler is None else [])
            for linear in new:
                nn.init.normal_(linear.weight, mean=0.0, std=config.init_method_std)
                nn.init.zeros_(linear.bias)
        self.to(device)

    def forward(self, ids: Tensor, types: Tensor, paddings: Tensor) -> Tensor:
        """ids/types/paddings [b, s] (RACE: [b, choices, s]) → logits [b, classes|choices]."""
        if self.num_choices:
            ids, types, paddings = (x.flatten(0, 1) for x in (ids, types, paddings))
        hidden = self.bert.encode(ids, paddings, types)
        logits = self.head(self.dropout(self.pooler(hidden)))
        if self.num_choices:
            logits = logits.view(-1, self.num_choices)
        return logits
