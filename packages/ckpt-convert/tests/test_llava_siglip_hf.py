"""`mg-convert import-hf/export-hf` of a `LlavaForConditionalGeneration` with a SigLIP
vision tower (random init by transformers): logits equal transformers' on a prompt
with an image, and the export gives the source tensors back bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, SiglipVisionConfig

from mg.ckpt_convert.errors import ConvertError
from mg.ckpt_convert.export_hf import export_hf
from mg.ckpt_convert.import_hf import import_hf
from mg.core.checkpoint import RELEASE, checkpoint_file
from mg.core.models.vision import LLaVAConfig, LLaVAModel

VOCAB, IMAGE = 100, 99
ROWS = 16  # 4 × 4 patches, no class token
TOL = 1e-4


def _llava(tmp_path: Path, **overrides) -> tuple[LlavaForConditionalGeneration, Path]:
    torch.manual_seed(0)
    config = LlavaConfig(
        vision_config=SiglipVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            image_size=56,
            patch_size=14,
        ),
        text_config=LlamaConfig(
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=128,
        ),
        image_token_id=IMAGE,
        **{"vision_feature_select_strategy": "full", "vision_feature_layer": -1, **overrides},
    )
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # transformers inits LayerNorms to the identity: make them count
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    return model, folder


def _load(save: Path) -> LLaVAModel:
    checkpoint = torch.load(checkpoint_file(save, RELEASE), weights_only=False)
    model = LLaVAModel(LLaVAConfig.from_dict(checkpoint["mg"]["model_config"])).eval()
    model.load_state_dict(checkpoint["model"])
    return model


@pytest.mark.parametrize("layer", [-1, -2])
def test_import_llava_siglip_logits_equal_transformers(tmp_path: Path, layer: int) -> None:
    hf, folder = _llava(tmp_path, vision_feature_layer=layer)
    ours = _load(import_hf(str(folder), tmp_path / "mg", progress=False))
    assert ours.config.vision.vision_model_type == "siglip"
    assert ours.config.vision.num_layers == 3 + layer + 1
    assert ours.config.image_tokens == ROWS
    images = torch.randn(1, 3, 56, 56, generator=torch.Generator().manual_seed(3))
    before, after = [1, 5, 17], [7, 8, 9, 42]
    hf_ids = torch.tensor([before + [IMAGE] * ROWS + after])
    our_ids = torch.tensor([before + [IMAGE] + after])
    with torch.no_grad():
        expected = hf(input_ids=hf_ids, pixel_values=images).logits
        got = ours(images, our_ids)[..., :VOCAB]
    assert got.shape == expected.shape == (1, 3 + ROWS + 4, VOCAB)
    err = (got - expected).abs().max().item()
    assert err < TOL, f"max |Δ logits| {err:.2e}"


def test_export_llava_siglip_round_trip_is_bit_exact(tmp_path: Path) -> None:
    """SigLIP's post_layernorm and pooling head, unread by LLaVA, come back as they were."""
    hf, folder = _llava(tmp_path)
    import_hf(str(folder), tmp_path / "mg", progress=False)
    export_hf(tmp_path / "mg", tmp_path / "back", progress=False)
    source = load_file(str(folder / "model.safetensors"))
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert any("post_layernorm" in k for k in source) and any(".head." in k for k in source)
    assert sorted(back) == sorted(source)
    for name, tensor in source.items():
        assert torch.equal(back[name], tensor), name
    again = LlavaForConditionalGeneration.from_pretrained(tmp_path / "back").eval()
    ids = torch.tensor([[1, 5] + [IMAGE] * ROWS + [7, 8]])
    images = torch.randn(1, 3, 56, 56, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(
            again(input_ids=ids, pixel_values=images).logits,
            hf(input_ids=ids, pixel_values=images).logits,
        )


def test_a_siglip_tower_with_the_default_strategy_is_refused(tmp_path: Path) -> None:
    _, folder = _llava(tmp_path, vision_feature_select_strategy="default")
    with pytest.raises(ConvertError, match="SigLIP tower has none"):
        import_hf(str(folder), tmp_path / "mg", progress=False)
