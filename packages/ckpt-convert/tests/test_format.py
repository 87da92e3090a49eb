"""mg-convert format: torch ↔ torch_dist round trips bit-exact, any source layout, inspect."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # pytest runs with --import-mode=importlib
from reshard_helpers import (  # noqa: E402
    CONFIGS,
    TOKENIZER,
    assert_same_tensors,
    build,
    logits,
    model_tensors,
    save_source,
)

from mg.ckpt_convert.cli import main  # noqa: E402
from mg.ckpt_convert.errors import ConvertError  # noqa: E402
from mg.ckpt_convert.format_convert import convert_format  # noqa: E402
from mg.ckpt_convert.inspect_checkpoint import summarize  # noqa: E402
from mg.ckpt_convert.reshard import reshard  # noqa: E402
from mg.core.checkpoint import load_model, mg_metadata  # noqa: E402
from mg.core.checkpoint.dist_format import (  # noqa: E402
    load_common,
    load_full_state,
    save_dist_checkpoint,
)

IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(2))
QUIET = {"report": lambda _: None}


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_torch_to_torch_dist_and_back_is_bit_exact(tmp_path, kind):
    model = build(CONFIGS[kind])
    save_source(tmp_path / "src", model)
    convert_format(tmp_path / "src", tmp_path / "dist", "torch_dist", **QUIET)
    folder = tmp_path / "dist" / "iter_0000007"
    assert (folder / "metadata.json").is_file() and (folder / ".metadata").is_file()
    assert_same_tensors(load_full_state(folder), model.state_dict())
    common = load_common(folder)
    assert common["iteration"] == 7 and "optimizer" not in common and "rng_state" not in common
    assert common["mg"]["tokenizer_config"] == TOKENIZER
    assert (tmp_path / "dist" / "tokenizer" / "tokenizer.json").is_file()
    assert torch.equal(logits(tmp_path / "dist", IDS), logits(tmp_path / "src", IDS))

    convert_format(tmp_path / "dist", tmp_path / "back", "torch", **QUIET)
    assert_same_tensors(model_tensors(tmp_path / "back", 1, 1)[(0, 0)], model.state_dict())


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_tp2_pp2_torch_to_torch_dist_keeps_the_layout_on_the_way_back(tmp_path, kind):
    model = build(CONFIGS[kind])
    save_source(tmp_path / "src", model)
    reshard(tmp_path / "src", tmp_path / "tp2pp2", 2, 2, **QUIET)
    convert_format(tmp_path / "tp2pp2", tmp_path / "dist", "torch_dist", **QUIET)
    assert_same_tensors(load_full_state(tmp_path / "dist" / "iter_0000007"), model.state_dict())
    assert load_common(tmp_path / "dist" / "iter_0000007")["mg"]["parallel"]["tp"] == 2
    convert_format(tmp_path / "dist", tmp_path / "back", "torch", **QUIET)  # keeps TP2 PP2
    before = model_tensors(tmp_path / "tp2pp2", 2, 2)
    after = model_tensors(tmp_path / "back", 2, 2)
    for key in before:
        assert_same_tensors(after[key], before[key])
    convert_format(tmp_path / "dist", tmp_path / "tp4", "torch", tp=4, pp=1, **QUIET)
    assert torch.equal(logits(tmp_path / "tp4", IDS), logits(tmp_path / "src", IDS))


def test_release_checkpoint_and_trainer_written_torch_dist(tmp_path):
    """`release` (what import-hf writes) survives both ways; a torch_dist save made the
    way mg-train makes it (model.* keys through DCP) converts to torch."""
    model = build(CONFIGS["llama"])
    save_source(tmp_path / "src", model, iteration="release")
    convert_format(tmp_path / "src", tmp_path / "dist", "torch_dist", **QUIET)
    assert (tmp_path / "dist" / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert torch.equal(logits(tmp_path / "dist", IDS), logits(tmp_path / "src", IDS))

    meta = mg_metadata(model.config.to_dict(), None, tp=1, pp=1)
    save_dist_checkpoint(tmp_path / "trained", 30, {"model": model.state_dict()}, {"mg": meta})
    convert_format(tmp_path / "trained", tmp_path / "torch", "torch", tp=2, **QUIET)
    assert torch.equal(logits(tmp_path / "torch", IDS), logits(tmp_path / "src", IDS))
    _, _, _, info = load_model(tmp_path / "torch")
    assert info.iteration == 30


def test_inspect_shows_both_formats(tmp_path, capsys):
    model = build(CONFIGS["gpt2"])
    save_source(tmp_path / "src", model)
    main(
        [
            "format",
            "--to",
            "torch_dist",
            "--load",
            str(tmp_path / "src"),
            "--save",
            str(tmp_path / "dist"),
        ]
    )
    out = capsys.readouterr().out
    assert "torch (TP=1, PP=1) → torch_dist" in out and "not carried over" in out
    dist = summarize(tmp_path / "dist")
    torch_ = summarize(tmp_path / "src")
    assert dist["parameters"] == torch_["parameters"] == sum(p.numel() for p in model.parameters())
    assert dist["model_config"] == torch_["model_config"] and dist["iteration"] == 7
    assert dist["layout"].startswith("torch_dist")
    main(["inspect", str(tmp_path / "dist")])
    text = capsys.readouterr().out
    assert "torch_dist (any layout; saved from TP=1, PP=1)" in text and "whole model" in text


def test_format_refusals(tmp_path, capsys):
    save_source(tmp_path / "src", build(CONFIGS["llama"]))
    with pytest.raises(ConvertError, match="num_layers \\(4\\)"):
        convert_format(tmp_path / "src", tmp_path / "out", "torch", pp=3)
    convert_format(tmp_path / "src", tmp_path / "dist", "torch_dist", **QUIET)
    with pytest.raises(ConvertError, match="torch_dist checkpoint, which loads into any layout"):
        reshard(tmp_path / "dist", tmp_path / "out", 2, 1)
    with pytest.raises(SystemExit):
        main(["format", "--to", "safetensors", "--load", "a", "--save", "b"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_export_hf_reads_any_format_and_layout_to_the_same_files(tmp_path, kind):
    """torch TP1/PP1 (reference), torch TP2 x PP2 and torch_dist export byte-identical tensors."""
    from safetensors.torch import load_file

    from mg.ckpt_convert.export_hf import export_hf

    model = build(CONFIGS[kind])
    save_source(tmp_path / "src", model)
    reshard(tmp_path / "src", tmp_path / "tp2pp2", 2, 2, **QUIET)
    convert_format(tmp_path / "tp2pp2", tmp_path / "dist", "torch_dist", **QUIET)
    exported = {}
    for name in ("src", "tp2pp2", "dist"):
        export_hf(tmp_path / name, tmp_path / f"hf-{name}", progress=False)
        exported[name] = load_file(tmp_path / f"hf-{name}" / "model.safetensors")
        config = (tmp_path / f"hf-{name}" / "config.json").read_text()
        assert config == (tmp_path / "hf-src" / "config.json").read_text()
    assert_same_tensors(exported["tp2pp2"], exported["src"])
    assert_same_tensors(exported["dist"], exported["src"])


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_te_spec_gpt_goes_to_megatrons_torch_dist_layout(tmp_path, kind):
    """A TE-spec GPT (`linear_qkv.layer_norm_weight`) converts into Megatron-Core's key
    layout, as the local spec does: the layout follows from the config, not the names."""
    import dataclasses

    from mg.core.checkpoint.megatron_dist import checkpoint_is_megatron_layout

    config = dataclasses.replace(CONFIGS[kind], transformer_impl="transformer_engine")
    model = build(config)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in model.state_dict()
    save_source(tmp_path / "src", model)
    convert_format(tmp_path / "src", tmp_path / "dist", "torch_dist", **QUIET)
    assert checkpoint_is_megatron_layout(tmp_path / "dist" / "iter_0000007")
    assert torch.equal(logits(tmp_path / "dist", IDS), logits(tmp_path / "src", IDS))
