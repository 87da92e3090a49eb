"""mg-convert for gpt-oss: a random GptOssForCausalLM from transformers → import-hf → our
logits (fp32, a sequence longer than the sliding window, sliding and full layers, sinks,
biased router and experts, YaRN); export-hf → the same tensors bit for bit and the same
logits; MXFP4 expert weights (blocks and scales built here) dequantised on import as
transformers dequantises them; export-megatron / import-megatron with Megatron-LM's
args naming gpt-oss's pieces and the sinks split over TP with the heads."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from mg.ckpt_convert.cli import main  # noqa: E402
from mg.ckpt_convert.megatron_lm import (  # noqa: E402
    export_megatron,
    import_megatron,
    megatron_args_from_config,
)
from mg.core.checkpoint import load_checkpoint  # noqa: E402
from mg.core.checkpoint.dist_format import stored_keys  # noqa: E402
from mg.core.checkpoint.megatron_args import config_from_megatron_args  # noqa: E402
from mg.core.checkpoint.model_io import load_model  # noqa: E402
from mg.core.models.gpt_oss_hf import MEGATRON_GPT_OSS_YARN  # noqa: E402

pytestmark = pytest.mark.compat

TOL = 1e-4
VOCAB = 128
WINDOW = 6


def _config():
    return transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,  # sliding, full
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        sliding_window=WINDOW,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 8,
        },
    )


def _make(folder) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(_config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.3 if "norm" in name else 0.2)
    model.eval().save_pretrained(folder)
    return model


def _tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _ids():
    return torch.randint(0, VOCAB, (2, 4 * WINDOW), generator=torch.Generator().manual_seed(1))


def test_gpt_oss_import_export_round_trip(tmp_path):
    hf = _make(tmp_path / "hf")
    ids = _ids()
    with torch.no_grad():
        expected = hf(ids).logits

    main(["import-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")])
    model, config, _, _ = load_model(tmp_path / "ckpt")
    assert config.window_size == (WINDOW - 1, 0) and config.window_attn_skip_freq == 2
    assert config.softmax_type == "learnable" and config.activation == "quick_geglu"
    assert config.rope_type == "yarn" and not config.yarn_correction_range_round_to_int
    with torch.no_grad():
        ours = model.eval()(ids)[..., :VOCAB]
    assert (ours - expected).abs().max().item() <= TOL

    main(["export-hf", "--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "out")])
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(reloaded).__name__ == "GptOssForCausalLM"
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, expected)
    original, exported = _tensors(tmp_path / "hf"), _tensors(tmp_path / "out")
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    source = json.loads((tmp_path / "hf" / "config.json").read_text())
    for key in ("layer_types", "sliding_window", "rope_parameters", "swiglu_limit"):
        assert written[key] == source[key], key


def test_mxfp4_experts_are_dequantised_on_import(tmp_path):
    """OpenAI's layout: `*_blocks` [E, rows, cols/32, 16] and `*_scales` [E, rows, cols/32]
    in place of each expert weight; our import equals transformers' dequantisation."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = _make(tmp_path / "hf")
    tensors = _tensors(tmp_path / "hf")
    g = torch.Generator().manual_seed(2)
    quantised = dict(tensors)
    state = hf.state_dict()
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, cols, rows = tensors[name].shape  # transformers' [E, in, out]
        blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=g).to(torch.uint8)
        scales = torch.randint(121, 126, (experts, rows, cols // 32), generator=g).to(torch.uint8)
        del quantised[name]
        quantised[name + "_blocks"], quantised[name + "_scales"] = blocks, scales
        state[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    hf.load_state_dict(state)
    folder = tmp_path / "mxfp4"
    folder.mkdir()
    save_file(quantised, folder / "model.safetensors")
    (folder / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    main(["import-hf", str(folder), "--save", str(tmp_path / "ckpt")])
    model, _, _, _ = load_model(tmp_path / "ckpt")
    ids = _ids()
    with torch.no_grad():
        expected = hf.eval()(ids).logits
        ours = model.eval()(ids)[..., :VOCAB]
    assert (ours - expected).abs().max().item() <= TOL


def test_a_trained_gpt_oss_shaped_model_exports_as_gpt_oss():
    """A model trained by mg-train (no recorded HF type) with learnable sinks is gpt-oss."""
    import dataclasses

    from mg.ckpt_convert.export_hf import guess_architecture
    from mg.core.models.hf_mapping import config_from_hf

    config = config_from_hf(json.loads(_config().to_json_string()))
    assert guess_architecture(dataclasses.replace(config, extra={}), []) == "gpt_oss"


QUIET = {"report": lambda *_: None}


def _imported(tmp_path):
    _make(tmp_path / "hf")
    main(["import-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ours")])
    return _ids()


def test_megatron_args_name_gpt_oss_pieces(tmp_path):
    _imported(tmp_path)
    model, config, _, _ = load_model(tmp_path / "ours")
    megatron = dataclasses.replace(config, **MEGATRON_GPT_OSS_YARN, max_position_embeddings=256)
    args = vars(megatron_args_from_config(megatron, None))
    assert args["quick_geglu"] and args["softmax_type"] == "learnable"
    assert (args["glu_linear_offset"], args["activation_func_clamp_value"]) == (1.0, 7.0)
    assert args["window_size"] == [5, 0] and args["window_attn_skip_freq"] == 2
    assert args["enable_gpt_oss"]  # Megatron's own YaRN values
    back = config_from_megatron_args(args)
    for name in (
        "activation",
        "glu_linear_offset",
        "activation_func_clamp_value",
        "softmax_type",
        "window_size",
        "window_attn_skip_freq",
        *MEGATRON_GPT_OSS_YARN,
    ):
        assert getattr(back, name) == getattr(megatron, name), name


@pytest.mark.parametrize("tp", [2])
def test_gpt_oss_megatron_round_trip(tmp_path, tp):
    ids = _imported(tmp_path)
    model, config, _, _ = load_model(tmp_path / "ours")
    with torch.no_grad():
        expected = model.eval()(ids)
    export_megatron(tmp_path / "ours", tmp_path / "megatron", tp=tp, **QUIET)
    ranks = [
        load_checkpoint(tmp_path / "megatron", tp_rank=r, allow_pickle=True)[0] for r in (0, 1)
    ]
    name = "decoder.layers.0.self_attention.core_attention.softmax_offset"
    sinks = model.state_dict()[name]
    assert torch.equal(torch.cat([r["model"][name] for r in ranks]), sinks)  # by heads
    assert ranks[0]["args"].quick_geglu and ranks[0]["args"].softmax_type == "learnable"
    import_megatron(tmp_path / "megatron", tmp_path / "back", tp=1, **QUIET)
    back, *_ = load_model(tmp_path / "back")
    with torch.no_grad():
        assert torch.equal(back.eval()(ids), expected)
    export_megatron(tmp_path / "ours", tmp_path / "dist", ckpt_format="torch_dist", **QUIET)
    folder = tmp_path / "dist" / "release"  # import-hf writes a release checkpoint
    assert "decoder.layers.self_attention.core_attention.softmax_offset" in stored_keys(folder)
    dist, *_ = load_model(tmp_path / "dist")
    with torch.no_grad():
        assert torch.equal(dist.eval()(ids), expected)
