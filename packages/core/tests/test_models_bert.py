"""BertModel: shapes, padding semantics, meta build, and parity with HF BERT.

HF parity: a randomly initialised `BertForPreTraining` (every parameter
perturbed so norms/biases are not trivially 1/0) loads into a post-LN BertModel
through `bert_state_dict_from_hf`; MLM logits, binary logits and hidden states
must agree to 1e-4. The real MiniLM-L6 (FIXTURES.md) must give transformers'
BertModel hidden states on real text tokenized by our WordPiece tokenizer.
"""

import json

import pytest
import torch

from mg.core.models import TransformerConfig
from mg.core.models.bert import BertModel, bert_config_from_hf, bert_state_dict_from_hf

TINY = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=64,
    seq_length=16,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)


def _batch(b=2, s=16, vocab=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    types = torch.zeros(b, s, dtype=torch.long)
    types[:, s // 2 :] = 1
    mask = torch.ones(b, s, dtype=torch.long)
    mask[1, -5:] = 0
    return ids, mask, types


@pytest.mark.parametrize("order", ["pre_ln", "post_ln"])
def test_shapes_and_names(order):
    torch.manual_seed(0)
    model = BertModel(TransformerConfig(**TINY, transformer_layer_order=order)).eval()
    ids, mask, types = _batch()
    logits, binary = model(ids, mask, types)
    assert logits.shape == (2, 16, 64) and binary.shape == (2, 2)
    loss, _ = model(ids, mask, types, lm_labels=ids)
    assert loss.shape == (2, 16) and loss.dtype == torch.float32
    names = set(model.state_dict())
    for name in (
        "embedding.word_embeddings.weight",
        "embedding.position_embeddings.weight",
        "embedding.tokentype_embeddings.weight",
        "lm_head.dense.weight",
        "lm_head.layer_norm.weight",
        "output_layer.bias",
        "pooler.dense.weight",
        "binary_head.weight",
        "encoder.layers.1.self_attention.linear_qkv.weight",
        "encoder.layers.1.mlp.linear_fc2.bias",
    ):
        assert name in names
    assert "output_layer.weight" not in names  # tied to the word embeddings
    if order == "pre_ln":
        assert "encoder.final_layernorm.weight" in names
        assert "encoder.layers.0.input_layernorm.weight" in names


def test_no_binary_head():
    model = BertModel(TransformerConfig(**TINY), add_binary_head=False).eval()
    ids, mask, types = _batch()
    _, binary = model(ids, mask, types)
    assert binary is None and "binary_head.weight" not in model.state_dict()


def test_padding_does_not_change_real_positions():
    """Changing the tokens at padded positions leaves every real position as it was,
    and attention is bidirectional (a later token changes an earlier output)."""
    torch.manual_seed(0)
    model = BertModel(TransformerConfig(**TINY)).eval()
    ids, mask, types = _batch()
    logits, binary = model(ids, mask, types)
    other = ids.clone()
    other[1, -5:] = (other[1, -5:] + 7) % 64
    logits2, binary2 = model(other, mask, types)
    torch.testing.assert_close(logits2[1, :-5], logits[1, :-5])
    torch.testing.assert_close(binary2, binary)
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 64
    logits3, _ = model(changed, mask, types)
    assert not torch.allclose(logits3[0, 0], logits[0, 0])


def test_meta_device_build():
    with torch.device("meta"):
        model = BertModel(TransformerConfig(**TINY))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    ids, mask, types = _batch()
    loss, _ = model(ids, mask, types, lm_labels=ids)
    assert torch.isfinite(loss).all()


def test_loss_decreases():
    torch.manual_seed(0)
    model = BertModel(TransformerConfig(**TINY))
    ids, mask, types = _batch()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    labels = torch.tensor([0, 1])
    losses = []
    for _ in range(30):
        lm, binary = model(ids, mask, types, lm_labels=ids)
        loss = (lm * mask).sum() / mask.sum() + torch.nn.functional.cross_entropy(binary, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


transformers = pytest.importorskip("transformers")


@pytest.mark.compat
def test_against_hf_bert_for_pretraining():
    hf_config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=32,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    hf = transformers.BertForPreTraining(hf_config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    config = bert_config_from_hf(hf_config, attention_dropout=0.0, hidden_dropout=0.0)
    ours = BertModel(config).eval()
    state = bert_state_dict_from_hf(hf.state_dict(), config)
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert missing == [] and unexpected == []
    torch.testing.assert_close(
        ours.embedding.word_embeddings.weight, hf.cls.predictions.decoder.weight
    )

    ids, mask, types = _batch(s=20)
    ref = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, output_hidden_states=True)
    logits, binary = ours(ids, mask, types)
    real = mask.bool()
    assert (logits - ref.prediction_logits)[real].abs().max() <= 1e-4
    assert (binary - ref.seq_relationship_logits).abs().max() <= 1e-4
    hidden = ours.encode(ids, mask, types)
    assert (hidden - ref.hidden_states[-1])[real].abs().max() <= 1e-4


@pytest.mark.compat
def test_real_minilm_hidden_states_match_transformers():
    from mg.core.fixtures import fixture_dir
    from mg.core.tokenizers import TokenizerConfig, build_tokenizer

    folder = fixture_dir("minilm-bert")
    hf_config = json.loads((folder / "config.json").read_text())
    hf = transformers.BertModel.from_pretrained(folder, attn_implementation="eager").eval()
    config = bert_config_from_hf(hf_config, attention_dropout=0.0, hidden_dropout=0.0)
    ours = BertModel(config).eval()
    state = bert_state_dict_from_hf(hf.state_dict(), config)
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert unexpected == []
    assert sorted(missing) == sorted(  # MiniLM ships no MLM or binary head
        ["lm_head.dense.weight", "lm_head.dense.bias", "lm_head.layer_norm.weight"]
        + ["lm_head.layer_norm.bias", "output_layer.bias", "binary_head.weight"]
        + ["binary_head.bias"]
    )

    tok = build_tokenizer(
        TokenizerConfig("BertWordPieceLowerCase", vocab_file=str(folder / "vocab.txt"))
    )
    texts = [
        "The quick brown fox jumps over the lazy dog.",
        "Megatron-LM trains transformer language models at scale; BERT is one of them.",
    ]
    rows = [[tok.cls, *tok.tokenize(t), tok.sep] for t in texts]
    s = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad] * (s - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (s - len(r)) for r in rows])
    types = torch.zeros_like(ids)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        hidden = ours.encode(ids, mask, types)
    diff = (hidden - ref)[mask.bool()].abs().max().item()
    assert diff <= 1e-4, diff
    assert ids[1].tolist().count(tok.pad) == 0 and ids[0, -1] == tok.pad  # padding exercised
