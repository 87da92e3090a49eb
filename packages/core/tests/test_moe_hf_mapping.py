"""Mixtral, Qwen3-MoE and Qwen2-MoE ↔ Megatron-Core names: logits parity with transformers
and bit-exact round trips of the weights as `save_pretrained` writes them (one tensor per
expert; transformers 5 fuses them only in memory).

Each HF model is randomly initialised with tiny shapes and every parameter perturbed, so
norms and routers are not trivially equal; the routers' logits are spread so that no
top-k choice is a near tie.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mg.core.models import GPTModel  # noqa: E402
from mg.core.models.hf_mapping import (  # noqa: E402
    config_from_hf,
    config_to_hf,
    hf_to_megatron,
    megatron_to_hf,
)
from mg.core.testing.hf_moe import HF_MOE_MODELS  # noqa: E402

pytestmark = pytest.mark.compat

TINY = dict(
    num_hidden_layers=3,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=96,
    max_position_embeddings=64,
    attn_implementation="eager",
)


MODELS = {family: functools.partial(build, **TINY) for family, build in HF_MOE_MODELS.items()}


def _saved_state(model) -> dict[str, torch.Tensor]:
    """The state dict as save_pretrained writes it (experts one by one)."""
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        return load_file(f"{folder}/model.safetensors")


def _perturbed(factory):
    torch.manual_seed(0)
    model = factory().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.5 if "gate" in name and "proj" not in name else 0.02))
    return model


@pytest.mark.parametrize("family", sorted(MODELS))
def test_logits_match_transformers(family):
    hf = _perturbed(MODELS[family])
    config = config_from_hf(hf.config, attention_dropout=0.0)
    assert config.num_moe_experts == 4
    state = hf_to_megatron(_saved_state(hf), config, family)
    model = GPTModel(config).eval()
    model.load_state_dict(state, strict=True)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", sorted(MODELS))
@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "grouped"])
def test_weights_round_trip_bit_exact(family, grouped):
    hf = _perturbed(MODELS[family])
    saved = _saved_state(hf)
    config = dataclasses.replace(config_from_hf(hf.config), moe_grouped_gemm=grouped)
    state = hf_to_megatron(saved, config, family)
    names = set(GPTModel(config).state_dict())
    assert set(state) == names
    if grouped:
        assert "decoder.layers.2.mlp.experts.linear_fc1.weight3" in state
    else:
        assert "decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight" in state
    back = megatron_to_hf(state, config, family)
    tied = {"lm_head.weight"} if not config.untie_embeddings_and_output_weights else set()
    assert set(back) == set(saved) - tied
    for name, tensor in back.items():
        assert torch.equal(tensor, saved[name]), name


@pytest.mark.parametrize("family", sorted(MODELS))
def test_config_round_trip_builds_the_same_hf_model(family):
    hf = MODELS[family]()
    config = config_from_hf(hf.config)
    again = config_to_hf(config, family)
    clone = type(hf)(type(hf.config)(**{**again, "attn_implementation": "eager"}))
    assert {k: v.shape for k, v in clone.state_dict().items()} == {
        k: v.shape for k, v in hf.state_dict().items()
    }
    assert config_from_hf(again) == config


def test_routing_hf_cannot_run_is_refused_on_export():
    config = config_from_hf(MODELS["mixtral"]().config)
    for change in (
        dict(moe_router_score_function="sigmoid"),
        dict(moe_router_topk_scaling_factor=2.0),
        dict(moe_expert_capacity_factor=1.0),
    ):
        with pytest.raises(ValueError, match="not what mixtral runs"):
            config_to_hf(dataclasses.replace(config, **change), "mixtral")
    dense = dataclasses.replace(config, num_moe_experts=None, moe_ffn_hidden_size=None)
    with pytest.raises(ValueError, match="needs mixture-of-experts"):
        config_to_hf(dense, "mixtral")
    with pytest.raises(ValueError, match="has no mixture-of-experts"):
        config_to_hf(config, "mistral")
