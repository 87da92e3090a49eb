"""`mg-convert import-hf` of a LlavaForConditionalGeneration (random init by transformers):
the imported LLaVAModel's logits on a prompt with an image equal transformers'."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

from mg.ckpt_convert.errors import ConvertError
from mg.ckpt_convert.import_hf import import_hf
from mg.core.checkpoint import RELEASE, checkpoint_file
from mg.core.models.vision import LLaVAConfig, LLaVAModel

VOCAB, IMAGE = 100, 99
TOL = 1e-4


def _llava(tmp_path: Path, **overrides) -> tuple[LlavaForConditionalGeneration, Path]:
    torch.manual_seed(0)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
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
        **overrides,
    )
    model = LlavaForConditionalGeneration(config).eval()
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    return model, folder


def _load(save: Path) -> LLaVAModel:
    checkpoint = torch.load(checkpoint_file(save, RELEASE), weights_only=False)
    model = LLaVAModel(LLaVAConfig.from_dict(checkpoint["mg"]["model_config"])).eval()
    model.load_state_dict(checkpoint["model"])
    return model


@pytest.mark.parametrize("strategy", ["default", "full"])
def test_import_llava_logits_equal_transformers(tmp_path: Path, strategy: str) -> None:
    hf, folder = _llava(tmp_path, vision_feature_select_strategy=strategy)
    ours = _load(import_hf(str(folder), tmp_path / "mg", progress=False))
    rows = 16 if strategy == "default" else 17  # 4 × 4 patches (+ the class token)
    assert ours.config.image_tokens == rows
    assert ours.config.vision.num_layers == 2  # vision_feature_layer -2 of 3 layers
    assert ours.config.language.vocab_size == 128  # padded as Megatron pads
    images = torch.randn(1, 3, 56, 56, generator=torch.Generator().manual_seed(3))
    before, after = [1, 5, 17], [7, 8, 9, 42]
    hf_ids = torch.tensor([before + [IMAGE] * rows + after])
    our_ids = torch.tensor([before + [IMAGE] + after])
    with torch.no_grad():
        expected = hf(input_ids=hf_ids, pixel_values=images).logits
        got = ours(images, our_ids)[..., :VOCAB]
    assert got.shape == expected.shape == (1, 3 + rows + 4, VOCAB)
    err = (got - expected).abs().max().item()
    assert err < TOL, f"max |Δ logits| {err:.2e}"


def test_import_llava_refuses_a_list_of_feature_layers(tmp_path: Path) -> None:
    _, folder = _llava(tmp_path, vision_feature_layer=[-2, -1])
    with pytest.raises(ConvertError, match="vision_feature_layer .*a list"):
        import_hf(str(folder), tmp_path / "mg", progress=False)


def test_export_round_trip_is_bit_exact(tmp_path: Path) -> None:
    """import-hf then export-hf gives the source folder's tensors back bit for bit (the
    vision layer after the feature layer and CLIP's post_layernorm, unused by the
    model, kept aside by import), and transformers loads the result."""
    from safetensors.torch import load_file

    from mg.ckpt_convert.export_hf import export_hf

    hf, folder = _llava(tmp_path)
    import_hf(str(folder), tmp_path / "mg", progress=False)
    export_hf(tmp_path / "mg", tmp_path / "back", progress=False)
    source = load_file(str(folder / "model.safetensors"))
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(back) == sorted(source)
    for name, tensor in source.items():
        assert torch.equal(back[name], tensor), name
    again = LlavaForConditionalGeneration.from_pretrained(tmp_path / "back").eval()
    ids = torch.tensor([[1, 5] + [IMAGE] * 16 + [7, 8]])
    images = torch.randn(1, 3, 56, 56, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(
            again(input_ids=ids, pixel_values=images).logits,
            hf(input_ids=ids, pixel_values=images).logits,
        )
