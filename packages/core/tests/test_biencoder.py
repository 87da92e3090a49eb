"""The ICT bi-encoder: towers loaded from a BERT give that BERT's [CLS] state (the real
MiniLM weights), the loss is the in-batch cross entropy Megatron's pretrain_ict.py computes,
and it trains both towers."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from mg.core.models.bert import BertModel, bert_config_from_hf, bert_state_dict_from_hf
from mg.core.models.biencoder import (
    BiEncoderModel,
    ict_loss,
    retrieval_scores,
    topk_accuracies,
)
from mg.core.models.config import TransformerConfig


def tiny_config(**overrides) -> TransformerConfig:
    fields = dict(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=128,
        seq_length=24, max_position_embeddings=24, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    return TransformerConfig(**(fields | overrides))


def test_towers_from_minilm_equal_its_cls_state():
    """--bert-load: both towers hold the BERT's encoder; their output is its [CLS] state."""
    from safetensors.torch import load_file

    from mg.core.fixtures import fixture_path

    config = bert_config_from_hf(
        json.loads(fixture_path("minilm-bert", "config.json").read_text()),
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    weights = bert_state_dict_from_hf(
        load_file(fixture_path("minilm-bert", "model.safetensors")), config
    )
    bert = BertModel(config, add_binary_head=False)
    bert.load_state_dict(weights, strict=False)
    model = BiEncoderModel(config).eval()
    model.load_bert(weights)
    tokens = torch.tensor(
        [[101, 7592, 2088, 2003, 1037, 3231, 102, 0], [101, 2307, 102, 0, 0, 0, 0, 0]]
    )
    mask = (tokens != 0).long()
    with torch.no_grad():
        expected = bert.eval().encode(tokens, mask)[:, 0]
        query, context = model(tokens, mask, tokens, mask)
    assert torch.equal(query, expected) and torch.equal(context, expected)


def test_projection_is_the_same_in_both_towers_after_load():
    config = tiny_config()
    bert = BertModel(config, add_binary_head=True)
    model = BiEncoderModel(config, projection_dim=8)
    model.load_bert(bert.state_dict())
    q, c = model.query_model.projection_enc, model.context_model.projection_enc
    assert torch.equal(q.weight, c.weight) and q.weight.shape == (8, 32)
    shared = BiEncoderModel(config, shared=True)
    assert not hasattr(shared, "query_model") and shared.query_tower is shared.context_tower
    assert all(k.startswith("shared_model.") for k in shared.state_dict())


def test_ict_loss_and_accuracies_by_hand():
    torch.manual_seed(0)
    q, c = torch.randn(6, 16), torch.randn(6, 16)
    scores = retrieval_scores(q, c, scale_hidden_size=64)
    assert torch.allclose(scores, q @ c.t() / 8.0)
    expected = -torch.stack([F.log_softmax(scores[i], 0)[i] for i in range(6)]).mean()
    assert torch.allclose(ict_loss(scores), expected)
    ranks = [int((scores[i] > scores[i, i]).sum()) for i in range(6)]
    accuracies = topk_accuracies(scores, [1, 3, 6])
    assert accuracies == {k: sum(r < k for r in ranks) / 6 for k in (1, 3, 6)}
    assert accuracies[6] == 1.0


def ict_batch(generator: torch.Generator, batch: int, vocab: int = 128, length: int = 20):
    """Synthetic ICT pairs: a block of random words; its query, 5 of the block's words."""
    blocks = torch.randint(5, vocab, (batch, length), generator=generator)
    blocks[:, 0] = 1  # [CLS]
    picks = torch.stack(
        [torch.randperm(length - 1, generator=generator)[:5] + 1 for _ in range(batch)]
    )
    queries = torch.cat([torch.ones(batch, 1, dtype=torch.long), blocks.gather(1, picks)], dim=1)
    return queries, torch.ones_like(queries), blocks, torch.ones_like(blocks)


@pytest.mark.parametrize("towers, score_scaling", [("shared", False), ("from-one-bert", True)])
def test_ict_fits_a_batch(towers, score_scaling):
    """The loss trains both towers: 30 Adam steps on one batch of 16 pairs take its ICT loss
    from chance (ln 16) to a small fraction of it and rank most blocks first. Towers: one
    shared, or two started from one BERT as --bert-load starts them."""
    torch.manual_seed(0)
    config = tiny_config()
    model = BiEncoderModel(config, shared=towers == "shared")
    if towers == "from-one-bert":
        model.load_bert(BertModel(config).state_dict())
    batch = ict_batch(torch.Generator().manual_seed(0), 16)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        q, c = model.train()(*batch)
        scores = retrieval_scores(q, c, config.hidden_size if score_scaling else None)
        loss = ict_loss(scores)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    top1 = topk_accuracies(scores.detach(), [1])[1]
    print(f"{towers}: ICT loss {losses[0]:.3f} -> {losses[-1]:.3f} in 30 steps, top-1 {top1:.2f}")
    assert abs(losses[0] - math.log(16)) < 0.1
    assert losses[-1] < 0.3 * math.log(16) and top1 >= 0.75
