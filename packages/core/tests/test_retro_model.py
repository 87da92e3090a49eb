"""RetroModel's structure and causality (the equality with megatron-core 0.15 is in
test_retro_model_megatron.py)."""

from __future__ import annotations

import pytest
import torch

from mg.core.models import GPTModel, TransformerConfig
from mg.core.models.config import ConfigError
from mg.core.models.retro import RetroConfig, RetroDecoderLayer, RetroModel

SHAPE = dict(
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=48,
    vocab_size=64,
    seq_length=16,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)
RETRO = dict(
    retro_chunk_length=4,
    retro_num_neighbors=2,
    retro_num_retrieved_chunks=2,
    retro_encoder_hidden_dropout=0.0,
    retro_encoder_attention_dropout=0.0,
)


@pytest.mark.parametrize(
    ("num_layers", "expected"),
    [(6, [6]), (12, [6, 9, 12]), (15, [6, 9, 12, 15]), (24, [9, 12, 15, 18, 21, 24])],
)
def test_retro_layers_at_megatrons_positions(num_layers: int, expected: list[int]) -> None:
    config = RetroConfig(num_layers=num_layers, **SHAPE, **RETRO)
    assert config.retro_layer_numbers == expected
    with torch.device("meta"):
        model = RetroModel(config)
    found = [
        i + 1
        for i, layer in enumerate(model.decoder.layers)
        if isinstance(layer, RetroDecoderLayer)
    ]
    assert found == expected
    encoders = [
        layer.cross_attention.encoder is not None
        for layer in model.decoder.layers
        if isinstance(layer, RetroDecoderLayer)
    ]
    assert encoders == [True] + [False] * (len(expected) - 1)


def test_too_few_layers_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="num_layers.*--num-layers 6"):
        RetroConfig(num_layers=4, **SHAPE, **RETRO)


def test_gpt_weights_load_into_retro_leaving_only_retro_weights() -> None:
    """Retro-fitting: a GPTModel's state dict loads (strictly) into a RetroModel: every
    GPT weight is taken, the Retro weights keep their initialisation."""
    gpt = GPTModel(TransformerConfig(num_layers=6, **SHAPE))
    retro = RetroModel(RetroConfig(num_layers=6, **SHAPE, **RETRO))
    before = {k: v.clone() for k, v in retro.state_dict().items()}
    retro.load_state_dict(gpt.state_dict())
    after, taken = retro.state_dict(), gpt.state_dict()
    new = [k for k in after if k not in taken]
    assert new and all(".cross_attention." in k or ".pre_cross_attn_layernorm." in k for k in new)
    assert all(torch.equal(after[k], before[k]) for k in new)
    assert all(torch.equal(after[k], taken[k]) for k in after if k in taken)
    retro_dict = dict(after)
    del retro_dict[new[0]]
    with pytest.raises(RuntimeError, match="Missing key"):  # a Retro state dict stays strict
        retro.load_state_dict(retro_dict)


def test_a_chunk_sees_its_neighbours_only_from_its_last_token_on() -> None:
    """Changing chunk 1's neighbours changes the logits of tokens 2m-1 … 3m-2 only: from
    chunk 1's last token on (Retro's causal shift), and, with the one Retro layer last,
    not beyond the next chunk's window."""
    torch.manual_seed(0)
    config = RetroConfig(num_layers=6, **SHAPE, **RETRO)
    model = RetroModel(config).eval()
    b, s, m, k, r = 1, 16, 4, 2, 8
    tokens = torch.randint(0, 64, (b, s))
    neighbours = torch.randint(0, 64, (b, s // m, k, r))
    changed = neighbours.clone()
    changed[:, 1] = torch.randint(0, 64, (b, k, r))
    with torch.no_grad():
        before = model(tokens, context_input_ids=neighbours)
        after = model(tokens, context_input_ids=changed)
    differs = (before - after).abs().amax(dim=(0, 2)) > 0
    assert differs.nonzero().flatten().tolist() == list(range(2 * m - 1, 3 * m - 1))


def test_attention_gate_zero_shuts_the_neighbours_out() -> None:
    """--retro-attention-gate scales the chunked cross-attention: at 0 the neighbours
    change nothing, at 1 they do."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (1, 16))
    neighbours = torch.randint(0, 64, (1, 4, 2, 8))
    other = torch.randint(0, 64, (1, 4, 2, 8))
    for gate, changes in ((0.0, False), (1.0, True)):
        torch.manual_seed(0)
        model = RetroModel(RetroConfig(num_layers=6, **SHAPE, **RETRO, retro_attention_gate=gate))
        with torch.no_grad():
            a = model(tokens, context_input_ids=neighbours)
            b = model(tokens, context_input_ids=other)
        assert torch.equal(a, b) is not changes
