"""T5Model: Megatron-Core names, shapes, mask semantics, overfitting, meta build."""

import pytest
import torch

from mg.core.models import TransformerConfig
from mg.core.models.t5 import T5Model

TINY = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    kv_channels=16,  # heads·kv_channels (64) != hidden: exercises --kv-channels
    ffn_hidden_size=48,
    vocab_size=64,
    seq_length=12,
    decoder_seq_length=8,
    max_position_embeddings=16,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    enc = torch.randint(1, 64, (2, 12), generator=g)
    dec = torch.randint(1, 64, (2, 8), generator=g)
    labels = torch.randint(1, 64, (2, 8), generator=g)
    enc_mask = torch.ones(2, 12, dtype=torch.long)
    enc_mask[1, -4:] = 0
    dec_mask = torch.ones(2, 8, dtype=torch.long)
    dec_mask[1, -3:] = 0
    return enc, dec, labels, enc_mask, dec_mask


def _model(**overrides):
    torch.manual_seed(0)
    return T5Model(TransformerConfig(**(TINY | overrides)))


def test_names_and_shapes():
    model = _model().eval()
    names = set(model.state_dict())
    for name in (
        "embedding.word_embeddings.weight",
        "embedding.position_embeddings.weight",
        "encoder.layers.0.self_attention.linear_qkv.weight",
        "encoder.final_layernorm.weight",
        "decoder.layers.1.input_layernorm.weight",
        "decoder.layers.1.self_attention.linear_qkv.weight",
        "decoder.layers.1.pre_cross_attn_layernorm.weight",
        "decoder.layers.1.cross_attention.linear_q.weight",
        "decoder.layers.1.cross_attention.linear_kv.weight",
        "decoder.layers.1.cross_attention.linear_proj.weight",
        "decoder.layers.1.pre_mlp_layernorm.weight",
        "decoder.layers.1.mlp.linear_fc1.weight",
        "decoder.final_layernorm.weight",
        "lm_head.output_layer.bias",
    ):
        assert name in names, name
    assert "lm_head.output_layer.weight" not in names  # tied
    assert model.decoder.layers[0].cross_attention.linear_kv.weight.shape == (128, 32)
    enc, dec, labels, enc_mask, dec_mask = _batch()
    logits = model(enc, dec, enc_mask, dec_mask, enc_mask)
    assert logits.shape == (2, 8, 64)
    loss = model(enc, dec, enc_mask, dec_mask, enc_mask, lm_labels=labels)
    assert loss.shape == (2, 8) and loss.dtype == torch.float32


def test_padded_encoder_position_does_not_change_output():
    model = _model().eval()
    enc, dec, _, enc_mask, dec_mask = _batch()
    ref = model(enc, dec, enc_mask, dec_mask, enc_mask)
    other = enc.clone()
    other[1, -4:] = (other[1, -4:] + 5) % 64
    out = model(other, dec, enc_mask, dec_mask, enc_mask)
    torch.testing.assert_close(out, ref)
    # ... while a real encoder position does change every decoder position
    other[1, 0] = (other[1, 0] + 5) % 64
    out = model(other, dec, enc_mask, dec_mask, enc_mask)
    assert not torch.allclose(out[1, 0], ref[1, 0])


def test_decoder_is_causal_and_4d_masks_agree():
    model = _model().eval()
    enc, dec, _, enc_mask, dec_mask = _batch()
    ref = model(enc, dec, enc_mask, dec_mask, enc_mask)
    later = dec.clone()
    later[:, 5:] = (later[:, 5:] + 3) % 64
    out = model(enc, later, enc_mask, dec_mask, enc_mask)
    torch.testing.assert_close(out[:, :5], ref[:, :5])
    assert not torch.allclose(out[:, 5:], ref[:, 5:])
    # Megatron-style 4-D masks (True = masked, padded queries fully masked) agree
    # with the padding form on every real position.
    enc_real, dec_real = enc_mask.bool(), dec_mask.bool()
    enc4 = ~(enc_real[:, None, :, None] & enc_real[:, None, None, :])
    encdec4 = ~(dec_real[:, None, :, None] & enc_real[:, None, None, :])
    dec4 = ~(dec_real[:, None, :, None] & dec_real[:, None, None, :])
    out4 = model(enc, dec, enc4, dec4, encdec4)
    assert torch.isfinite(out4).all()
    torch.testing.assert_close(out4[dec_real], ref[dec_real])


def test_loss_decreases_on_tiny_batch():
    model = _model()
    enc, dec, labels, enc_mask, dec_mask = _batch()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = model(enc, dec, enc_mask, dec_mask, enc_mask, lm_labels=labels)
        loss = (loss * dec_mask).sum() / dec_mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0], losses


def test_meta_device_build_and_untied():
    with torch.device("meta"):
        model = T5Model(TransformerConfig(**TINY, untie_embeddings_and_output_weights=True))
    assert model.lm_head.output_layer.weight.is_meta
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    enc, dec, labels, enc_mask, dec_mask = _batch()
    loss = model(enc, dec, enc_mask, dec_mask, enc_mask, lm_labels=labels)
    assert torch.isfinite(loss).all()


def test_decoder_seq_length_is_validated():
    from mg.core.models import ConfigError

    with pytest.raises(ConfigError, match="decoder_seq_length"):
        TransformerConfig(**(TINY | {"decoder_seq_length": 17}))
