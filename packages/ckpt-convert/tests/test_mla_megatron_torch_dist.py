"""Megatron-Core's `torch_dist` both ways for a GPT with multi-latent attention (and
YaRN), against megatron-core 0.16.1 on CPU (one rank, local spec): megatron-core saves
it as Megatron-LM does, `import-megatron` gives an mg checkpoint with the same logits,
and `format --to torch_dist` of that writes a checkpoint megatron-core's
`dist_checkpointing.load` fills its model from, with the same logits again."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("megatron.core")

from mg.ckpt_convert.format_convert import convert_format  # noqa: E402
from mg.ckpt_convert.megatron_lm import import_megatron, megatron_args_from_config  # noqa: E402
from mg.core.checkpoint import load_model  # noqa: E402
from mg.core.models import TransformerConfig  # noqa: E402
from mg.core.testing.megatron_dist_checkpoint import (  # noqa: E402
    dist_checkpointing_cpu_patches,
    load_into_megatron,
    save_like_megatron_lm,
)
from mg.core.testing.megatron_reference import (  # noqa: E402
    megatron_mla_gpt_model,
    megatron_on_cpu,
)

pytestmark = [pytest.mark.compat, pytest.mark.slow]  # megatron-core's import: ~40 s
TOL = 1e-5
QUIET = {"report": lambda *a: None}
CONFIG = TransformerConfig(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    vocab_size=128,
    ffn_hidden_size=96,
    seq_length=16,
    max_position_embeddings=64,
    position_embedding_type="rope",
    normalization="RMSNorm",
    activation="swiglu",
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    qk_layernorm=True,
    attention_dropout=0.0,
    hidden_dropout=0.0,
    multi_latent_attention=True,
    q_lora_rank=32,
    kv_lora_rank=24,
    qk_head_dim=16,
    qk_pos_emb_head_dim=8,
    v_head_dim=12,
    rope_type="yarn",
    rotary_scaling_factor=4.0,
    original_max_position_embeddings=8,
    mscale=1.0,
    mscale_all_dim=1.0,
)


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron.core warns that TE and Apex are missing
        with megatron_on_cpu(tmp_path_factory.mktemp("pg")):
            patches = pytest.MonkeyPatch()
            dist_checkpointing_cpu_patches(patches)
            yield
            patches.undo()


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)


def test_mla_megatron_torch_dist_to_mg_and_back(megatron, tmp_path) -> None:
    torch.manual_seed(0)
    model = megatron_mla_gpt_model(CONFIG)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    args = megatron_args_from_config(CONFIG, None)
    args.consumed_train_samples, args.ckpt_format = 80, "torch_dist"
    save_like_megatron_lm(tmp_path / "meg", model, args, 10)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    theirs = _logits(model, ids)

    import_megatron(tmp_path / "meg", tmp_path / "mg", **QUIET)
    ours, config, _, _ = load_model(tmp_path / "mg")
    assert config.multi_latent_attention and config.rope_type == "yarn"
    with torch.no_grad():
        assert (ours.eval()(ids) - theirs).abs().max() <= TOL

    convert_format(tmp_path / "mg", tmp_path / "dist", "torch_dist", **QUIET)
    fresh = megatron_mla_gpt_model(CONFIG)
    load_into_megatron(tmp_path / "dist" / "iter_0000010", fresh)
    assert torch.equal(_logits(fresh, ids), theirs)
