"""The ViT and projector against transformers' CLIP/SigLIP towers and LLaVA projector on
the same (random) weights, fp32; the image-token splice and the text-only loss."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    CLIPVisionConfig,
    CLIPVisionModel,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    SiglipVisionConfig,
    SiglipVisionModel,
)

from mg.core.models import TransformerConfig
from mg.core.models.vision import (
    CLIPViTModel,
    LLaVAConfig,
    LLaVAModel,
    MultimodalProjector,
    VisionConfig,
    combine_text_and_images,
)
from mg.core.models.vision.hf_weights import (
    projector_from_hf,
    projector_to_hf,
    vision_config_from_hf,
    vision_from_hf,
    vision_to_hf,
)

TOL = 1e-5
TOWER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    image_size=56,
    patch_size=14,
)


def _tower(kind: str):
    torch.manual_seed(0)
    if kind == "clip":
        hf = CLIPVisionModel(CLIPVisionConfig(**TOWER))
    else:
        hf = SiglipVisionModel(SiglipVisionConfig(**TOWER))
    return hf.eval()


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_vit_features_equal_transformers(kind: str) -> None:
    hf = _tower(kind)
    config = vision_config_from_hf(hf.config)
    assert config.vision_model_type == kind
    ours = CLIPViTModel(config).eval()
    ours.load_state_dict(vision_from_hf(hf.state_dict(), config))
    images = torch.randn(2, 3, 56, 56, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(pixel_values=images).last_hidden_state
        got = ours(images)
    assert got.shape == expected.shape == (2, config.seq_length, 64)
    assert config.seq_length == (17 if kind == "clip" else 16)  # 4×4 patches (+ class)
    err = (got - expected).abs().max().item()
    assert err < TOL, f"{kind}: max |Δ| {err:.2e}"


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_vit_weights_round_trip_bit_exact(kind: str) -> None:
    hf = _tower(kind)
    config = vision_config_from_hf(hf.config)
    state = vision_from_hf(hf.state_dict(), config)
    back = vision_to_hf(state, config)
    for key, tensor in back.items():
        if key.startswith("post_layernorm") and kind == "clip":
            continue  # unused by the features; written as the identity
        assert torch.equal(tensor, hf.state_dict()[key]), key


def _llava() -> LlavaForConditionalGeneration:
    torch.manual_seed(0)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**TOWER),
        text_config=LlamaConfig(
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=100,
        ),
        image_token_id=99,
    )
    return LlavaForConditionalGeneration(config).eval()


def test_projected_image_features_equal_llava() -> None:
    """Layer -2's features without the class token, through the projector, equal
    LlavaForConditionalGeneration.get_image_features."""
    hf = _llava()
    layers = TOWER["num_hidden_layers"] + hf.config.vision_feature_layer + 1  # layer -2
    vision = vision_config_from_hf(hf.config.vision_config, num_layers=layers)
    sd = hf.state_dict()
    tower = CLIPViTModel(vision).eval()
    tower.load_state_dict(vision_from_hf(sd, vision, prefix="model.vision_tower."))
    projector = MultimodalProjector(64, 48, 48).eval()
    projector.load_state_dict(projector_from_hf(sd, prefix="model.multi_modal_projector."))
    images = torch.randn(3, 3, 56, 56, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf.model.get_image_features(pixel_values=images)
        expected = torch.stack(list(getattr(expected, "pooler_output", expected)))
        got = projector(tower(images)[:, 1:])  # "default" strategy: the class token dropped
    assert got.shape == expected.shape == (3, 16, 48)
    err = (got - expected).abs().max().item()
    assert err < TOL, f"max |Δ| {err:.2e}"
    back = projector_to_hf(projector.state_dict())
    for key, tensor in back.items():
        assert torch.equal(tensor, sd[f"model.multi_modal_projector.{key}"])


def test_combine_expands_image_tokens_and_masks_their_loss() -> None:
    """Megatron's example: input [0, 1, I, 2, 3], labels [1, I, 2, 3, 4] with a
    one-row image → labels [1, -, 2, 3, 4], loss mask [1, 0, 0, 1, 1]; with three rows
    per image the text moves two places right."""
    ids = torch.tensor([[0, 1, -200, 2, 3]])
    labels = torch.tensor([[1, -200, 2, 3, 4]])
    one = combine_text_and_images(ids, -200, 1, 100, labels)
    assert one.input_ids.tolist() == [[0, 1, 0, 2, 3]]
    assert one.image_rows.tolist() == [[False, False, True, False, False]]
    assert one.labels.tolist() == [[1, 0, 0, 3, 4]]
    assert one.loss_mask.tolist() == [[1, 0, 0, 1, 1]]
    three = combine_text_and_images(ids, -200, 3, 100, labels)
    assert three.input_ids.tolist() == [[0, 1, 0, 0, 0, 2, 3]]
    assert three.image_rows[0].nonzero().flatten().tolist() == [2, 3, 4]
    assert three.loss_mask.tolist() == [[1, 0, 0, 0, 0, 1, 1]]
    assert three.labels[0, [0, 5, 6]].tolist() == [1, 3, 4]
    # a batch: rows of different lengths are padded at the end with no loss, and cut
    ids2 = torch.tensor([[-200, 5, 6], [7, 8, 9]])
    both = combine_text_and_images(ids2, -200, 3, 4, torch.tensor([[5, 6, 1], [8, 9, 1]]))
    assert both.input_ids.tolist() == [[0, 0, 0, 5], [7, 8, 9, 0]]
    assert both.loss_mask.tolist() == [[0, 0, 0, 1], [1, 1, 1, 0]]


def _tiny_llava(kind: str = "clip", drop: bool = False) -> LLaVAModel:
    torch.manual_seed(0)
    language = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=64,
        seq_length=64,
        position_embedding_type="rope",
        normalization="RMSNorm",
        activation="swiglu",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    vision = VisionConfig(
        vision_model_type=kind,
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=32,
        img_h=28,
        img_w=28,
        patch_dim=14,
    )
    return LLaVAModel(LLaVAConfig(language, vision, drop_vision_class_token=drop)).eval()


def test_llava_image_rows_are_the_projected_features() -> None:
    """The logits equal the language model's on embeddings with the projector's output
    written at the image rows; the loss is the logits' cross entropy on text only."""
    model = _tiny_llava()
    assert model.config.image_tokens == 5
    images = torch.randn(1, 3, 28, 28)
    ids = torch.tensor([[3, -200, 7, 8]])
    labels = torch.tensor([[-200, 7, 8, 9]])
    with torch.no_grad():
        logits = model(images, ids)
        lm = model.language_model
        rows = torch.cat(
            [
                lm.embedding.word_embeddings(torch.tensor([[3]])),
                model.image_embeddings(images),
                lm.embedding.word_embeddings(torch.tensor([[7, 8]])),
            ],
            dim=1,
        )
        pos = torch.arange(8).unsqueeze(0)
        expected = lm.output_and_loss(lm.run_decoder(rows, pos, None), None)
        losses, mask = model(images, ids, labels=labels)
    assert logits.shape == (1, 8, 64)
    assert torch.allclose(logits, expected, atol=1e-6)
    assert mask.tolist() == [[0, 0, 0, 0, 0, 0, 1, 1]]
    ce = torch.nn.functional.cross_entropy(logits[0, 6:], torch.tensor([8, 9]), reduction="none")
    assert torch.allclose(losses[0, 6:], ce, atol=1e-5)


def test_llava_refuses_more_image_tokens_than_images() -> None:
    model = _tiny_llava()
    with pytest.raises(ValueError, match="2 image tokens .* but 1 images"):
        model(torch.randn(1, 3, 28, 28), torch.tensor([[-200, 1, -200]]))


def test_llava_dropped_class_token_and_siglip_rows() -> None:
    assert _tiny_llava("clip", drop=True).config.image_tokens == 4
    assert _tiny_llava("siglip").config.image_tokens == 4
    with pytest.raises(ValueError, match="SigLIP tower has no class token"):
        _tiny_llava("siglip", drop=True)


def test_llava_freeze_leaves_no_trainable_parameters_in_the_towers() -> None:
    model = _tiny_llava()
    model.freeze(freeze_language_model=True, freeze_vision_model=True)
    trainable = {n.split(".")[0] for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"vision_projection"}
