"""`mg-convert import-hf` of a vision tower alone (`CLIPVisionModel`,
`SiglipVisionModel`, random init by transformers) and `mg-convert combine-vlm`, Megatron's
"combine checkpoints" step: a converted language model and a converted tower, from
which `mg-train vlm --pretrained-checkpoint` starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    CLIPVisionConfig,
    CLIPVisionModel,
    LlamaConfig,
    LlamaForCausalLM,
    SiglipVisionConfig,
    SiglipVisionModel,
    ViTConfig,
    ViTModel,
)

from mg.ckpt_convert.cli import main
from mg.ckpt_convert.combine_vlm import combine_vlm
from mg.ckpt_convert.errors import ConvertError
from mg.ckpt_convert.import_hf import import_hf
from mg.core.checkpoint import RELEASE, checkpoint_file, mg_metadata
from mg.core.checkpoint.layout import tracker_file
from mg.core.models.vision import CLIPViTModel, VisionConfig

TOL = 1e-5
TOWER = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)


def _tower(kind: str, folder: Path, image_size: int = 28) -> torch.nn.Module:
    torch.manual_seed(0)
    shape = dict(TOWER, image_size=image_size, patch_size=14)
    if kind == "clip":
        model = CLIPVisionModel(CLIPVisionConfig(**shape))
    else:
        model = SiglipVisionModel(SiglipVisionConfig(**shape))
    with torch.no_grad():  # transformers inits LayerNorms to the identity: make them count
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.eval().save_pretrained(folder)
    return model


def _release(save: Path) -> dict:
    return torch.load(checkpoint_file(save, RELEASE), weights_only=False)


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_imported_tower_features_equal_transformers(tmp_path: Path, kind: str) -> None:
    hf = _tower(kind, tmp_path / "hf", image_size=56)
    checkpoint = _release(import_hf(str(tmp_path / "hf"), tmp_path / "mg", progress=False))
    config = VisionConfig.from_dict(checkpoint["mg"]["model_config"])
    assert config.vision_model_type == kind and config.num_layers == 2
    ours = CLIPViTModel(config).eval()
    ours.load_state_dict(checkpoint["model"])
    images = torch.randn(2, 3, 56, 56, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(pixel_values=images).last_hidden_state
        got = ours(images)
    assert got.shape == expected.shape == (2, 17 if kind == "clip" else 16, 16)
    err = (got - expected).abs().max().item()
    assert err < TOL, f"{kind}: max |Δ| {err:.2e}"
    kept = checkpoint["hf_unused_tensors"]  # the pooling parts the features never use
    assert {"post_layernorm.weight"} <= set(kept) if kind == "clip" else "head.probe" in kept


def test_another_vision_class_is_refused_by_name(tmp_path: Path) -> None:
    ViTModel(ViTConfig(**TOWER, image_size=28, patch_size=14)).save_pretrained(tmp_path / "vit")
    with pytest.raises(ConvertError, match="ViTModel .*CLIPVisionModel and SiglipVisionModel"):
        import_hf(str(tmp_path / "vit"), tmp_path / "mg", progress=False)


def _language_model(folder: Path) -> None:
    torch.manual_seed(1)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=100,
        max_position_embeddings=64,
    )
    LlamaForCausalLM(config).save_pretrained(folder)


VLM = [
    "vlm",
    *("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"),
    *("--ffn-hidden-size", "64", "--untie-embeddings-and-output-weights"),
    *("--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu"),
    *("--disable-bias-linear", "--seq-length", "5", "--decoder-seq-length", "16"),
    *("--max-position-embeddings", "64", "--img-h", "28", "--img-w", "28", "--patch-dim", "14"),
    *("--vision-num-layers", "2", "--vision-hidden-size", "16"),
    *("--vision-num-attention-heads", "2", "--vision-ffn-hidden-size", "32"),
    *("--attention-dropout", "0", "--hidden-dropout", "0", "--mock-data"),
    *("--tokenizer-type", "NullTokenizer", "--vocab-size", "100"),
    *("--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-2"),
    *("--log-interval", "1000", "--eval-iters", "0", "--seed", "1234"),
]


@pytest.mark.slow  # two imports, the combine and a 2-iteration run: ~20 s on a loaded box
def test_mg_train_vlm_starts_from_the_combined_checkpoint(tmp_path: Path) -> None:
    """Megatron's recipe: the LM and the tower converted apart, combined without the
    projector; the run loads both towers' weights as converted (frozen, they stay so
    through 2 iterations) and starts the projector from its init."""
    pytest.importorskip("mg.trainer")
    from mg.trainer.arguments import parse_args
    from mg.trainer.training import Trainer

    _language_model(tmp_path / "llama")
    _tower("clip", tmp_path / "clip")
    import_hf(str(tmp_path / "llama"), tmp_path / "lm", progress=False)
    import_hf(str(tmp_path / "clip"), tmp_path / "vit", progress=False)
    combine = ["combine-vlm", "--input", str(tmp_path / "lm"), str(tmp_path / "vit")]
    main([*combine, "--prefixes", "language_model", "vision_model", "--save", f"{tmp_path}/vlm"])
    assert tracker_file(tmp_path / "vlm").read_text().strip() == "1"
    argv = [*VLM, "--train-iters", "2", "--data-cache-path", str(tmp_path / "cache")]
    argv += ["--freeze-LM", "--freeze-ViT", "--ckpt-format", "torch_dist"]
    argv += ["--load", str(tmp_path / "run"), "--pretrained-checkpoint", str(tmp_path / "vlm")]
    argv += ["--allow-missing-vision-projection-checkpoint"]
    trainer = Trainer(parse_args(argv))
    result = trainer.train()
    assert len(result.losses) == 2 and all(torch.isfinite(torch.tensor(result.losses)))
    state = trainer.model.state_dict()
    sources = {
        "language_model": _release(tmp_path / "lm"),
        "vision_model": _release(tmp_path / "vit"),
    }
    for prefix, source in sources.items():
        for name, tensor in source["model"].items():
            assert torch.equal(state[f"{prefix}.{name}"], tensor), f"{prefix}.{name}"


def _projector_checkpoint(folder: Path, out_size: int) -> None:
    model = {
        "encoder.linear_fc1.weight": torch.zeros(out_size, 16),
        "encoder.linear_fc1.bias": torch.zeros(out_size),
        "encoder.linear_fc2.weight": torch.zeros(out_size, out_size),
        "encoder.linear_fc2.bias": torch.zeros(out_size),
    }
    path = checkpoint_file(folder, RELEASE)
    path.parent.mkdir(parents=True)
    torch.save({"model": model, "mg": mg_metadata({"projector_type": "mlp"})}, path)
    tracker_file(folder).write_text(RELEASE)


def test_a_projector_for_another_hidden_size_is_named(tmp_path: Path) -> None:
    _language_model(tmp_path / "llama")
    _tower("siglip", tmp_path / "siglip")
    import_hf(str(tmp_path / "llama"), tmp_path / "lm", progress=False)
    import_hf(str(tmp_path / "siglip"), tmp_path / "vit", progress=False)
    _projector_checkpoint(tmp_path / "proj", out_size=48)
    inputs = [str(tmp_path / n) for n in ("lm", "vit", "proj")]
    prefixes = ["language_model", "vision_model", "vision_projection"]
    with pytest.raises(ConvertError, match=r"output size 48 .* hidden size 32"):
        combine_vlm(inputs, prefixes, tmp_path / "out")
    with pytest.raises(ConvertError, match="not a vision tower"):
        combine_vlm(inputs[:2][::-1], prefixes[:2], tmp_path / "out")


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_tower_export_round_trip_is_bit_exact(tmp_path: Path, kind: str) -> None:
    """import-hf then export-hf: the source's tensors (the pooling parts kept aside
    included) bit for bit, and transformers loads the folder."""
    from safetensors.torch import load_file

    from mg.ckpt_convert.export_hf import export_hf

    _tower(kind, tmp_path / "hf")
    import_hf(str(tmp_path / "hf"), tmp_path / "mg", progress=False)
    export_hf(tmp_path / "mg", tmp_path / "back", progress=False)
    source = load_file(str(tmp_path / "hf" / "model.safetensors"))
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(back) == sorted(source)
    for name, tensor in source.items():
        assert torch.equal(back[name], tensor), name
    model = (CLIPVisionModel if kind == "clip" else SiglipVisionModel).from_pretrained(
        tmp_path / "back"
    )
    assert type(model).__name__ == ("CLIPVisionModel" if kind == "clip" else "SiglipVisionModel")


def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ViTModel(ViTConfig(**TOWER, image_size=28, patch_size=14)).save_pretrained(tmp_path / "vit")
    capsys.readouterr()  # transformers' progress bar
    with pytest.raises(SystemExit) as exit_info:
        main(["import-hf", str(tmp_path / "vit"), "--save", str(tmp_path / "mg")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mg-convert import-hf: error:") and "ViTModel" in err
    assert "\n" not in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exit_info:
        main(["combine-vlm", "--input", str(tmp_path / "vit"), "--prefixes", "language_model"]
             + ["--save", str(tmp_path / "out")])  # fmt: skip
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "--prefixes: a vision_model input is needed" in err and "\n" not in err
