"""GPTModel: names, shapes, loss, init, meta-device build, attention options."""

import math

import pytest
import torch
import torch.nn.functional as F

from mg.core.models import GPTModel, presets
from mg.core.models.core_attention import BackendUnavailableError, SDPAttention


def _ids(config, b=2, s=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (b, s), generator=g)


def test_parameter_names_are_megatron_core_local_spec_names():
    model = GPTModel(presets.tiny_llama(num_layers=1))
    assert sorted(model.state_dict()) == sorted(
        [
            "embedding.word_embeddings.weight",
            "decoder.layers.0.input_layernorm.weight",
            "decoder.layers.0.self_attention.linear_qkv.weight",
            "decoder.layers.0.self_attention.linear_proj.weight",
            "decoder.layers.0.pre_mlp_layernorm.weight",
            "decoder.layers.0.mlp.linear_fc1.weight",
            "decoder.layers.0.mlp.linear_fc2.weight",
            "decoder.final_layernorm.weight",
            "output_layer.weight",
        ]
    )
    c = model.config
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["decoder.layers.0.self_attention.linear_qkv.weight"] == (16 * (4 + 2 * 2), 64)
    assert shapes["decoder.layers.0.mlp.linear_fc1.weight"] == (2 * c.ffn_hidden_size, 64)


def test_gpt2_has_biases_positions_and_tied_output():
    model = GPTModel(presets.tiny_gpt2(num_layers=1))
    names = set(model.state_dict())
    assert "embedding.position_embeddings.weight" in names
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in names
    assert "decoder.final_layernorm.bias" in names
    assert "output_layer.weight" not in names  # tied: Megatron has no separate tensor
    assert model.output_weight() is model.embedding.word_embeddings.weight
    assert isinstance(model.decoder.layers, torch.nn.ModuleList)


@pytest.mark.parametrize("preset", [presets.tiny_gpt2, presets.tiny_llama, presets.tiny_mistral])
def test_loss_with_labels_is_per_token_cross_entropy(preset):
    torch.manual_seed(0)
    model = GPTModel(preset()).eval()
    ids, labels = _ids(model.config), _ids(model.config, seed=1)
    logits = model(ids)
    loss = model(ids, labels=labels)
    assert logits.shape == (2, 16, model.config.vocab_size)
    assert loss.shape == (2, 16) and loss.dtype == torch.float32
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    torch.testing.assert_close(loss, expected.view(2, 16), rtol=0, atol=1e-6)


def test_meta_device_build_then_init():
    config = presets.tiny_llama()
    with torch.device("meta"):
        model = GPTModel(config)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    eager = GPTModel(config)  # same seed → same weights, however the model was built
    torch.manual_seed(0)
    eager.init_weights()
    for (name, a), b in zip(model.state_dict().items(), eager.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert torch.isfinite(model(_ids(config))).all()


def test_init_follows_megatron():
    config = presets.tiny_gpt2(num_layers=8, hidden_size=256, num_attention_heads=4)
    torch.manual_seed(0)
    model = GPTModel(config)
    std = config.init_method_std
    layer = model.decoder.layers[3]
    out_std = std / math.sqrt(2 * config.num_layers)
    assert layer.self_attention.linear_qkv.weight.std().item() == pytest.approx(std, rel=0.05)
    assert layer.mlp.linear_fc1.weight.std().item() == pytest.approx(std, rel=0.05)
    assert layer.self_attention.linear_proj.weight.std().item() == pytest.approx(out_std, rel=0.05)
    assert layer.mlp.linear_fc2.weight.std().item() == pytest.approx(out_std, rel=0.05)
    assert model.embedding.word_embeddings.weight.std().item() == pytest.approx(std, rel=0.05)
    assert torch.equal(layer.input_layernorm.weight, torch.ones(256))
    assert torch.equal(layer.input_layernorm.bias, torch.zeros(256))
    assert not layer.self_attention.linear_qkv.bias.any()
    assert not layer.mlp.linear_fc2.bias.any()


def test_sdpa_sliding_window_matches_explicit_reference():
    """Check the windowed SDPA against a hand-written softmax with the same band."""
    config = presets.tiny_mistral(attention_dropout=0.0)
    attention = SDPAttention(config).eval()
    torch.manual_seed(0)
    b, s, d = 2, 20, config.kv_channels
    q = torch.randn(b, s, 4, d)
    k, v = torch.randn(b, s, 2, d), torch.randn(b, s, 2, d)
    out = attention(q, k, v)
    kr, vr = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kr) / math.sqrt(d)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    band = (j <= i) & (j >= i - 7)
    probs = scores.masked_fill(~band, float("-inf")).softmax(-1)
    expected = torch.einsum("bhqk,bkhd->bqhd", probs, vr).reshape(b, s, -1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_attention_mask_true_means_masked():
    """A Megatron-style mask equal to the causal mask changes nothing; masking
    the first token for everyone changes the output."""
    torch.manual_seed(0)
    model = GPTModel(presets.tiny_llama()).eval()
    ids = _ids(model.config)
    causal = torch.triu(torch.ones(16, 16, dtype=torch.bool), diagonal=1)[None, None]
    torch.testing.assert_close(model(ids, attention_mask=causal), model(ids), rtol=0, atol=1e-6)
    no_first = causal.clone()
    no_first[..., 1:, 0] = True
    assert not torch.allclose(model(ids, attention_mask=no_first), model(ids))


def test_position_ids_shift_learned_positions():
    torch.manual_seed(0)
    model = GPTModel(presets.tiny_gpt2()).eval()
    ids = _ids(model.config)
    default = model(ids)
    explicit = model(ids, position_ids=torch.arange(16).expand(2, 16))
    assert torch.equal(default, explicit)
    assert not torch.allclose(model(ids, position_ids=torch.arange(1, 17).expand(2, 16)), default)


def test_bf16_forward_and_backward():
    torch.manual_seed(0)
    model = GPTModel(presets.tiny_llama()).to(torch.bfloat16)
    loss = model(_ids(model.config), labels=_ids(model.config, seed=1))
    loss.mean().backward()
    assert loss.dtype == torch.float32
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_gpu_backends_say_what_is_missing():
    """On a machine without CUDA the CUDA kernels are refused by flag name at the first
    forward (mg.core.models.attention_backend; its tests cover the rest)."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    model = GPTModel(presets.tiny_llama(attention_backend="flash"))
    with pytest.raises(BackendUnavailableError, match="--attention-backend flash"):
        model(_ids(model.config))
